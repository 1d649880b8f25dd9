"""The gate's modes: the running side. Each writes artifacts into the settings'
out dir and judges nothing (dormouse.gate.judge compares them).

single  - one process at the GLOBAL batch: the reference curve, with every
          step's parameters and gradients (trace). Beside it, its round-off
          floor: the same run started from parameters nudged by one ulp, with
          ULP_RUNS different nudges (never a run that splits the batch: that
          would share the bugs of a split). Under reduce="exact" also the
          exact reference: one process computing the fleet's own slices,
          summed in the fixed order (`exact`).
rank    - one process per rank under torchrun: the fleet (rank<r>), with the
          initial parameters (init) and, on rank 0, every step's parameters
          and reduced gradients; with settings.recording also a Recorder
          recording of the same run (out/recording: `dormouse gate check`).
gradref - from the fleet's parameters before each step (init, then rank 0's
          trace) and that step's bytes, read by its OWN arithmetic from the
          documented data rule: each window's gradient computed alone and
          weighted by the tokens counted from the targets it built,
          g = sum_w t_w g_w / sum_w t_w (summed in float64). Beside it, the
          batch's own gradient and per-token losses at the same parameters
          (the per-window premise), and the expert loads counted from the
          ranks' own slices.
replay  - the fleet's whole run replayed in one process from init: the
          fleet's recorded reduced gradients, clipped, the optimizer, and
          gradref's expert loads moving the routing bias, step after step.

Artifacts (dormouse.gate.artifacts): `<name>` holds tensors after the run, `<name>_trace`
per-step series (trace.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from dormouse.config import RunConfig
from dormouse.digest import fingerprint
from dormouse.errors import DormouseError
from dormouse.gate.artifacts import (
    fleet_recording_dir,
    load_meta,
    load_tensors,
    load_trace,
    save_artifact,
)
from dormouse.gate.artifacts.layout import INIT, rank_name
from dormouse.gate.record.fixtures import build, make_run
from dormouse.gate.record.provenance import gate_provenance
from dormouse.gate.record.trace import Trace
from dormouse.gate.settings import GateSettings, from_dict
from dormouse.numerics import BF16_UNIT_ROUNDOFF, rel_per_step
from dormouse.train.distributed import close_fleet, fleet_env, train_dist
from dormouse.train.loop import lr_at, make_optimizer, train
from dormouse.train.tensors import named_state

ULP_RUNS = 3  # one-ulp nudges of the reference whose maximum is the floor
WIRE_RUNS = 3  # under reduce="bf16": floor runs whose gradients are rounded as the wire rounds (independent draws)
QUIET = lambda line: None  # noqa: E731


# --------------------------------------------------------------------------- the seams

RunHook = Callable[[GateSettings, RunConfig], "RunConfig | None"]
ModelHook = Callable[[GateSettings, torch.nn.Module], None]
RunScope = Callable[[GateSettings], ContextManager]
_RUN_HOOKS: list[RunHook] = []
_MODEL_HOOKS: list[ModelHook] = []
_RUN_SCOPES: list[RunScope] = []


def install_run_hook(hook: RunHook) -> Callable[[], None]:
    """Add `hook` to every mode of this process: each mode's RunConfig, as
    fixtures.make_run builds it from the settings (the fleet's in every rank
    and leg, single's, exact's, gradref's, the replay's), is passed to
    hook(settings, run), which may return another RunConfig: the one the mode
    then trains and records (None: unchanged). The explicit seam for what a
    torchrun rank cannot be handed as an argument -- a benchmark's choice per
    fleet run of a plan, a test's planted fault; nothing here installs one.
    Returns the function that removes it."""
    _RUN_HOOKS.append(hook)
    return lambda: _RUN_HOOKS.remove(hook)


def install_model_hook(hook: ModelHook) -> Callable[[], None]:
    """Add `hook` to every mode of this process: every model a mode builds
    (Mode.model: the fleet's on every rank, the references', the floor runs')
    is passed to hook(settings, model) right after its seeded build, before
    anything reads it. The seam for a change to the network itself (a test's
    planted batch statistic). Returns the function that removes it."""
    _MODEL_HOOKS.append(hook)
    return lambda: _MODEL_HOOKS.remove(hook)


def install_run_scope(scope: RunScope) -> Callable[[], None]:
    """Add `scope` to every fleet run of this process: run_rank_plan enters
    scope(settings) around each run of its plan (several runs share one
    launch), so what the scope installs acts on that run alone. Returns the
    function that removes it."""
    _RUN_SCOPES.append(scope)
    return lambda: _RUN_SCOPES.remove(scope)


def deterministic_kernels(s: GateSettings) -> bool:
    """Under reduce exact on CUDA, every process of the gate runs with
    torch's deterministic algorithms (and cuBLAS's fixed workspace,
    CUBLAS_WORKSPACE_CONFIG=:4096:8, set before its first use): the exact
    mode's bitwise claim needs kernels whose results do not depend on the
    order their atomics land in (index_add_'s and scatter's backward, the
    MoE's). An operation with no deterministic kernel then raises, naming
    itself, rather than failing a fleet the gate built. On the CPU every
    kernel used is deterministic already. Returns whether it switched them on."""
    if s.device != "cuda" or s.reduce != "exact":
        return False
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    return True


# --------------------------------------------------------------------------- one mode's values


@dataclass(frozen=True)
class Mode:
    """One run of a mode, worked out once from the settings and handed down:
    the RunConfig it trains (fixtures.make_run, then every run hook), the
    device, and the settings it records. Everything a mode needs beyond them
    is derived from these, not from the settings again."""

    s: GateSettings
    run: RunConfig
    device: torch.device

    def model(self) -> torch.nn.Module:
        """A fresh seeded build of the run's network (fixtures.build), every
        model hook applied; on the CPU (the caller moves it)."""
        model = build(self.run)
        for hook in _MODEL_HOOKS:
            hook(self.s, model)
        return model

    def start_state(self, built: torch.nn.Module) -> tuple[dict, int]:
        """The parameters the mode starts from, and the step: `built` (a
        fresh Mode.model(), not yet trained) as it stands, or with
        resume_from the checkpoint's weights and steps done (read whole,
        whichever topology wrote it). Its fingerprint is every artifact's
        `init`."""
        if not self.s.resume_from:
            return named_state(built), 0
        from dormouse.train.checkpoint import load_model_weights

        model, _, step = load_model_weights(Path(self.s.resume_path()), build=lambda run: self.model())
        return named_state(model), step

    def save(self, name: str, state, losses, *, init: str, **extra) -> dict:
        """Write artifact `name` with the settings' record and this run's provenance."""
        prov = gate_provenance(device=self.s.device, corpus=Path(self.run.train.data), init=init)
        save_artifact(self.s.out_dir, name, state, losses, settings=self.s.record(), provenance=prov, **extra)
        return load_meta(self.s.out_dir, name)


def mode(s: GateSettings, **kw) -> Mode:
    """A mode's values: the RunConfig fixtures.make_run(s, **kw) gives after
    every installed run hook, and the device (deterministic kernels where the
    settings need them)."""
    deterministic_kernels(s)
    if s.device == "cuda" and not torch.cuda.is_available():
        raise DormouseError("device 'cuda' asked for but CUDA is not available: use --device cpu")
    run = make_run(s, **kw)
    for hook in _RUN_HOOKS:
        run = hook(s, run) or run
    return Mode(s, run, torch.device(s.device))


def _traced(m: Mode, model, log, run: RunConfig | None = None) -> tuple[dict, Trace]:
    trace = Trace(snapshots=True)
    report = train(model, run or m.run, log=log, on_step=trace, on_grads=trace.record_grads)
    return report, trace


# --------------------------------------------------------------------------- single


def run_single(s: GateSettings, log=print) -> dict:
    """One process at the fleet's global batch, its ulp floor, and under
    reduce="exact" the exact reference."""
    if s.plan.global_batch is None:
        raise DormouseError(f"profile {s.profile!r} mixes window lengths: one process cannot hold that "
                            "global batch as one batch; gradref and the replay are this fleet's references")
    m = mode(s, name="single", dist=False, reduce="fp32", micro_batch=0, resume_from=s.resume_path())
    model = m.model().to(m.device)
    init = fingerprint(m.start_state(model)[0])
    report, trace = _traced(m, model, log)
    trace.save(s.out_dir, "single")
    floor = measure_floor(m, trace, start=report["start_step"])
    meta = m.save("single", named_state(model), report["losses"], init=init, mode="single",
                  global_batch=m.run.train.batch, config=m.run.to_dict(), wall_s=report["wall_s"], floor=floor,
                  start_step=report["start_step"])
    if s.reduce == "exact":
        run_exact(s, log=QUIET)
    return meta


def nudge(tensors, seed: int) -> None:
    """Move every element to its next float neighbour, up or down at random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            up = (torch.rand(t.shape, generator=gen) < 0.5).to(t.device)
            t.copy_(torch.nextafter(t, torch.where(up, torch.inf, -torch.inf).to(t.dtype)))


