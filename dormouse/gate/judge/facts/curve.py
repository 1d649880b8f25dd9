"""Fact 2 at the global batch: the curve and every tensor against the reference's floor.

The gate's own fleet (trace format, judged by entry.judge until the fleet's recording replaces it):

curve      fact 2 at the global batch: per-step loss within a tolerance from
           the reference's floor runs, nudged by one ulp at the start or at
           every step's gradient (under the bf16 wire: every step's gradient
           rounded to bfloat16 as the wire rounds, independent draws) (10 x
           their running maximum, at least CURVE_MIN_RTOL; never from a run that
           splits the batch), the first step's gradients within GRAD_RTOL
           (both start from the same parameters), and every tensor within its
           own floor at every step (the routing bias excepted: discrete,
           judged by routing flips). A divergence is excused as round-off after
           a routing flip only before any per-step check failed; else the
           summary names the first failing check and step.
"""

from __future__ import annotations

import math

import torch

from dormouse.gate.artifacts import LEG1, ArtifactSet
from dormouse.gate.judge.bounds import (
    BF16_UNIT_ROUNDOFF,
    CURVE_MIN_RTOL,
    FLOOR_MULTIPLE,
    arithmetic_rtol,
    floor_bound,
)
from dormouse.gate.judge.facts.series import series_names, world_at
from dormouse.gate.judge.metrics import relative, running_max
from dormouse.gate.judge.verdict import Check, CurveCheck
from dormouse.numerics import rel_per_step

BIAS = "router_bias"  # tensors whose name ends so are discrete: judged by routing flips



def curve_tolerance(envelope: list[float], multiple: float = FLOOR_MULTIPLE) -> list[float]:
    return [floor_bound(e, CURVE_MIN_RTOL, multiple) for e in envelope]



