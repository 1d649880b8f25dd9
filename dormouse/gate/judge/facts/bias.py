"""Fact 3 under the bf16 wire: round-off, not a systematic error.

The gate's own fleet (trace format, judged by entry.judge until the fleet's recording replaces it):

bias       bf16 wire only: the fleet's differences from gradref, scaled by their
           rounding bound, average to zero within BIAS_SIGMAS standard errors
           along an offset, a scale and a decay direction (round-to-nearest is
           unbiased; a systematic error far below the bound is not).

A recording that declares the bf16 wire (Recorder(wire="bf16")): the same
statistic on the fleet's gradient against one process's, the bound
W u sum_r |g_r| / T from the reference's sum over the ranks' contributions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ArtifactSet, ReferenceSet
from dormouse.gate.judge.bounds import BF16_UNIT_ROUNDOFF, BIAS_FLOOR, BIAS_SIGMAS, GRAD_RTOL
from dormouse.gate.judge.facts.gradient import fleet_grad
from dormouse.gate.judge.facts.series import series_names, world_at
from dormouse.gate.judge.verdict import Check
from dormouse.gate.artifacts.layout import INIT, rank_name


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


def check_bias(a: ArtifactSet) -> BiasCheck:
    """Under the bf16 wire, the rounding is unbiased. Per element e and step k,
    z = (g_fleet - g_ref) / b with b = W u sum_w t_w |g_w| / T (the rounding
    bound gradref's check uses; elements with b = 0 left out). Round-to-nearest
    errors average to zero, also when multiplied by a sign d that does not
    depend on them: for each direction d (1: an offset; sign(g_ref): a scale;
    sign(p) of the parameters before the step: a decay) the statistic

        S = sum_e c_e / sqrt(sum_e c_e^2),   c_e = sum_k d_ek z_ek,

    is a standard normal (errors summed per element first, so an element whose
    errors repeat from step to step counts once: a cluster-robust standard
    error). It fails when |S| > BIAS_SIGMAS and the mean sum_e c_e / N (N
    element-steps) exceeds the direction's BIAS_FLOOR (round-to-nearest's own
    pull towards zero on log-distributed magnitudes stays far below it). A
    bias of beta times the bound along d gives S ~ beta N / sqrt(sum c^2): the
    smallest caught is max(BIAS_SIGMAS sqrt(sum c^2) / N, BIAS_FLOOR[d]), far
    below the per-element bound."""
    fleet, g, meta, init = a.trace(rank_name(0)), a.tensors("gradref"), a.meta(rank_name(0)), a.tensors(INIT)
    names = series_names(g, "g/")
    series = []
    for n in names:
        if f"a/{n}" not in g or f"g/{n}" not in fleet or f"p/{n}" not in fleet or n not in init:
            return BiasCheck("bias", False, f"the bias test lacks {n}'s series (fleet trace, gradref's |g| sums "
                             "or init): re-run the modes")
        ref = g[f"g/{n}"].double()
        steps = ref.shape[0]
        world = torch.tensor([float(world_at(meta, k)) for k in range(steps)], dtype=torch.float64)
        b = world.view(-1, *[1] * (ref.dim() - 1)) * BF16_UNIT_ROUNDOFF * g[f"a/{n}"].double()
        before = torch.cat([init[n].unsqueeze(0), fleet[f"p/{n}"][:steps - 1]]).double()
        series.append((fleet[f"g/{n}"][:steps].double() - ref, b, ref, before))
    return bias_check(series, "gradref")


def check_bias_recorded(rec: A.RecordingSet, ref: ReferenceSet) -> BiasCheck:
    """check_bias on a recording that declares the bf16 wire: the fleet's
    gradient (divided by the clip coefficient) minus one process's, against
    the gradient check's element bound W u sum_r |g_r| / T + GRAD_RTOL max|g|
    (sum_r |g_r| the reference summed, "wa/"; the float32 term keeps elements
    whose ranks' contributions nearly vanish from weighing in by their
    float32 round-off alone), with the recorded parameters before each step;
    every recorded tensor step."""
    steps = rec.tensor_steps()
    per: dict[str, list] = {}
    for k in steps:
        g, g_ref, wa = fleet_grad(rec, k), ref.tensors(k, "g/"), ref.tensors(k, "wa/")
        before = rec.tensors_at(k, "p/")
        w = rec.world_at(k)
        for n in sorted(set(g) & set(g_ref) & set(wa) & set(before)):
            # the gradient check's bound (facts/gradient.py wire_ratio): the wire's rounding and the float32 term
            b = w * BF16_UNIT_ROUNDOFF * wa[n].double() + GRAD_RTOL * float(g_ref[n].double().abs().max())
            per.setdefault(n, []).append((g[n].double() - g_ref[n].double(), b, g_ref[n].double(),
                                          before[n].double()))
    series = [tuple(torch.stack([x[i] for x in items]) for i in range(4)) for items in per.values()]
    return bias_check(series, "one process's gradient")