def nudge_absolute(tensors, seed: int) -> None:
    """Move every element by one ulp of its tensor's mean magnitude, up or down
    at random: a sum's round-off is an ulp of its summands, not of the sum, so
    a near-cancelled element moves by far more than its own ulp (AdamW's
    first step, ~lr * sign(g), shows it)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            size = torch.finfo(t.dtype).eps * t.abs().mean()
            sign = (torch.rand(t.shape, generator=gen) < 0.5).to(t.device) * 2.0 - 1.0
            t.add_(sign.to(t.dtype) * size)


def round_like_wire(tensors, seed: int, *, cancel: float = 0.0) -> None:
    """Round every element to a bfloat16 value as the wire does, with a seeded
    dither: x -> SR(x + xi u m), xi uniform in (-1, 1), m the tensor's mean
    magnitude, u = 2^-8, and SR stochastic rounding to one of the two bf16
    neighbours (random bits added below bf16's 8-bit significand, then cut
    off: unbiased). The wire rounds the ranks' summands and their partial sums,
    each off by up to u of its own size, so an element whose summands nearly
    cancel moves by u of the summands, not of itself (the dither's u m); the
    rest is the rounding of the element itself (SR, under one bf16 ulp).
    `cancel` > 0: instead of the dither, every element below cancel u m reads
    as zero, as a bf16 sum of W summands that cancel below their resolution
    does (AdamW then takes no step there instead of a whole one: the draw
    that bounds it). Independent from draw to draw; no run splits the batch."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            x = t.detach().float()
            xi = torch.rand(t.shape, generator=gen).to(t.device) * 2 - 1
            m = BF16_UNIT_ROUNDOFF * x.abs().mean()
            x = (torch.where(x.abs() < cancel * m, torch.zeros_like(x), x) if cancel else x + xi * m).contiguous()
            noise = torch.randint(0, 1 << 16, t.shape, generator=gen, dtype=torch.int32).to(t.device)
            t.copy_(((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(t.dtype))


def measure_floor(m: Mode, reference: Trace, start: int = 0) -> dict:
    """The reference's round-off floor: ULP_RUNS runs of the SAME mathematics,
    each compared step by step with the reference. ulp0 starts from parameters
    nudged by one ulp; ulp1 nudges every step's gradient by one ulp of each
    element, ulp2 by one ulp of its tensor's mean magnitude (the round-off a
    reduce's summation order adds is an ulp of the summands), before the
    optimizer, in random directions. None splits the batch: a floor
    from a split run would share the bugs of a split. Per run: per-step
    relative loss difference and, per tensor, per-step relative differences
    of parameters and gradients. A run resumed at step `start` nudges the
    parameters it loaded, before its first update.

    Under reduce="bf16" the fleet's every reduced gradient is rounded to
    bfloat16 on the wire: ulp0, then WIRE_RUNS runs wire0.. whose every
    gradient is rounded as the wire rounds (`round_like_wire`, an
    independent draw each; the last reads elements below the resolution of
    W summands as zero), replace the gradient nudges (2^16 times smaller
    than that rounding)."""
    s, run = m.s, m.run
    quiet = dataclasses.replace(run.train, ckpt_every=0, eval_every=0, log_every=max(1, run.train.steps))
    ref = reference.tensors()
    out = {}
    kinds = ["ulp0"] + ([f"wire{j}" for j in range(WIRE_RUNS)] if s.reduce == "bf16"
                        else [f"ulp{j}" for j in range(1, ULP_RUNS)])
    for i, kind in enumerate(kinds):
        model = m.model().to(m.device)
        seed = s.seed * 1000 + i
        if kind.startswith("wire"):
            # the last draw: elements below the resolution of W summands read as zero
            cancel = float(max(x.world for x in s.legs())) if kind == f"wire{WIRE_RUNS - 1}" else 0.0

            def on_grads(step, net, seed=seed, cancel=cancel):
                round_like_wire([p.grad for p in net.parameters() if p.grad is not None], seed * 100_003 + step,
                                cancel=cancel)
        elif i == 0 and not start:
            nudge(list(model.parameters()), seed)
            on_grads = None
        elif i == 0:
            def on_grads(step, net, seed=seed, first=start + 1):
                if step == first:
                    nudge(list(net.parameters()), seed)
        elif i == 1:
            def on_grads(step, net, seed=seed):
                nudge([p.grad for p in net.parameters() if p.grad is not None], seed * 100_003 + step)
        else:
            def on_grads(step, net, seed=seed):
                nudge_absolute([p.grad for p in net.parameters() if p.grad is not None], seed * 100_003 + step)
        r = dataclasses.replace(run, train=dataclasses.replace(quiet, ckpt_name=f"floor_{kind}"))
        trace = Trace(snapshots=True)

        def both(step, net, trace=trace, on_grads=on_grads):
            if on_grads:
                on_grads(step, net)
            trace.record_grads(step, net)

        report = train(model, r, log=QUIET, on_step=trace, on_grads=both)
        t = trace.tensors()
        out[kind] = {
            "losses": report["losses"],
            "param_rel": {k[2:]: rel_per_step(t[k], ref[k]) for k in ref if k.startswith("p/")},
            "grad_rel": {k[2:]: rel_per_step(t[k], ref[k]) for k in ref if k.startswith("g/")},
        }
    return out


def run_exact(s: GateSettings, log=print) -> dict:
    """The exact reference: one process computing the fleet's own slices
    (micro_batch windows each, in global slice order) summed in the fixed
    order of reduce="exact": a fleet must equal it bitwise."""
    # micro_batch: the fleet's own slices (FleetPlan.exact_slice)
    m = mode(s, name="exact", dist=False, reduce="exact", micro_batch=s.plan.exact_slice(),
             resume_from=s.resume_path())
    model = m.model().to(m.device)
    init = fingerprint(m.start_state(model)[0])
    report, trace = _traced(m, model, log)
    trace.save(s.out_dir, "exact")
    return m.save("exact", named_state(model), report["losses"], init=init, mode="exact",
                  config=m.run.to_dict(), micro_batch=m.run.train.micro_batch, global_batch=m.run.train.batch)


# --------------------------------------------------------------------------- the fleet


def run_rank(s: GateSettings, log=print, leg: int = 0) -> dict:
    """One rank of the fleet (run it under torchrun); `leg` 1 or 2 when the
    settings stop and resume the fleet at another world size."""
    return run_rank_plan([s], log=log, leg=leg)[-1]


def run_rank_plan(plan: list[GateSettings], log=print, leg: int | list[int] = 0) -> list[dict]:
    """Several fleet runs in one process group, one after another (each into
    its own out dir): the same code path as one run per launch. `leg`: the
    leg of every run, or one per run (a plan file's, load_plan)."""
    legs = list(leg) if isinstance(leg, (list, tuple)) else [leg] * len(plan)
    if len(legs) != len(plan):
        raise DormouseError(f"a plan of {len(plan)} runs with {len(legs)} legs")
    metas = []
    try:
        for s, one in zip(plan, legs):
            with ExitStack() as scopes:  # each installed run scope, around this run alone
                for scope in list(_RUN_SCOPES):
                    scopes.enter_context(scope(s))
                metas.append(rank_run(s, log, one))
    except BaseException:
        close_fleet(wait=False)  # the peers may be in a step this rank never reaches (close_fleet)
        raise
    close_fleet()
    return metas


def rank_run(s: GateSettings, log=print, leg: int = 0) -> dict:
    """One fleet run of this rank in the process group it has joined (the
    unit of a plan); run_rank_plan calls it once per run and leaves the fleet
    at the end. The seam where a benchmark or a test's fault acts on one run
    of a plan (keyed by s.out_dir)."""
    legs = s.legs()
    if (len(legs) == 2) != (leg in (1, 2)):
        raise DormouseError(f"resume_world = {s.resume_world}: this fleet runs in {len(legs)} launch(es); "
                            + ("launch it with --leg 1, then --leg 2 at resume_world ranks (the gate's launcher "
                               "does both)" if len(legs) == 2 else "drop --leg"))
    me = legs[leg - 1] if leg else s  # this launch's world and profile
    rank = fleet_env()[0]
    k = s.stop_step()
    ckpt = str(s.out_dir / "ckpts" / ("fleet.dcp" if s.shard == "fsdp" else "fleet.pt"))
    if leg == 1:
        m = mode(me, name="fleet", dist=True)
        m.run.train.stop_at, m.run.train.ckpt_every = k, k
    elif leg == 2:
        m = mode(me, name="fleet", dist=True, resume_from=ckpt)
    else:
        m = mode(me, name="fleet", dist=True, resume_from=s.resume_path())
    m = dataclasses.replace(m, s=s)  # this launch's run; the artifacts record the whole run's settings
    run = m.run
    # Seeded BEFORE joining the fleet, so every rank builds the same model (and
    # the references build it too); train_dist checks it.
    model = m.model()
    start, start_step = m.start_state(model)  # a resumed fleet starts from the checkpoint's weights
    init = fingerprint(start)
    if rank == 0 and leg != 2:
        m.save(INIT, start, [], init=init, mode="init", start_step=start_step)
    gather = s.shard == "fsdp"  # FSDP2 shards: record the GATHERED tensors (a collective)
    # Ranks end bitwise equal (the verdict checks it), so rank 0's snapshots
    # stand for the fleet; every rank keeps its own tokens' routing (per leg:
    # the judge joins the legs' ranks step by step).
    trace = Trace(snapshots=rank == 0, gather=gather)
    earlier: list[float] = []
    earlier_evals: list = []
    if leg == 2:
        first = load_trace(s.out_dir, rank_name(0, first_leg=True))
        if rank == 0:
            trace.extend(first)
        leg1 = load_meta(s.out_dir, rank_name(rank if rank < s.world else 0, first_leg=True))
        earlier, earlier_evals = leg1["losses"], leg1.get("evals", [])
    hooks = None
    if s.recording:  # the same run through the Recorder (leg 2: a new segment after the checkpoint's step)
        from dormouse.gate.record.dormouse_loop import LoopRecorder

        hooks = LoopRecorder(fleet_recording_dir(s.out_dir)).hooks()
    report = train_dist(run, log=log, device_type=s.device, model=model, close=False, on_step=trace,
                        on_grads=trace.record_grads, hooks=hooks)
    state = named_state(report["model"], gather=gather)
    plan = me.plan
    name = rank_name(rank, first_leg=leg == 1)
    trace.save(s.out_dir, name)
    meta = m.save(name, state, earlier + report["losses"], init=init, mode="rank", rank=rank,
                  world_size=report["world_size"], shapes=plan.lines(),
                  rank_shapes=[[sh.batch, sh.seq_len] for sh in plan.shapes], config=run.to_dict(),
                  start_step=0 if leg == 2 else report["start_step"], wall_s=report["wall_s"],
                  resumed_at=k if leg == 2 else None, legs=[[x.world, x.profile] for x in legs],
                  evals=earlier_evals + report.get("evals", []))
    del report, model
    return meta


def load_plan(path: str, *, validated: bool = False) -> tuple[list[GateSettings], list[int]]:
    """The launcher's plan file: a JSON list of {"leg": N, "settings": {GateSettings
    fields}}, one fleet run each (`validated`: written from validated settings);
    returns the runs and each run's leg."""
    try:
        items = json.loads(Path(path).read_text())
        return ([from_dict(item["settings"], validated=validated) for item in items],
                [int(item["leg"]) for item in items])
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DormouseError(f"plan {path!r} is not a JSON list of legs and gate settings ({e})") from e


# --------------------------------------------------------------------------- gradref


def profile(text: str, world: int, batch: int, seq_len: int) -> list[tuple[int, int]]:
    """(windows, window length) per rank, read from the profile by gradref's
    own parsing (not the trainer's FleetPlan: gradref shares no code with it)."""
    if not text:
        return [(batch, seq_len)] * world
    out = []
    for entry in text.split(","):
        m = re.fullmatch(r"([0-9]+)(?:x([0-9]+))?", entry.strip())
        out.append((int(m.group(1)), int(m.group(2) or seq_len)))
    return out


def span_index(step: int, n: int, order: str, seed: int) -> int:
    """Which whole span step `step` (0-based) reads, from the documented rule:
    epoch = step // n, j = step % n; sequential: j; shuffle: perm[j] with
    perm = randperm(n) from a generator seeded with seed * 1_000_003 + epoch."""
    epoch, j = divmod(step, n)
    if order == "sequential":
        return j
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return int(torch.randperm(n, generator=g)[j])


def step_windows(corpus: bytes, train_bytes: int, prof: list[tuple[int, int]], step: int, order: str,
                 seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per rank, its windows (x, y) at `step`, each of T+1 consecutive bytes of
    the step's span; ranks' slices follow one another in rank order."""
    span = sum(b * (t + 1) for b, t in prof)
    n = train_bytes // span
    pos = span_index(step, n, order, seed) * span
    ranks = []
    for b, t in prof:
        wins = []
        for _ in range(b):
            w = torch.tensor(list(corpus[pos:pos + t + 1]), dtype=torch.int64)
            wins.append((w[:-1].unsqueeze(0), w[1:].unsqueeze(0)))  # (1, T) each
            pos += t + 1
        ranks.append(wins)
    return ranks


def _fleet_record(s: GateSettings) -> tuple[dict, dict, dict]:
    """What the references start from: the fleet's metadata, its initial
    tensors and rank 0's per-step trace."""
    trace = load_trace(s.out_dir, rank_name(0))
    if trace is None or not any(k.startswith("p/") for k in trace):
        raise DormouseError(f"no trace of rank0 in {str(s.out_dir)!r}: run the fleet (rank mode) first")
    return load_meta(s.out_dir, rank_name(0)), load_tensors(s.out_dir, INIT), trace


def _flat_grad(params) -> torch.Tensor:
    """Every parameter's gradient in float64, flattened and concatenated in
    order; a parameter without one (an expert no token chose) counts as zero."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params]).double()


def _unflat(flat: torch.Tensor, params) -> list[torch.Tensor]:
    """A flat vector cut back into tensors of the parameters' shapes."""
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in params]), params)]


