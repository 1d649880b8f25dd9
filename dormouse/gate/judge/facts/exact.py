"""Fact 2 exactly (reduce="exact").

The gate's own fleet (trace format, judged by entry.judge until the fleet's recording replaces it):

exact      fact 2 exactly: under reduce="exact" every step's parameters,
           gradients and loss bitwise equal to the exact reference, else the
           first step, tensor and element, with the difference in ulps.
"""

from __future__ import annotations

from dormouse.gate.artifacts import ArtifactSet
from dormouse.gate.judge.facts.series import bitwise_steps
from dormouse.gate.judge.verdict import Check


def check_exact(a: ArtifactSet) -> Check:
    fleet, e = a.trace("rank0"), a.trace("exact")
    keys = sorted(k for k in e if k.startswith(("p/", "g/")))
    steps = min(len(e[keys[0]]), len(fleet[keys[0]]))
    c = bitwise_steps("exact", fleet, e, keys, steps,
                       "every step's parameters, gradients and loss against the exact reference",
                       losses=(a.meta("rank0")["losses"], a.meta("exact")["losses"]))
    if len(a.meta("rank0")["losses"]) != len(a.meta("exact")["losses"]):
        c.passed, c.reason = False, "the exact reference ran another number of steps than the fleet"
    return c
