"""Fact 2 at the global batch: the curve and every tensor against the reference's floor.

curve      dormouse's own fleet against the single process at the global
           batch (reference/single/): per-step loss within a tolerance from the
           reference's floor runs (reference/floor.json), nudged by one ulp at
           the start or at every step's gradient (under the bf16 wire: every
           step's gradient rounded to bfloat16 as the wire rounds, independent
           draws) (10 x their running maximum, at least CURVE_MIN_RTOL; never
           from a run that splits the batch), the first step's gradients
           within the arithmetic's bound (both start from the same parameters),
           and every parameter within its own floor after every step. A
           divergence is excused as round-off after a routing flip (the
           recordings' x/topk) only before any per-step check failed; else the
           summary names the first failing check and step.
"""

from __future__ import annotations

import math

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.bounds import (
    BF16_UNIT_ROUNDOFF,
    CURVE_MIN_RTOL,
    FLOOR_MULTIPLE,
    arithmetic_rtol,
    floor_bound,
)
from dormouse.gate.judge.metrics import relative, running_max
from dormouse.gate.judge.verdict import Check, CurveCheck
from dormouse.numerics import rel_per_step


def curve_tolerance(envelope: list[float], multiple: float = FLOOR_MULTIPLE) -> list[float]:
    return [floor_bound(e, CURVE_MIN_RTOL, multiple) for e in envelope]


def run_config(rec: A.RecordingSet) -> dict:
    """The RunConfig (as a dict) a recording of dormouse's loop rebuilds its run from."""
    return rec.spec.build_kwargs.get("run") or {}


def _unclipped(rec: A.RecordingSet, k: int) -> dict[str, torch.Tensor]:
    """Step k's gradient before clipping: the applied one over its recorded coefficient."""
    coef = rec.step_meta(0, k).get("clip_coef") or 1.0
    return {n: g.double() / coef for n, g in rec.tensors_at(k, A.GRAD).items()}


def _after(rec: A.RecordingSet) -> dict[str, torch.Tensor]:
    """Every parameter after every step, stacked (steps, *shape)."""
    per = [rec.state_after(k) for k in rec.steps]
    return {n: torch.stack([p[n] for p in per]) for n in per[0]}