def run_gradref(s: GateSettings, log=print) -> dict:
    """The hand-computed reference at every step of the fleet's run (needs
    init and rank0's trace in out).

    Each window's gradient is its own forward and backward over a (1, T)
    batch: batching the windows into one forward would assume the very
    independence (fact 1) that g/ against b/ checks. torch.func.vmap, which
    would keep each window alone, does not apply here (torch 2.13, CPU): the
    dropless MoE's dispatch (bincount, then a loop over its counts) fails under
    vmap ("Cannot access data pointer of Tensor that doesn't have storage"),
    and scaled_dot_product_attention has no CPU batching rule for its forward
    or backward (vmap falls back to a per-example loop)."""
    fleet, init, trace = _fleet_record(s)
    m = mode(s, name="gradref", dist=False)
    run, device = m.run, m.device
    steps = len(fleet["losses"])
    first = fleet.get("start_step", 0)  # a fleet resumed from resume_from: its steps are first + k
    model = m.model().to(device)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    n_flat = sum(p.numel() for p in params)
    t = run.train
    prof = profile(s.profile, s.world, s.batch, t.seq_len)
    corpus = Path(t.data).read_bytes()
    train_bytes = len(corpus) - int(len(corpus) * t.eval_frac)
    order = t.data_order
    slice_len = s.micro_batch  # the fleet's forward slices, for the loads it counts
    legs = s.legs()
    prof2 = profile(legs[-1].profile, legs[-1].world, s.batch, t.seq_len)  # the second leg's ranks
    ref, absref, batch_grad = {n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}
    tokens, loads, wl, bl = [], [], [], []
    for k in range(steps):
        state = init if k == 0 else {n: trace[f"p/{n}"][k - 1] for n in init}
        model.load_state_dict(state)
        windows = step_windows(corpus, train_bytes, prof, first + k, order, s.seed)
        flat = [w for r in windows for w in r]
        total = sum(int(y.numel()) for _, y in flat)  # tokens counted from the targets
        tokens.append(total)
        # Each window alone, weighted by its tokens, summed in float64 (every
        # parameter's gradient as one flat vector: the same sums, element by element).
        acc = torch.zeros(n_flat, dtype=torch.float64, device=device)
        absacc = torch.zeros_like(acc)  # sum_w t_w |g_w| / T: bf16 wire bound
        w_losses = []
        for x, y in flat:
            model.zero_grad(set_to_none=True)
            logits, loss, _ = model(x.to(device), y.to(device))
            loss.backward()
            w_losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(),
                                            reduction="none").detach().cpu())
            g = _flat_grad(params)
            acc += g * (y.numel() / total)
            absacc += g.abs() * (y.numel() / total)
        for n, a, b in zip(names, _unflat(acc, params), _unflat(absacc.float(), params)):
            ref[n].append(a.cpu())
            absref[n].append(b.cpu())
        wl.append(torch.cat(w_losses))
        # The batch's own gradient at the same parameters: the global batch as
        # one batch (equal window lengths), else each rank's batch weighted.
        groups = [flat] if len({tt for _, tt in prof}) == 1 else windows
        bacc = torch.zeros(n_flat, dtype=torch.float64, device=device)
        b_losses = []
        for g in groups:
            x = torch.cat([w[0] for w in g]).to(device)
            y = torch.cat([w[1] for w in g]).to(device)
            model.zero_grad(set_to_none=True)
            logits, loss, _ = model(x, y)
            loss.backward()
            b_losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
                            .detach().cpu())
            bacc += _flat_grad(params) * (y.numel() / total)
        for n, b in zip(names, _unflat(bacc, params)):
            batch_grad[n].append(b.cpu())
        bl.append(torch.cat(b_losses))
        # Expert loads as the fleet's slices see them (its routing is per
        # token; counting over its own slices keeps near-ties as the fleet
        # broke them), summed over ranks by hand.
        step_loads = None
        if len(legs) == 2 and k >= s.stop_step():
            flat_it = iter(flat)  # the same windows, cut into the second leg's ranks
            slices = [[next(flat_it) for _ in range(b)] for b, _ in prof2]
        else:
            slices = windows
        with torch.no_grad():
            for r in slices:
                size = slice_len or len(r)
                for i in range(0, len(r), size):
                    x = torch.cat([w[0] for w in r[i:i + size]]).to(device)
                    y = torch.cat([w[1] for w in r[i:i + size]]).to(device)
                    aux = model(x, y)[2]
                    step_loads = aux["loads"].float().cpu() if step_loads is None else step_loads + aux["loads"].float().cpu()
        if step_loads is not None:
            loads.append(step_loads)
    tensors = {f"g/{n}": torch.stack(v) for n, v in ref.items()}
    tensors.update({f"b/{n}": torch.stack(v) for n, v in batch_grad.items()})
    tensors.update({f"a/{n}": torch.stack(v) for n, v in absref.items()})
    tensors["window_losses"] = torch.stack(wl)
    tensors["batch_losses"] = torch.stack(bl)
    if loads:
        tensors["loads"] = torch.stack(loads)
    evals = []
    if t.eval_every:  # at the fleet's (global) steps the recipe evaluates, from its parameters after them
        for done in range(first + 1, first + steps + 1):
            if done % t.eval_every == 0:
                model.load_state_dict({n: trace[f"p/{n}"][done - first - 1] for n in init})
                evals.append([done, eval_loss(model, corpus, train_bytes, t.seq_len, device)])
    log(f"gradref: {steps} steps, {len(prof)} ranks, {tokens[0]} tokens per step")
    return m.save("gradref", tensors, [], init=fingerprint(init), mode="gradref", tokens=tokens,
                  profile=[list(p) for p in prof], steps=steps, config=run.to_dict(),
                  fleet=fleet["fingerprint"], evals=evals)


