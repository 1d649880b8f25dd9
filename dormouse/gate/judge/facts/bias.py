"""Fact 3 under the bf16 wire: round-off, not a systematic error.

The gate's own fleet (trace format, judged by entry.judge until the fleet's recording replaces it):

bias       bf16 wire only: the fleet's differences from gradref, scaled by their
           rounding bound, average to zero within BIAS_SIGMAS standard errors
           along an offset, a scale and a decay direction (round-to-nearest is
           unbiased; a systematic error far below the bound is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dormouse.gate.artifacts import ArtifactSet
from dormouse.gate.judge.bounds import BF16_UNIT_ROUNDOFF, BIAS_FLOOR, BIAS_SIGMAS
from dormouse.gate.judge.facts.series import series_names, world_at
from dormouse.gate.judge.verdict import Check
from dormouse.gate.layout import INIT, rank_name


@dataclass
class BiasCheck(Check):
    """The bf16 wire's rounding errors, scaled by their bound, along each
    direction a systematic error takes: S (in standard errors) per direction."""

    stats: dict[str, float] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)  # per direction: the mean scaled error (units of the bound)
    samples: int = 0
    smallest: float = 0.0  # the decay-like bias, in units of the bound, that would be caught



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
    directions = ("offset", "scale", "decay")
    num = dict.fromkeys(directions, 0.0)
    den = dict.fromkeys(directions, 0.0)
    count = 0
    for n in names:
        if f"a/{n}" not in g or f"g/{n}" not in fleet or f"p/{n}" not in fleet or n not in init:
            return BiasCheck("bias", False, f"the bias test lacks {n}'s series (fleet trace, gradref's |g| sums "
                             "or init): re-run the modes")
        ref = g[f"g/{n}"].double()
        steps = ref.shape[0]
        world = torch.tensor([float(world_at(meta, k)) for k in range(steps)], dtype=torch.float64)
        b = world.view(-1, *[1] * (ref.dim() - 1)) * BF16_UNIT_ROUNDOFF * g[f"a/{n}"].double()
        d = fleet[f"g/{n}"][:steps].double() - ref
        keep = b > 0
        z = torch.where(keep, d / torch.where(keep, b, torch.ones_like(b)), torch.zeros_like(b))
        before = torch.cat([init[n].unsqueeze(0), fleet[f"p/{n}"][:steps - 1]]).double()
        count += int(keep.sum())
        for name, sign in (("offset", torch.ones_like(z)), ("scale", torch.sign(ref)), ("decay", torch.sign(before))):
            per_element = (sign * z).sum(dim=0)
            num[name] += float(per_element.sum())
            den[name] += float((per_element ** 2).sum())
    stats = {k: num[k] / math.sqrt(den[k]) if den[k] > 0 else 0.0 for k in directions}
    means = {k: num[k] / count if count else 0.0 for k in directions}
    # the smallest bias caught along the decay direction (an extra weight decay: the review's attack)
    smallest = max(BIAS_SIGMAS * math.sqrt(den["decay"]) / count, BIAS_FLOOR["decay"]) if count else math.inf
    biased = [k for k in directions if not (abs(stats[k]) <= BIAS_SIGMAS or abs(means[k]) <= BIAS_FLOOR[k])]
    text = ", ".join(f"{k} {stats[k]:+.1f} ({means[k]:+.1e})" for k in directions)
    c = BiasCheck("bias", True, "", stats=stats, means=means, samples=count, smallest=smallest)
    if biased:
        k = max(biased, key=lambda d: abs(stats[d]))
        c.passed = False
        c.reason = (f"the fleet's reduced gradient is biased beyond the bf16 wire's rounding: its differences from "
                    f"gradref, scaled by their bound, do not average to zero ({k}: {stats[k]:+.1f} standard errors "
                    f"> {BIAS_SIGMAS:g}, mean {means[k]:+.1e} of the bound > {BIAS_FLOOR[k]:.0e}; over {count} "
                    f"element-steps, per direction S (mean): {text})")
    else:
        c.reason = (f"the bf16 wire's rounding errors, scaled by their bound, average to zero along every "
                    f"direction, S in standard errors (mean in units of the bound): {text}, over {count} "
                    f"element-steps; a decay-like bias of {smallest:.1e} x the bound would be caught")
    return c
