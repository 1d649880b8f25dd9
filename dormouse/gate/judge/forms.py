"""Which steps the judge needs the second one-process form of the gradient at.

The gradient check holds each float32 step to the NEARER of two one-process
forms (facts/gradient.py): "g", each micro-batch's loss sum differentiated,
summed, / N, and "gn", each micro-batch's loss sum / N x W differentiated,
summed, / W. gn costs the reference a second backward per micro-batch, and
a step whose fleet gradient is already within the step's bound of g passes
whichever is nearer: `dormouse gate check` (pipeline.check_recording) has
the reference make gn only where needs_normalised says so. The clip check
(its norm within the gradient's bound of g's wherever the gradient is) and
independence's float32 spread (taken from the steps that have both forms)
read gn where it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.bounds import grad_rtol
from dormouse.gate.judge.gradtools import fleet_grad


MARGIN = 0.5  # g within half the bound: no figure the judge sums otherwise than here moves a verdict


def needs_normalised(rec: A.RecordingSet, k: int, info: dict, g: Mapping[str, torch.Tensor]) -> bool:
    """Whether step k's reference needs gn: the fleet's gradient (unclipped)
    further from g (the reference's own, `g` formed tensor by tensor) than
    MARGIN x the step's float32 bound (bounds.grad_rtol of the reference's figures `info`).
    A sketched, every-k or bf16-wire recording always gets it (its checks read
    gn otherwise)."""
    if rec.sketch or rec.every != 1 or rec.spec.wire == "bf16":
        return True
    fleet = fleet_grad(rec, k)
    names = sorted(set(fleet) & set(g))
    num = den = 0.0
    for n in names:  # one tensor of g formed at a time
        b = g[n]
        num += float((fleet[n].double() - b).square().sum())
        den += float(b.square().sum())
    x = math.sqrt(num / den) if den > 0 else math.sqrt(num)
    return not names or not x <= MARGIN * grad_rtol(info)  # NaN: needed