EVAL_WINDOWS = 64  # the documented eval rule reads at most this many held-out windows


@torch.no_grad()
def eval_loss(model, corpus: bytes, train_bytes: int, seq_len: int, device) -> float:
    """The eval loss by gradref's own arithmetic from the documented rule: the
    held-out tail is corpus[train_bytes:]; its first n = min(len // (T+1), 64)
    windows of T+1 consecutive bytes, each computed alone; the token mean of
    their per-token losses, sum_i l_i / (n T), summed in float64."""
    n = min((len(corpus) - train_bytes) // (seq_len + 1), EVAL_WINDOWS)
    total, count = 0.0, 0
    for i in range(n):
        w = torch.tensor(list(corpus[train_bytes + i * (seq_len + 1):train_bytes + (i + 1) * (seq_len + 1)]),
                         dtype=torch.int64)
        x, y = w[:-1].unsqueeze(0).to(device), w[1:].unsqueeze(0).to(device)
        logits = model(x, y)[0]
        total += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double().sum())
        count += y.numel()
    return total / count


# --------------------------------------------------------------------------- replay


def run_replay(s: GateSettings, log=print) -> dict:
    """The fleet's whole run replayed in one process from init (needs init,
    rank0's trace and gradref's loads)."""
    fleet, init, trace = _fleet_record(s)
    # The recipe the SETTINGS give (not the one the fleet recorded): a fleet
    # at another lr, schedule or clip must not be replayed at its own.
    m = mode(s, name="replay", dist=False)
    run, device = m.run, m.device
    gradref = load_tensors(s.out_dir, "gradref")
    model = m.model()
    model.load_state_dict(init)
    model.to(device)
    opt = make_optimizer(model, run)
    start = fleet.get("start_step", 0)
    if s.resume_from:  # the optimizer state the fleet resumed with (its weights are init)
        from dormouse.train.checkpoint import load_checkpoint
        from dormouse.train.loop import LocalSync

        load_checkpoint(Path(s.resume_path()), model=m.model().to(device), opt=opt, run=run, peers=LocalSync(run))
    steps = len(fleet["losses"])
    snaps: dict[str, list[torch.Tensor]] = {}
    own: list[float] = []
    opt_state = None
    for k in range(steps):
        if fleet.get("resumed_at") and k == fleet["resumed_at"]:
            opt_state = _compare_optimizer_state(m, opt, k)
        opt.set_lr(lr_at(start + k, run))
        for n, p in model.named_parameters():
            p.grad = trace[f"g/{n}"][k].to(device).clone()
        if run.train.grad_clip:
            # The replay's own norm is compared with the fleet's (round-off:
            # FSDP sums shard norms in another order); the scale applied is the
            # one clip_grad_norm_ computes from the fleet's norm, so the replay
            # checks the optimizer's map bitwise given that scale.
            grads = [p.grad for p in model.parameters()]
            own.append(float(torch.nn.utils.get_total_norm(grads)))  # clip_grad_norm_'s own norm
            # (a fleet that did not clip recorded no norm: the replay's own, and the steps part)
            fleet_norm = float(trace["grad_norm"][k]) if "grad_norm" in trace else own[-1]
            # The scale as clip_grad_norm_ computes it, in the gradients' dtype (a
            # bfloat16 model's norm is a bfloat16 number, recorded exactly).
            torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), run.train.grad_clip,
                                                 torch.tensor(fleet_norm, dtype=grads[0].dtype, device=device))
        opt.step()
        if "loads" in gradref:
            model.balance_experts(gradref["loads"][k].to(device))
        for n, t in named_state(model).items():
            snaps.setdefault(n, []).append(t.clone())
    tensors = {f"p/{n}": torch.stack(v) for n, v in snaps.items()}
    if own:
        tensors["grad_norm"] = torch.tensor(own, dtype=torch.float32)
    log(f"replay: {steps} steps of the fleet's recorded gradients")
    return m.save("replay", tensors, [], init=fingerprint(init), mode="replay", steps=steps,
                  fleet=fleet["fingerprint"], optimizer_state=opt_state)


def _compare_optimizer_state(m: Mode, opt, step: int) -> dict:
    """The replay's optimizer state after `step` steps against the one the
    fleet checkpointed there (its first leg; a .dcp of shards under FSDP,
    read whole): every moment and momentum buffer bitwise."""
    from dormouse.train.checkpoint import load_checkpoint
    from dormouse.train.loop import LocalSync

    s, run = m.s, m.run
    path = s.out_dir / "ckpts" / ("fleet.dcp" if s.shard == "fsdp" else "fleet.pt")
    model = m.model().to(m.device)
    theirs = make_optimizer(model, run)
    at = load_checkpoint(path, model=model, opt=theirs, run=run, peers=LocalSync(run))
    mine, other = opt.state_dict(), theirs.state_dict()
    unequal = [f"{n}.{k}" for n in mine for k, t in mine[n].items()
               if not torch.is_tensor(t) or not torch.equal(t.cpu(), other[n][k].cpu())]
    return {"step": step, "checkpoint_step": at, "tensors": sum(len(v) for v in mine.values()), "unequal": unequal}


MODES = {"single": run_single, "rank": run_rank, "gradref": run_gradref, "replay": run_replay,
         "exact": run_exact}