def check_curve(fleet: A.RecordingSet, single: A.RecordingSet, floor: dict, *, multiple: float = FLOOR_MULTIPLE,
                failed: tuple[str, int] | None = None) -> CurveCheck:
    """The global-batch curve. `failed`: the first per-step check that failed
    (name, step), which no divergence at or after it may be excused by."""
    ls, lf = single.losses(), fleet.losses()
    if single.steps != fleet.steps:
        return CurveCheck("curve", False, f"single and fleet are not comparable: single recorded steps "
                          f"{single.steps[:1]}..{single.steps[-1:]}, the fleet {fleet.steps[:1]}..{fleet.steps[-1:]}")
    wire = (fleet.extra.get("settings") or {}).get("reduce", "fp32")
    runs = floor.get("runs", {})
    if wire == "bf16" and not any(k.startswith("wire") for k in runs):
        return CurveCheck("curve", False, "the single process measured no bf16 wire floor (floor runs whose "
                          "gradients are rounded as the wire rounds): re-run single", wire=wire)
    rel = [abs(f - s) / abs(s) if s else abs(f - s) for s, f in zip(ls, lf)]
    noise, floors = _floor_runs(runs, ls)
    tolerance = curve_tolerance(running_max(noise), multiple)
    if wire == "bf16":
        why = (f"{multiple:g} x the running maximum of {len(runs)} floor runs of the reference: its start nudged "
               f"by one ulp, and {sum(k.startswith('wire') for k in runs)} whose every gradient is rounded to "
               f"bfloat16 as the wire rounds (independent draws), at least {CURVE_MIN_RTOL:.0e}")
    else:
        why = (f"{multiple:g} x the running maximum of {len(runs)} one-ulp nudges of the "
               f"reference (its start; every step's gradient), at least {CURVE_MIN_RTOL:.0e}")
    c = CurveCheck("curve", True, "", wire=wire, single=ls, fleet=lf, per_step=rel, noise_floor=noise,
                   tolerance=tolerance, tolerance_why=why)
    bad = [k for k, (r, t) in enumerate(zip(rel, tolerance)) if not r <= t]
    # Gradients at the first step: both start from the same parameters.
    first = fleet.steps[0]
    sg, fg = _unclipped(single, first), _unclipped(fleet, first)
    c.grad_step1 = max((relative(fg[n], sg[n]) for n in sg if n in fg), default=0.0)
    config = run_config(single)  # the settings' recipe, not the fleet's
    grad_lim = arithmetic_rtol(config) if wire != "bf16" else max(
        2 * fleet.world_at(first) * BF16_UNIT_ROUNDOFF, arithmetic_rtol(config, 0.0))
    # Every parameter against its own floor. Judged where the optimizer's map is
    # float32: bfloat16 Newton-Schulz (or a bf16 model) rounds updates to 8
    # bits, so a few ulps of gradient round-off move a parameter by ~2^-8 of
    # its update; there the recording's gradient (every step's) and bitwise
    # replay (every step's update) carry the proof. The bf16 wire rounds
    # gradients, not the map: its floor runs round them the same way.
    judge_tensors = config.get("train", {}).get("ns_dtype") != "bfloat16" and not config.get("model", {}).get("bf16")
    first_param = _first_param(c, fleet, single, floors, multiple, judge_tensors)
    if first_param:
        c.first_divergent_param_step, c.first_divergent_param = first_param[0], first_param[1]
    flips = _flips(fleet, single)
    if flips is not None:
        c.routing_flips = flips.tolist()
        c.first_flip_step = next((k + 1 for k, n in enumerate(flips.sum(dim=1).tolist()) if n), None)
    c.summary = _summary(c, bad, first_param, failed)
    reasons = _curve_reasons(c, rel, tolerance, bad, grad_lim, judge_tensors, first_param)
    c.passed = not bad and c.grad_step1 <= grad_lim and first_param is None and all(map(math.isfinite, lf))
    c.reason = "; ".join(reasons) + f"; {c.summary}"
    return c


def _floor_runs(runs: dict, ls: list[float]) -> tuple[list[float], dict[str, list[float]]]:
    """The floor runs' largest relative loss difference from the reference per step, and each
    parameter's largest relative divergence per step."""
    noise = [0.0] * len(ls)
    floors: dict[str, list[float]] = {}
    for run in runs.values():
        for k, (x, y) in enumerate(zip(run["losses"], ls)):
            noise[k] = max(noise[k], abs(x - y) / abs(y) if y else abs(x - y))
        for name, series in run["param_rel"].items():
            floors[name] = [max(p, q) for p, q in zip(floors.get(name, [0.0] * len(series)), series)]
    return noise, floors


def _first_param(c: CurveCheck, fleet: A.RecordingSet, single: A.RecordingSet, floors: dict, multiple: float,
                 judge_tensors: bool) -> tuple[int, str, float, float] | None:
    """Every parameter's divergence per step (into c.param_divergence) and, where tensors are judged, the
    first (step, name, divergence, tolerance) past its own floor's tolerance."""
    first_param = None
    sp, fp = _after(single), _after(fleet)
    for name in sorted(sp):
        series = rel_per_step(fp[name], sp[name])
        c.param_divergence[name] = series
        if not judge_tensors:
            continue
        tol = curve_tolerance(running_max(floors.get(name, [0.0] * len(series))), multiple)
        for k, (v, t) in enumerate(zip(series, tol)):
            if not v <= t and (first_param is None or k + 1 < first_param[0]):
                first_param = (k + 1, name, v, t)
                break
    return first_param


