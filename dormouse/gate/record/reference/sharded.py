"""The one-process reference past one process: `torchrun --nproc_per_node N -m dormouse gate check
--out DIR` writes the same <out>/reference/ files as `dormouse gate check` in one process, so the
judge reads them unchanged.

The gradients' pass: the model sharded by FSDP2 over the N ranks (fsdp.py). Every backward one
process takes at a step (each micro-batch's, its normalised form, the RNG check, fact 1's rows, the
merged forwards, the probe's two passes) is shared out, job j on rank j mod N, in lockstep
(lockstep.py). FSDP2 never reduces: each backward's full float32 gradient, bitwise the one one
process computes (the same kernels on the all-gathered parameters), is written by its rank to the
step's scratch folder, and rank 0 sums them in float64 with one process's weights in one process's
order (sums.py), tensor by tensor, into the step's file: the reduction under test (FSDP2's
reduce-scatter among them) is never the reference's. The scratch folder is under <out>: on
several nodes, <out> is on a file system every node sees (where the fleet recorded it).

The replay (the user's optimizer on the recorded gradients, compared bitwise) runs on rank 0 alone,
first, as in one process (a sharded optimizer and clip would sum the norm in another order).
Memory: every rank builds the full model (build_model, checked against the recorded initial
state) before sharding it; rank 0 holds, during the replay, one model, its gradient and the
optimizer's state; then every rank 1/N of the parameters, one FSDP2 unit in full at a time, its
activations, and one backward's full gradient until written; rank 0 forms each output tensor by
tensor (row ranges of a large one).

Refused in one line: sketched or every-k-th-step recordings (the reference would train the run),
reduced precision (autocast, cast or bfloat16 parameters), objective_scope "step", a buffer_update
rule: `dormouse gate check` in one process judges them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dormouse import atomic
from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record.options import OBJECTIVES
from dormouse.gate.record.userfns import import_path
from dormouse.gate.record.probe import is_probe_step as probe_step
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import fsdp
from dormouse.gate.record.reference import lockstep as L
from dormouse.gate.record.reference import objective as O
from dormouse.gate.record.reference.error import ReferenceError
from dormouse.gate.record.reference.gradients import _no_forward_info as no_forward_info
from dormouse.gate.record.reference.sample import ExtrasBudget, example_sample
from dormouse.gate.record.reference.rebuild import check_provenance, rebuild
from dormouse.gate.record.reference.replay import replay_params
from dormouse.gate.record.reference.spill import Spill
from dormouse.gate.record.reference.staleness import REFERENCE_SCHEMA, is_current, staleness_key
from dormouse.gate.record.reference.spilled import finish, tally


def _unsupported(rec: A.RecordingSet) -> str | None:
    if rec.spec.sketch or rec.spec.every != 1:
        return "it is sketched or holds tensors at every k-th step only (the reference would train the run)"
    if rec.spec.objective_scope == "step":
        return "its objective is declared over the whole step (objective_scope='step')"
    if rec.spec.buffer_update:
        return "it declares a buffer_update rule"
    if rec.autocast_dtypes() or rec.compute_dtypes():
        return "it ran in reduced precision (autocast or cast parameters)"
    if any(str(t.dtype) in ("torch.bfloat16", "torch.float16") for t in rec.init().values()):
        return "its parameters are bfloat16 or float16"
    return None


# --------------------------------------------------------------------------- the jobs of a step


def plan(rec: A.RecordingSet, step: int, mbs, examples: int | None, probe: bool, objective: str):
    """Every backward one process takes at `step`, in its order: (kind, i, j) with kind "g" (micro-batch
    i), "gn" (its normalised form), "rng" (micro-batch 0 under another RNG state), "ex" (row j of
    micro-batch i), "gm" (merged forward j); and the merge plan (chunks, words)."""
    sample = example_sample(mbs, examples) if examples is not None else set()
    normalised = objective in OBJECTIVES and sum(O.objective_count(objective, b) for _, _, b in mbs) > 0
    jobs = []
    for i, (_, _, batch) in enumerate(mbs):
        jobs.append(("g", i, 0))
        if normalised:
            jobs.append(("gn", i, 0))
        if probe and i == 0:
            jobs.append(("rng", i, 0))
        if i in sample:
            jobs += [("ex", i, j) for j in range(len(O.rows(batch)))]
    chunks, words = [], None
    if examples is not None:
        extras = [json.dumps([rec.autocast(r, step, m), rec.compute_dtype(r, step, m),  # as spilled.py's merge
                              BS.attr_changes_at(rec, r, step, m)], sort_keys=True, default=str) for r, m, _ in mbs]
        chunks, words = BS.merge_plan([b for _, _, b in mbs], extras)
        jobs += [("gm", c, 0) for c in range(len(chunks))]
    return jobs, chunks, words


def _backward(model, st: L.Step, index: int, job) -> dict:
    """Job `index`'s backward on this rank, its full gradient written to the scratch folder."""
    from dormouse.gate.artifacts.tensorfile import write_streamed

    scale = st.w_step / st.n_step if job[0] == "gn" else 1.0

    def fn(batch):
        ls, c = FW.backward(model, st.objective, batch, st.user, None, scale=scale, aux_weight=st.aw)
        held = fsdp.take_grads(model)
        write_streamed(st.scratch / f"{index}.safetensors", [(n, g.dtype, tuple(g.shape)) for n, g in held],
                       iter(held), durable=False)
        return {"ls": ls, "c": c, "have": [n for n, _ in held],
                "partial": math.sqrt(sum(float(g.double().square().sum()) for _, g in held))}

    got = L.guarded(model, st, job, 1 if job[0] == "rng" else 0, fn)
    if job[0] == "gm" and got.get("bad_input"):  # a merged forward that cannot be computed: said, as in one process
        return {"gm_error": got["error"]}
    return got


