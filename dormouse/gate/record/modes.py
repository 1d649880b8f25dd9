"""The gate's modes: the running side. Each writes into the settings' out dir,
which is its fleet's recording (artifacts/layout.py), and judges nothing
(dormouse.gate.judge compares them).

rank    - one process per rank under torchrun: the fleet, recorded through the
          Recorder (record/dormouse_loop.py) into out: every step's micro-batches,
          parameters, applied gradients, buffers, loss and expert choices, with
          the gate's settings, provenance and evals in recording.json's extra.
single  - one process at the GLOBAL batch, recorded into reference/single/: the
          reference curve. Beside it, its round-off floor (reference/floor.json):
          the same run started from parameters nudged by one ulp, with ULP_RUNS
          different nudges (never a run that splits the batch: that would share
          the bugs of a split). Under reduce="exact" also the exact reference
          (reference/exact/): one process computing the fleet's own slices,
          summed in the fixed order.
gradref - from the fleet's recording, by its OWN arithmetic from the documented
          data rule: the bytes every step's windows must hold (each rank's slice
          in rank order), the tokens counted from the targets it built, and the
          held-out loss at the fleet's recorded parameters after each eval step
          (reference/gradref.json). The one-process gradient, the replay and
          the routing bias's update are the recording's own reference
          (record/reference.py), which every loop's recording gets.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    EXACT,
    FLOOR,
    GRADREF,
    SINGLE,
    RecordingSet,
    gate_reference_dir,
    gate_reference_path,
    write_gate_json,
)
from dormouse.gate.record.dormouse_loop import LoopRecorder
from dormouse.gate.record.fixtures import build, make_run
from dormouse.gate.record.provenance import gate_provenance
from dormouse.gate.settings import GateSettings, from_dict
from dormouse.numerics import BF16_UNIT_ROUNDOFF, rel_per_step
from dormouse.train.distributed import close_fleet, train_dist
from dormouse.train.hooks import Clipped, Hooks
from dormouse.train.loop import train
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

    def gate_extra(self, init: str, **more) -> dict:
        """What a recording of this mode keeps beside the run (recording.json's
        extra, GateReferences' JSON): the settings' record and the gate's
        provenance, the initial parameters' fingerprint `init` among it."""
        prov = gate_provenance(device=self.s.device, corpus=Path(self.run.train.data), init=init)
        return {"settings": self.s.record(), "provenance": prov, **more}

    def recorder(self, out: Path, built: torch.nn.Module) -> LoopRecorder:
        """A fresh recording of this mode's run into `out` (LoopRecorder), `built`
        its fresh model; a run from resume_from is rebuilt from that checkpoint."""
        return LoopRecorder(out, extra=self.gate_extra(fingerprint(self.start_state(built)[0])), fresh=True)


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


class Capture:
    """A floor run's series in memory, by the loop's hooks: each step's applied
    (clipped) gradient and the parameters after it. The floors compare it with
    the single process's recording step by step; nothing is written."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def hooks(self, on_grads=None) -> Hooks:
        def clipped(st: Clipped) -> None:
            self.grads.append({n: p.grad.detach().clone() for n, p in st.model.named_parameters()
                               if p.grad is not None})

        def stepped(step: int, model, info: dict) -> None:
            self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})

        return Hooks(on_clipped=[clipped], on_step=[stepped])


def record_one_process(m: Mode, name: str, log) -> tuple[dict, RecordingSet]:
    """Train mode `m` in this process, recorded into the reference folder's
    `name`; returns train()'s report and the recording."""
    model = m.model().to(m.device)
    out = gate_reference_dir(m.s.out_dir, name)
    report = train(model, m.run, log=log, hooks=m.recorder(out, model).hooks())
    return report, RecordingSet(out)


# --------------------------------------------------------------------------- single


def run_single(s: GateSettings, log=print) -> dict:
    """One process at the fleet's global batch (reference/single/), its ulp
    floor (reference/floor.json), and under reduce="exact" the exact reference."""
    if s.plan.global_batch is None:
        raise DormouseError(f"profile {s.profile!r} mixes window lengths: one process cannot hold that "
                            "global batch as one batch; gradref and the recording's reference are this fleet's")
    m = mode(s, name=SINGLE, dist=False, reduce="fp32", micro_batch=0, resume_from=s.resume_path())
    report, single = record_one_process(m, SINGLE, log)
    floor = measure_floor(m, single, start=report["start_step"])
    meta = m.gate_extra(single.extra["provenance"]["init"], run=single.run, runs=floor,
                        global_batch=m.run.train.batch, wall_s=report["wall_s"])
    write_gate_json(gate_reference_path(s.out_dir, FLOOR), meta)
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


def measure_floor(m: Mode, single: RecordingSet, start: int = 0) -> dict:
    """The reference's round-off floor: ULP_RUNS runs of the SAME mathematics,
    each compared step by step with the single process's recording. ulp0
    starts from parameters nudged by one ulp; ulp1 nudges every step's
    gradient by one ulp of each element, ulp2 by one ulp of its tensor's mean
    magnitude (the round-off a reduce's summation order adds is an ulp of the
    summands), before the optimizer, in random directions. None splits the
    batch: a floor from a split run would share the bugs of a split. Per run:
    per-step relative loss difference and, per tensor, per-step relative
    differences of parameters (after each step) and applied gradients. A run
    resumed at step `start` nudges the parameters it loaded, before its first
    update.

    Under reduce="bf16" the fleet's every reduced gradient is rounded to
    bfloat16 on the wire: ulp0, then WIRE_RUNS runs wire0.. whose every
    gradient is rounded as the wire rounds (`round_like_wire`, an
    independent draw each; the last reads elements below the resolution of
    W summands as zero), replace the gradient nudges (2^16 times smaller
    than that rounding)."""
    s, run = m.s, m.run
    quiet = dataclasses.replace(run.train, ckpt_every=0, eval_every=0, log_every=max(1, run.train.steps))
    ref_p = {n: torch.stack([single.state_after(k)[n] for k in single.steps]) for n in single.final("p/")}
    ref_g = [single.tensors_at(k, "g/") for k in single.steps]
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
        capture = Capture()
        report = train(model, r, log=QUIET, on_grads=on_grads, hooks=capture.hooks())
        p = {n: torch.stack([x[n] for x in capture.params]) for n in ref_p}
        grads = sorted({n for g in ref_g for n in g})
        out[kind] = {
            "losses": report["losses"],
            "param_rel": {n: rel_per_step(p[n], ref_p[n]) for n in ref_p},
            "grad_rel": {n: [float(rel_per_step(c[n][None], r_[n][None])[0]) if n in c and n in r_ else 0.0
                             for c, r_ in zip(capture.grads, ref_g)] for n in grads},
        }
    return out


def run_exact(s: GateSettings, log=print) -> dict:
    """The exact reference (reference/exact/): one process computing the
    fleet's own slices (micro_batch windows each, in global slice order)
    summed in the fixed order of reduce="exact": a fleet must equal it bitwise."""
    # micro_batch: the fleet's own slices (FleetPlan.exact_slice)
    m = mode(s, name=EXACT, dist=False, reduce="exact", micro_batch=s.plan.exact_slice(),
             resume_from=s.resume_path())
    report, _ = record_one_process(m, EXACT, log)
    return report


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
    unit of a plan), recorded into the settings' out dir; run_rank_plan calls
    it once per run and leaves the fleet at the end. The seam where a
    benchmark or a test's fault acts on one run of a plan (keyed by s.out_dir).
    Returns train()'s report (the trained model dropped)."""
    legs = s.legs()
    if (len(legs) == 2) != (leg in (1, 2)):
        raise DormouseError(f"resume_world = {s.resume_world}: this fleet runs in {len(legs)} launch(es); "
                            + ("launch it with --leg 1, then --leg 2 at resume_world ranks (the gate's launcher "
                               "does both)" if len(legs) == 2 else "drop --leg"))
    me = legs[leg - 1] if leg else s  # this launch's world and profile
    k = s.stop_step()
    ckpt = str(s.out_dir / "ckpts" / ("fleet.dcp" if s.shard == "fsdp" else "fleet.pt"))
    if leg == 1:
        m = mode(me, name="fleet", dist=True)
        m.run.train.stop_at, m.run.train.ckpt_every = k, k
    elif leg == 2:
        m = mode(me, name="fleet", dist=True, resume_from=ckpt)
    else:
        m = mode(me, name="fleet", dist=True, resume_from=s.resume_path())
    m = dataclasses.replace(m, s=s)  # this launch's run; the recording keeps the whole run's settings
    # Seeded BEFORE joining the fleet, so every rank builds the same model (and
    # the references build it too); train_dist checks it.
    model = m.model()
    # the second leg continues the first's recording: its settings and provenance (the run's init) stand
    rec = LoopRecorder(s.out_dir) if leg == 2 else m.recorder(s.out_dir, model)
    report = train_dist(m.run, log=log, device_type=s.device, model=model, close=False, hooks=rec.hooks())
    report.pop("model", None)
    del model
    return report


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


