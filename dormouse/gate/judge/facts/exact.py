"""Fact 2 exactly (reduce="exact").

exact      under reduce="exact" every step's parameters (before it), applied
           gradients, buffers and loss, and the parameters after the last
           step, bitwise equal to the exact reference's recording, else the
           first step, tensor and element, with the difference in ulps.
"""

from __future__ import annotations

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.metrics import first_difference, ulps
from dormouse.gate.judge.verdict import ExactCheck

SERIES = (A.PARAM, A.GRAD, A.BUFFER)  # a step's tensors compared bitwise


def _step_difference(fleet: A.RecordingSet, exact: A.RecordingSet, k: int):
    """(tensor, element, ulps) where step k first differs, None when bitwise equal."""
    pairs = []
    for prefix in SERIES:
        ours, theirs = fleet.tensors_at(k, prefix), exact.tensors_at(k, prefix)
        for n in sorted(set(ours) | set(theirs)):
            if n not in ours or n not in theirs:
                return prefix + n, 0, float("inf")
            pairs.append((prefix + n, ours[n], theirs[n]))
    d = first_difference(pairs)
    a, b = fleet.step_meta(0, k).get("loss"), exact.step_meta(0, k).get("loss")
    if d is None and a != b:
        d = ("loss", 0, ulps(torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64))
             if a is not None and b is not None else float("inf"))
    return d


def check_exact(fleet: A.RecordingSet, exact: A.RecordingSet) -> ExactCheck:
    what = "every step's parameters, gradients, buffers and loss against the exact reference"
    if exact.steps != fleet.steps:
        return ExactCheck("exact", False, f"the exact reference recorded steps {exact.steps[:1]}..{exact.steps[-1:]}, "
                          f"the fleet {fleet.steps[:1]}..{fleet.steps[-1:]}: re-run it with the fleet's settings",
                          first_step=1)
    equal, first = [], None
    for k in fleet.steps:
        d = _step_difference(fleet, exact, k)
        if d is None and k == fleet.steps[-1]:  # and after the last step
            d = first_difference([("final " + A.PARAM + n, t, exact.final(A.PARAM)[n]) for n, t in fleet.final(A.PARAM).items()])
        equal.append(d is None)
        if d is not None and first is None:
            first = (k, *d)
    if first:
        k, tensor, el, u = first
        return ExactCheck("exact", False, f"{what}: first differs at step {k}, {tensor} element {el} "
                          f"({u:.0f} ulps); {sum(equal)} of {len(equal)} steps bitwise equal", equal, k, tensor, el, u)
    return ExactCheck("exact", True, f"{what}: bitwise equal at all {len(equal)} steps", equal)