def _curve_reasons(c: CurveCheck, rel: list[float], tolerance: list[float], bad: list[int], grad_lim: float,
                   judge_tensors: bool, first_param) -> list[str]:
    """The curve's findings in words: the loss against its tolerance, the step-1 gradients, the tensors."""
    top = max(range(len(rel)), key=lambda k: rel[k])
    worst = max(range(len(rel)), key=lambda k: rel[k] / tolerance[k])
    reasons = [f"max per-step relative loss difference {rel[top]:.2e} (step {top + 1}: tolerance "
               f"{tolerance[top]:.1e})" + (f", nearest its tolerance at step {worst + 1} ({rel[worst]:.1e} of "
                                           f"{tolerance[worst]:.1e})" if worst != top else "")]
    if bad:
        reasons.append(f"the loss exceeds its tolerance first at step {bad[0] + 1}")
    if not c.grad_step1 <= grad_lim:
        reasons.append(f"step-1 gradients differ by {c.grad_step1:.2e} > {grad_lim:.0e} (same parameters, "
                       "same bytes: a scale, weighting or split bug)")
    else:
        reasons.append(f"step-1 gradients within {c.grad_step1:.1e}")
    if not judge_tensors:
        reasons.append("tensors reported, not judged (8-bit rounding in the optimizer's map: the recording's "
                       "gradient and replay prove each step)")
    if first_param:
        reasons.append(f"{first_param[1]} leaves its floor at step {first_param[0]} ({first_param[2]:.1e} > "
                       f"{first_param[3]:.1e})")
    return reasons


def _flips(fleet: A.RecordingSet, single: A.RecordingSet) -> torch.Tensor | None:
    """Routing flips per step and iteration, single vs the fleet's ranks
    joined in rank order (each step at its own world size); None without
    expert choices, or with ranks of different window lengths."""
    parts = []
    for k in fleet.steps:
        mine = single.step_extra(0, k, "topk")
        theirs = [fleet.step_extra(r, k, "topk") for r in range(fleet.world_at(k))]
        if mine is None or any(t is None for t in theirs) or len({t.shape[1:] for t in theirs + [mine]}) != 1 \
                or sum(len(t) for t in theirs) != len(mine):
            return None
        parts.append(routing_flips(mine[None], torch.cat(theirs)[None]))
    return torch.cat(parts) if parts else None


def _summary(c: CurveCheck, bad: list[int], first_param=None, failed: tuple[str, int] | None = None) -> str:
    """One sentence on where the fleet leaves its floor and why. A divergence
    is explained as round-off amplified by a routing flip only when a flip
    comes first AND no per-step check (window, gradref, loss, bias, replay,
    exact) failed at or before the step it leaves the floor: after a failing
    check the divergence is that fault's, and the summary names it."""
    above = bad[0] + 1 if bad else None
    left = min(x for x in (above, first_param[0] if first_param else None) if x is not None) \
        if (above or first_param) else None
    if left is None:
        return "the fleet stays within the measured floor at every step"
    what = "the loss leaves the floor" if left == above else f"{first_param[1]} leaves its floor"
    if failed is not None and failed[1] <= left:
        return (f"{what} at step {left}, at or after the first failing check: {failed[0]} at step {failed[1]} "
                "(the divergence is that fault's)")
    flips = c.routing_flips
    explained = c.first_flip_step is not None and (c.first_flip_step < left or (
        c.first_flip_step == left and flips and flips[left - 1][0] > 0))
    if explained:
        return (f"{what} at step {left}, after a routing flip (first at step "
                f"{c.first_flip_step}): round-off amplified by a discrete expert choice")
    return f"{what} at step {left} before any routing flip could explain it: suspect the fleet"



def first_failure(checks: list[Check]) -> tuple[str, int] | None:
    """The first per-step check that failed, as (name, step): the earliest
    step, a check without one counting from step 1 (it holds at no step)."""
    hits = [(getattr(c, "first_step", None) or 1, i, c.name) for i, c in enumerate(checks)
            if not c.passed and c.name in STEPWISE]
    if not hits:
        return None
    step, _, name = min(hits)
    return name, step



STEPWISE = ("independence", "gradient", "gradref", "bias", "buffers", "loss", "replay", "exact")  # checks a curve divergence may not be excused by


def routing_flips(single_topk: torch.Tensor, fleet_topk: torch.Tensor) -> torch.Tensor:
    """Tokens whose set of chosen experts differs, per step and iteration:
    (steps, max_iter). Both (steps, B, T, I, k); the fleet's ranks concatenated
    along B in rank order, which is the single process's window order."""
    a = single_topk.sort(dim=-1).values
    b = fleet_topk.sort(dim=-1).values
    differs = (a != b).any(dim=-1)  # (steps, B, T, I)
    return differs.sum(dim=(1, 2))