def window_digest(values: list[int]) -> str:
    """A window's identity in gradref.json: the sha256 of its T + 1 bytes."""
    return hashlib.sha256(bytes(values)).hexdigest()


def run_gradref(s: GateSettings, log=print) -> dict:
    """The data rule by gradref's own arithmetic, at every step of the fleet's
    recording (reference/gradref.json): the windows each step must hold
    (bytes read from the corpus by the documented rule, each rank's slice in
    rank order; each window's sha256, window_digest), which the judge holds
    every window the fleet's forwards saw to, the tokens counted from the
    targets it built, and under an eval recipe the held-out loss at the
    fleet's recorded parameters after each eval step."""
    fleet = RecordingSet(s.out_dir)
    fleet.validate()
    m = mode(s, name=GRADREF, dist=False)
    t = m.run.train
    prof = profile(s.profile, s.world, s.batch, t.seq_len)
    corpus = Path(t.data).read_bytes()
    train_bytes = len(corpus) - int(len(corpus) * t.eval_frac)
    rows = []
    for k in fleet.steps:
        windows = [torch.cat([x[0], y[0, -1:]]) for r in step_windows(corpus, train_bytes, prof, k - 1,
                                                                         t.data_order, s.seed) for x, y in r]
        rows.append({"step": k, "windows": [window_digest(w.tolist()) for w in windows],
                     "tokens": sum(len(w) - 1 for w in windows)})
    evals = []
    model = m.model().to(m.device)
    init = fingerprint(m.start_state(model)[0])  # the settings' own initial state, built here
    if t.eval_every:  # at the fleet's steps the recipe evaluates, from its recorded state after them
        for k in fleet.steps:
            if k % t.eval_every == 0:
                model.load_state_dict({**fleet.state_after(k, "p/"), **fleet.state_after(k, "b/")})
                evals.append([k, eval_loss(model, corpus, train_bytes, t.seq_len, m.device)])
    log(f"gradref: {len(rows)} steps, {len(prof)} ranks, {rows[0]['tokens'] if rows else 0} tokens per step")
    meta = m.gate_extra(init, run=fleet.run, steps=rows, evals=evals,
                        config=m.run.to_dict(),
                        profile=[list(p) for p in prof])
    write_gate_json(gate_reference_path(s.out_dir, GRADREF), meta)
    return meta


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


MODES = {SINGLE: run_single, "rank": run_rank, GRADREF: run_gradref, EXACT: run_exact}