def _probed(model, st: L.Step, index: int, job) -> dict:
    """Job `index` of the probe (record/probe.py's reference_probe, one pass): every module's output
    and output gradient on micro-batch i, written to the scratch folder under its rank's probe prefix (the
    parameters one ulp away: "probe_n"; layout.py's PROBE_* names). As in one process, the nudged pass
    starts from the RNG state the first one left (job i of both passes runs on one rank)."""
    from dormouse.gate.artifacts.tensorfile import write_streamed
    from dormouse.gate.record.probe import capture

    r = st.mbs[job[1]][0]
    outs_at, grads_at = ((A.PROBE_NUDGED_OUTPUT, A.PROBE_NUDGED_GRAD) if job[0] == "probe_n"
                         else (A.PROBE_REF_OUTPUT, A.PROBE_REF_GRAD))

    def fn(batch):
        if job[0] == "probe_n":
            torch.random.set_rng_state(st.rng_after.pop(index))
        outs, grads, _ = capture(model, lambda: O.objective_sum(st.objective, model, batch, st.user,
                                                                aux_weight=st.aw)[0].backward())
        if job[0] == "probe":
            st.rng_after[index] = torch.random.get_rng_state()
        fsdp.take_grads(model)
        held = [(A.probe_prefix(r) + outs_at + n, v) for n, v in outs.items()]
        held += [(A.probe_prefix(r) + grads_at + n, v) for n, v in grads.items()]
        write_streamed(st.scratch / f"{job[0]}{index}.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in held],
                       iter(held), durable=False)
        return {}

    return L.guarded(model, st, job, 0, fn)


