"""The one-process references of the gate, each recorded into the fleet's
reference folder: the single process at the global batch and its round-off
floor (runs of the same mathematics nudged by one ulp, or rounded as the bf16
wire rounds; never a run that splits the batch), and under reduce="exact" the
exact reference (the fleet's own slices summed in the fixed order)."""

from __future__ import annotations

import dataclasses

import torch

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import (
    EXACT,
    FLOOR,
    SINGLE,
    RecordingSet,
    gate_reference_dir,
    gate_reference_path,
    write_gate_json,
)
from dormouse.gate.record.modes.base import QUIET, Mode, mode
from dormouse.gate.settings import GateSettings
from dormouse.numerics import BF16_UNIT_ROUNDOFF, rel_per_step
from dormouse.train.hooks import Clipped, Hooks
from dormouse.train.loop import train

ULP_RUNS = 3  # one-ulp nudges of the reference whose maximum is the floor
WIRE_RUNS = 3  # under reduce="bf16": floor runs whose gradients are rounded as the wire rounds (independent draws)


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
    ref_p = {n: torch.stack([single.state_after(k)[n] for k in single.steps]) for n in single.final(A.PARAM)}
    ref_g = [single.tensors_at(k, A.GRAD) for k in single.steps]
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
