"""Fact 3 under the bf16 wire: round-off, not a systematic error.

bias       a recording that declares the bf16 wire (RecordingSpec(wire="bf16");
           dormouse's fleet under reduce="bf16"): the fleet's differences from
           one process's gradient, scaled by their rounding bound
           W u sum_r |g_r| / T (the reference's sum over the ranks'
           contributions), average to zero within BIAS_SIGMAS standard errors
           along an offset, a scale and a decay direction (round-to-nearest is
           unbiased; a systematic error far below the bound is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.bounds import BIAS_FLOOR, BIAS_SIGMAS
from dormouse.gate.judge.gradtools import fleet_grad, wire_element_bound
from dormouse.gate.judge.verdict import Check


@dataclass
class BiasCheck(Check):
    """The bf16 wire's rounding errors, scaled by their bound, along each
    direction a systematic error takes: S (in standard errors) per direction."""

    stats: dict[str, float] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)  # per direction: the mean scaled error (units of the bound)
    samples: int = 0
    smallest: float = 0.0  # the decay-like bias, in units of the bound, that would be caught



DIRECTIONS = ("offset", "scale", "decay")


def bias_check(series, what: str) -> BiasCheck:
    """The bias statistic over `series`: per tensor (d, b, ref, before), each
    stacked over steps: d the fleet's gradient minus the reference's, b its
    rounding bound (elements with b = 0 left out), ref the reference gradient,
    before the parameters before each step. Per element e and step k,
    z = d / b; for each direction s (1: an offset; sign(ref): a scale;
    sign(before): a decay) S = sum_e c_e / sqrt(sum_e c_e^2), c_e = sum_k s z
    (see check_bias). `what` names the reference in the verdict's words."""
    num = dict.fromkeys(DIRECTIONS, 0.0)
    den = dict.fromkeys(DIRECTIONS, 0.0)
    count = 0
    for d, b, ref, before in series:
        keep = b > 0
        z = torch.where(keep, d / torch.where(keep, b, torch.ones_like(b)), torch.zeros_like(b))
        count += int(keep.sum())
        for name, sign in (("offset", torch.ones_like(z)), ("scale", torch.sign(ref)), ("decay", torch.sign(before))):
            per_element = (sign * z).sum(dim=0)
            num[name] += float(per_element.sum())
            den[name] += float((per_element ** 2).sum())
    stats = {k: num[k] / math.sqrt(den[k]) if den[k] > 0 else 0.0 for k in DIRECTIONS}
    means = {k: num[k] / count if count else 0.0 for k in DIRECTIONS}
    # the smallest bias caught along the decay direction (an extra weight decay: the review's attack)
    smallest = max(BIAS_SIGMAS * math.sqrt(den["decay"]) / count, BIAS_FLOOR["decay"]) if count else math.inf
    biased = [k for k in DIRECTIONS if not (abs(stats[k]) <= BIAS_SIGMAS or abs(means[k]) <= BIAS_FLOOR[k])]
    text = ", ".join(f"{k} {stats[k]:+.1f} ({means[k]:+.1e})" for k in DIRECTIONS)
    c = BiasCheck("bias", True, "", stats=stats, means=means, samples=count, smallest=smallest)
    if biased:
        k = max(biased, key=lambda d: abs(stats[d]))
        c.passed = False
        c.reason = (f"the fleet's reduced gradient is biased beyond the bf16 wire's rounding: its differences from "
                    f"{what}, scaled by their bound, do not average to zero ({k}: {stats[k]:+.1f} standard errors "
                    f"> {BIAS_SIGMAS:g}, mean {means[k]:+.1e} of the bound > {BIAS_FLOOR[k]:.0e}; over {count} "
                    f"element-steps, per direction S (mean): {text})")
    else:
        c.reason = (f"the bf16 wire's rounding errors, scaled by their bound, average to zero along every "
                    f"direction, S in standard errors (mean in units of the bound): {text}, over {count} "
                    f"element-steps; a decay-like bias of {smallest:.1e} x the bound would be caught")
    return c


def check_bias_recorded(rec: A.RecordingSet, ref: ReferenceSet) -> BiasCheck:
    """check_bias on a recording that declares the bf16 wire: the fleet's
    gradient (divided by the clip coefficient) minus one process's, against
    the gradient check's element bound W u sum_r |g_r| / T + GRAD_RTOL max|g|
    (sum_r |g_r| the reference summed, A.WIRE_ABS; the float32 term keeps elements
    whose ranks' contributions nearly vanish from weighing in by their
    float32 round-off alone), with the recorded parameters before each step;
    every recorded tensor step."""
    steps = rec.tensor_steps()
    per: dict[str, list] = {}
    for k in steps:
        g, g_ref, wa = fleet_grad(rec, k), ref.tensors(k, A.GRAD), ref.tensors(k, A.WIRE_ABS)
        before = rec.tensors_at(k, A.PARAM)
        w = rec.world_at(k)
        for n in sorted(set(g) & set(g_ref) & set(wa) & set(before)):
            b = wire_element_bound(g_ref[n], wa[n], w)  # the gradient check's bound (gradtools.wire_ratio)
            per.setdefault(n, []).append((g[n].double() - g_ref[n].double(), b, g_ref[n].double(),
                                          before[n].double()))
    series = [tuple(torch.stack([x[i] for x in items]) for i in range(4)) for items in per.values()]
    return bias_check(series, "one process's gradient")