def _probe(model, st: L.Step, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The probe's one-process side on every rank's first micro-batch (rank 0: its tensors; else
    {}): at the recorded parameters, then at parameters one ulp away (every rank nudging its shards;
    the next step loads the recorded ones again)."""
    import torch.distributed as dist

    from dormouse.gate.artifacts.tensorfile import LazyTensors

    firsts = [i for i, (_, m, _) in enumerate(st.mbs) if m == 0]
    jobs = [("probe", i, 0) for i in firsts]
    L.run_jobs(model, st, jobs, _probed, rank, world)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                local = p.to_local()
                local.copy_(torch.nextafter(local, torch.full_like(local, math.inf)))
    L.run_jobs(model, st, [("probe_n", i, 0) for i in firsts], _probed, rank, world)
    dist.barrier()
    if rank != 0:
        return {}
    out: dict[str, torch.Tensor] = {}
    for kind in ("probe", "probe_n"):
        for index in range(len(jobs)):
            f = LazyTensors([st.scratch / f"{kind}{index}.safetensors"], "the sharded reference's scratch")
            out.update({k: f[k] for k in f})
    return out


# --------------------------------------------------------------------------- one step, on rank 0


def _same(spill: Spill, a: int, b: int) -> bool:
    fa, fb = spill.files[a], spill.files[b]
    return set(fa) == set(fb) and all(torch.equal(fa[n], fb[n]) for n in fa)


def _step_parts(model, st: L.Step, jobs, results, examples, words, names, shapes):
    """The step's outputs and figures from the jobs' spilled gradients, every source added as one process
    adds it, in its order (spilled.py's tally and finish)."""
    from dormouse.gate.artifacts.tensorfile import LazyTensors

    spill = Spill(model, st.scratch)
    for index, _ in enumerate(jobs):  # every rank's gradient files, in the plan's order (none: a failed merge)
        path = st.scratch / f"{index}.safetensors"
        spill.files.append(LazyTensors([path], "the sharded reference's scratch") if path.exists() else {})
    t = tally(st.rec, st.step, model, st.mbs, [], examples)
    by = {job: index for index, job in enumerate(jobs)}
    for i in range(len(st.mbs)):
        g = by[("g", i, 0)]
        t.add_micro(spill, st.mbs, i, g, set(results[g]["have"]), results[g]["ls"], results[g]["c"],
                    results[g]["partial"])
        if ("gn", i, 0) in by:
            spill.add(A.GRAD_NORMALISED, by[("gn", i, 0)], 1.0 / st.w_step)
        if ("rng", i, 0) in by:
            t.rng_sensitive = not _same(spill, g, by[("rng", i, 0)])
        for index in (x for x, job in enumerate(jobs) if job[0] == "ex" and job[1] == i):
            spill.add(A.SAMPLED, index)
    gm = [index for index, job in enumerate(jobs) if job[0] == "gm"]
    failed = next((results[x]["gm_error"] for x in gm if "gm_error" in results[x]), None)
    for index in gm if failed is None else []:
        spill.add(A.GRAD_MERGED, index)
    merged = None if not gm else {"error": failed, "words": words, "forwards": len(gm)} if failed else {
        "forwards": len(gm), "words": words, "count": sum(results[x]["c"] for x in gm),
        "rows": sum(next((v.shape[0] for v in b.values() if isinstance(v, torch.Tensor) and v.dim()), 0)
                    for _, _, b in st.mbs)}
    parts = finish(t, spill, st.rec, st.step, model, st.mbs, [], merged, names, shapes, torch.float32)
    return parts, parts.info


def _gradients(model, rec: A.RecordingSet, k: int, user, *, budget: ExtrasBudget, probe: bool, rank: int,
               world: int):
    """Step k's (parts, info, the probe's tensors) on rank 0 ((None, None, {}) elsewhere), every rank
    computing its share; the rows alone and merged where `budget` takes the step (sample.py)."""
    import torch.distributed as dist

    objective = rec.spec.objective
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    mbs = BS.forward_inputs(rec, k)
    if not mbs:
        return ({}, no_forward_info(names, rec), {}) if rank == 0 else (None, None, {})
    examples = budget.take(mbs)
    jobs, chunks, words = plan(rec, k, mbs, examples, probe, objective)
    scratch = A.reference_scratch_dir(rec.out) / f"step{k}"
    scratch.mkdir(parents=True, exist_ok=True)
    st = L.Step(rec, k, mbs, user, chunks, O.aux_weight(objective, model, mbs), scratch)
    results = L.run_jobs(model, st, jobs, _backward, rank, world)
    extra = _probe(model, st, rank, world) if probe_step(rec, k) else {}
    dist.barrier()  # every rank's files written
    if rank != 0:
        return None, None, {}
    parts, info = _step_parts(model, st, jobs, results, examples, words, names, shapes)
    info["extras_budget"] = budget.stated()
    return parts, info, extra


def _together(fn, rank: int, on_rank0_only: bool = False):
    """fn() on every rank (on rank 0 alone with on_rank0_only), then a failure on any rank raised on every
    rank: no rank is left waiting for a peer that failed."""
    import torch.distributed as dist

    err, value = None, None
    if rank == 0 or not on_rank0_only:
        try:
            value = fn()
        except DormouseError as e:
            err = str(e)
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, err)
    if any(got):
        raise ReferenceError(next(g for g in got if g))
    return value


def make_sharded_reference(out, *, log=print, force: bool = False) -> Path:
    """<out>/reference/ for the recording in `out`, on every rank of the launch (rank 0 writes)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rec = A.RecordingSet(out)
    rec.validate()
    if not force and is_current(out):  # every rank reads the same files: the same answer
        return A.reference_meta_path(out)
    why = _unsupported(rec)
    if why:
        raise ReferenceError(f"the sharded reference cannot check this recording: {why}; run `dormouse gate "
                             "check` in one process")

    def start():
        check_provenance(rec)
        user = import_path(rec.spec.objective, "objective") if rec.spec.objective not in OBJECTIVES else None
        return user, rebuild(rec)

    user, model = _together(start, rank)
    scan = FW.scan(model)

    def replay():  # rank 0 alone: one full model and the optimizer's state (the module docstring)
        for stale in A.reference_dir(out).glob("*.replay.safetensors"):
            stale.unlink()
        log(f"reference for {out}: {len(rec.steps)} steps, mode replay, sharded over {world} ranks (FSDP2)")
        return replay_params(out, rec, model)

    lrs, scheduled = _together(replay, rank, on_rank0_only=True) or ({}, None)
    fsdp.shard(model, world)
    budget = ExtrasBudget()  # the steps that get the rows alone and merged: one process's (sample.py)
    for i, k in enumerate(rec.steps):
        fsdp.load(model, rec.tensors_at(k, A.PARAM), rec.tensors_at(k, A.BUFFER))
        FW.set_modes(model, rec.eval_modules(k))
        parts, info, extra = _gradients(model, rec, k, user, budget=budget, probe=(i == 0), rank=rank, world=world)
        if rank == 0:
            _write_step(out, k, parts, extra, {**info, "step": k, "replay_lr": lrs[k], "mode": "replay", **scan})
    if rank != 0:
        return A.reference_meta_path(out)
    meta = {"schema": REFERENCE_SCHEMA, "kind": "reference", "key": staleness_key(rec), "run": rec.run,
            "mode": "replay", "steps": rec.steps, "scheduler": scheduled, "buffer_rule": None,
            "sharded": {"ranks": world, "engine": "FSDP2"}, **scan}
    return atomic.write_text(A.reference_meta_path(out), json.dumps(meta, indent=1))


def _write_step(out, k: int, parts, extra: dict, info: dict) -> None:
    """Step k's reference file (outputs formed tensor by tensor, then the probe's) and its info."""
    from dormouse.gate.artifacts.tensorfile import write_streamed
    from dormouse.gate.record.reference.spill import StepParts

    path = A.reference_step_tensors_path(out, k)
    if isinstance(parts, StepParts):
        parts.write(path, extra)
    else:  # a step with no forward: nothing but what the probe holds
        write_streamed(path, [(n, v.dtype, tuple(v.shape)) for n, v in extra.items()], iter(extra.items()), sync=False)
    atomic.write_text(A.reference_step_meta_path(out, k), json.dumps(info, indent=1))


def sharded_note(out) -> str | None:
    """The verdict's line on a reference computed here (None for one process's)."""
    try:
        meta = json.loads(A.reference_meta_path(out).read_text()).get("sharded")
    except (OSError, ValueError):
        return None
    if not meta:
        return None
    return (f"the one-process reference was computed by {meta['ranks']} ranks, the model sharded by "
            f"{meta['engine']}: every backward one process takes, shared out, each full gradient summed in "
            "float64 in one process's order (never by FSDP2's reduce-scatter); the replay on rank 0")