def check_curve(a: ArtifactSet, *, multiple: float = FLOOR_MULTIPLE,
                failed: tuple[str, int] | None = None) -> CurveCheck:
    """The global-batch curve. `failed`: the first per-step check that failed
    (name, step), which no divergence at or after it may be excused by."""
    single, fleet = a.meta("single"), a.meta("rank0")
    ls, lf = single["losses"], fleet["losses"]
    if len(ls) != len(lf) or not lf or single.get("start_step", 0) != fleet.get("start_step", 0):
        return CurveCheck("curve", False, f"single and fleet are not comparable: single ran {len(ls)} steps from "
                          f"step {single.get('start_step', 0)}, the fleet {len(lf)} from {fleet.get('start_step', 0)}")
    wire = fleet["settings"].get("reduce", "fp32")
    runs = single.get("floor", {})
    if wire == "bf16" and not any(k.startswith("wire") for k in runs):
        return CurveCheck("curve", False, "the single process measured no bf16 wire floor (floor runs whose "
                          "gradients are rounded as the wire rounds): re-run single", wire=wire)
    rel = [abs(f - s) / abs(s) if s else abs(f - s) for s, f in zip(ls, lf)]
    floor = [0.0] * len(ls)
    floors: dict[str, list[float]] = {}
    for run in runs.values():
        for k, (x, y) in enumerate(zip(run["losses"], ls)):
            floor[k] = max(floor[k], abs(x - y) / abs(y) if y else abs(x - y))
        for name, series in run["param_rel"].items():
            floors[name] = [max(p, q) for p, q in zip(floors.get(name, [0.0] * len(series)), series)]
    envelope = running_max(floor)
    tolerance = curve_tolerance(envelope, multiple)
    if wire == "bf16":
        why = (f"{multiple:g} x the running maximum of {len(runs)} floor runs of the reference: its start nudged "
               f"by one ulp, and {sum(k.startswith('wire') for k in runs)} whose every gradient is rounded to "
               f"bfloat16 as the wire rounds (independent draws), at least {CURVE_MIN_RTOL:.0e}")
    else:
        why = (f"{multiple:g} x the running maximum of {len(runs)} one-ulp nudges of the "
               f"reference (its start; every step's gradient), at least {CURVE_MIN_RTOL:.0e}")
    c = CurveCheck("curve", True, "", wire=wire, single=ls, fleet=lf, per_step=rel, noise_floor=floor,
                   tolerance=tolerance, tolerance_why=why)
    bad = [k for k, (r, t) in enumerate(zip(rel, tolerance)) if not r <= t]
    # Gradients at the first step: both start from the same parameters.
    st, ft = a.trace("single"), a.trace("rank0")
    gnames = series_names(st, "g/")
    c.grad_step1 = max((relative(ft[f"g/{n}"][0], st[f"g/{n}"][0]) for n in gnames), default=0.0)
    grad_lim = arithmetic_rtol(single["config"]) if wire != "bf16" else max(
        2 * world_at(fleet, 0) * BF16_UNIT_ROUNDOFF, arithmetic_rtol(single["config"], 0.0))
    # Every tensor against its own floor (the routing bias through flips).
    first_param = None
    train, model = single["config"]["train"], single["config"]["model"]  # the settings', not the fleet's
    # Tensors are judged against their own floor where the optimizer's map is
    # float32: bfloat16 Newton-Schulz (or a bf16 model) rounds updates to 8
    # bits, so a few ulps of gradient round-off move a parameter by ~2^-8 of
    # its update; there gradref (every step's gradient) and the bitwise replay
    # (every step's update) carry the proof. The bf16 wire rounds gradients,
    # not the map: its floor runs round them the same way.
    judge_tensors = train.get("ns_dtype") != "bfloat16" and not model.get("bf16")
    for name in series_names(st, "p/"):
        series = rel_per_step(ft[f"p/{name}"], st[f"p/{name}"])
        c.param_divergence[name] = series
        if name.endswith(BIAS) or not judge_tensors:
            continue
        tol = curve_tolerance(running_max(floors.get(name, [0.0] * len(series))), multiple)
        for k, (v, t) in enumerate(zip(series, tol)):
            if not v <= t and (first_param is None or k + 1 < first_param[0]):
                first_param = (k + 1, name, v, t)
                break
    if first_param:
        c.first_divergent_param_step, c.first_divergent_param = first_param[0], first_param[1]
    try:
        flips = _flips(a, st)
        if flips is not None:
            c.routing_flips = flips.tolist()
            c.first_flip_step = next((k + 1 for k, n in enumerate(flips.sum(dim=1).tolist()) if n), None)
    except RuntimeError:  # ranks of different window lengths: not comparable token by token
        pass
    c.summary = _summary(c, bad, first_param, failed)
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
        reasons.append("tensors reported, not judged (8-bit rounding in the optimizer's map: gradref and the "
                       "replay prove each step)")
    if first_param:
        reasons.append(f"{first_param[1]} leaves its floor at step {first_param[0]} ({first_param[2]:.1e} > "
                       f"{first_param[3]:.1e})")
    c.passed = not bad and c.grad_step1 <= grad_lim and first_param is None and all(map(math.isfinite, lf))
    c.reason = "; ".join(reasons) + f"; {c.summary}"
    return c



def _flips(a: ArtifactSet, st: dict):
    """Routing flips per step and iteration, single vs the fleet's ranks
    joined in rank order (leg by leg for a fleet that stopped and resumed)."""
    legs = [LEG1, ""] if a.ranks(LEG1) else [""]
    parts, start = [], 0
    for prefix in legs:
        traces = [a.trace(n) for n in a.ranks(prefix)]
        if "topk" not in st or not traces or not all(t and "topk" in t for t in traces):
            return None
        fleet = torch.cat([t["topk"] for t in traces], dim=1)
        parts.append(routing_flips(st["topk"][start:start + len(fleet)], fleet))
        start += len(fleet)
    return torch.cat(parts) if start == len(st["topk"]) else None



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



STEPWISE = ("window", "gradref", "bias", "loss", "replay", "exact")  # checks a curve divergence may not be excused by


def routing_flips(single_topk: torch.Tensor, fleet_topk: torch.Tensor) -> torch.Tensor:
    """Tokens whose set of chosen experts differs, per step and iteration:
    (steps, max_iter). Both (steps, B, T, I, k); the fleet's ranks concatenated
    along B in rank order, which is the single process's window order."""
    a = single_topk.sort(dim=-1).values
    b = fleet_topk.sort(dim=-1).values
    differs = (a != b).any(dim=-1)  # (steps, B, T, I)
    return differs.sum(dim=(1, 2))
