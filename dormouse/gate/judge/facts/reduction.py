"""Fact: the reduction, judged with no reference (a recording made with
RecordingSpec(selfcheck=k)).

reduction     at every step, each rank's synchronised gradient is the mean (or
              sum) of the ranks' local gradients, tensor by tensor, at the k
              elements the Recorder read before and after the reduce; replicas'
              parameters equal; the logged loss the ranks' loss sum over their
              token count (artifacts/selfcheck.py: the rule and its bound). The
              judge recomputes every finding from the recorded sketches; what the
              run concluded itself (and a run that stopped itself) is evidence too.

The functions of one step read the files of that step alone (any recording,
finished or still being written): `gate check --follow` calls them as the
steps arrive.
"""

from __future__ import annotations

import json

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import selfcheck as rule
from dormouse.gate.judge.verdict import Check

PREFIXES = (A.LOCAL_SKETCH, A.ABS_SKETCH, A.SYNC_SKETCH, A.PARAM_SKETCH)


def read_prefixed(path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of one file whose names start with one of `prefixes` (the rest not read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys() if n.startswith(prefixes)}


def tensor_info(out) -> tuple[list[str], dict[str, int], dict[str, str]]:
    """Every tensor of the initial state: names, global element counts, dtypes (headers only)."""
    from safetensors import safe_open

    with safe_open(str(A.init_path(out, 0)), framework="pt") as f:
        pl = json.loads((f.metadata() or {}).get("placements", "{}"))
        names = list(f.keys())
        numel, dtype = {}, {}
        for n in names:
            sl = f.get_slice(n)
            shape = pl[n]["shape"] if pl.get(n) else sl.get_shape()
            numel[n] = int(torch.Size(shape).numel())
            dtype[n] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}.get(
                sl.get_dtype(), "float32")
    return names, numel, dtype


def step_findings(out, step: int, metas: list[dict], info, sharded: bool, wire: str) -> list[str] | None:
    """The findings of one recorded step from every rank's sketches (None: the step has no in-run checks)."""
    checks = [m.get("selfcheck") for m in metas]
    if not all(isinstance(c, dict) for c in checks):
        return None
    names, numel, dtype = info
    pieces = [read_prefixed(A.step_tensors_path(out, r, step), PREFIXES) for r in range(len(metas))]

    def part(p, prefix):
        return {n[len(prefix):]: p[n] for n in p if n.startswith(prefix)}

    loc = [part(p, A.LOCAL_SKETCH) for p in pieces]
    mags = [part(p, A.ABS_SKETCH) for p in pieces]
    syn = [part(p, A.SYNC_SKETCH) for p in pieces]
    par = [] if sharded else [part(p, A.PARAM_SKETCH) for p in pieces]
    order = [n for n in names if any(n in s for s in syn) or any(n in x for x in loc)]
    micro = max(int(m.get("micro_batches") or 1) for m in metas)
    clips = [m.get("clip_coef") if m.get("clipped") else None for m in metas]
    reduction = checks[0].get("reduction", "mean")
    if clips[0] is None and checks[0].get("clip_implied") is not None:  # the run clipped and never said by how much
        clips = [rule.implied_clip(loc, syn, order, reduction, sharded)] * len(metas)
    losses = [(m.get("loss"), c.get("loss_sum"), c.get("tokens")) for m, c in zip(metas, checks)]
    return rule.step_findings(loc, mags, syn, par, names=order, dtype=dtype, micro=micro, clips=clips,
                              wire=wire, reduction=reduction, sharded=sharded, losses=losses)


def check_reduction(rec: A.RecordingSet) -> Check | None:
    """The fact over every recorded step (None: the recording has no in-run checks)."""
    stopped = rec.recorded.stopped
    steps = [k for k in rec.steps if isinstance(rec.step_meta(0, k).get("selfcheck"), dict)]
    if not steps and not stopped:
        return None
    info = tensor_info(rec.out)
    sharded, wire = rec.recorded.fsdp, rec.spec.wire
    for k in steps:
        metas = [rec.step_meta(r, k) for r in range(rec.world_at(k))]
        found = step_findings(rec.out, k, metas, info, sharded, wire)
        if found:
            return Check("reduction", False, f"at step {k}: {'; '.join(found[:3])}" + ("; ..." if len(found) > 3 else ""))
    if stopped:
        return Check("reduction", False, f"the run stopped itself at step {stopped.get('step')} (stop_on_fail): "
                                         f"{'; '.join((stopped.get('findings') or ['no cause recorded'])[:3])}")
    sc = rec.step_meta(0, steps[0])["selfcheck"]
    return Check("reduction", True, f"on {sc.get('k')} sampled elements per tensor (drawn anew each step), every "
                                    f"rank's synchronised gradient is the {sc.get('reduction', 'mean')} of the "
                                    f"ranks' local gradients at all {len(steps)} steps (no reference needed; a "
                                    "fault in the elements not sampled is the full gradient check's to find)")
