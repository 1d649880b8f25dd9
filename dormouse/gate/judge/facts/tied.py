"""Tied parameters across a pipeline's stages: one parameter of the model (an input embedding tied to
the output projection) that the stages hold as copies, one each, kept equal only by the loop (the
gradient parts summed over the stages that hold a copy, the same step on each). The reference names
the ties it finds in the rebuilt model (its meta's "tied"); every copy is then compared with the
first, bitwise, before every step and after the last, gradients as well as parameters: a stage that
never receives another's part of the gradient parts from its twin, whatever the other checks (which
judge the first name) say. A weight the stages keep under ONE name (the embedding reused
as the output projection on the last stage) is the same tie: each holder's copy is compared with the
first holder's, rank by rank (the layout's stage_params say who holds it)."""

from __future__ import annotations

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.verdict import Check


def _apart(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """None when equal bitwise, else the relative difference (L2, float64)."""
    if a.shape == b.shape and torch.equal(a, b):
        return None
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-300))


def tied_groups(rec: A.RecordingSet, ref: ReferenceSet) -> list[list[str]]:
    """The reference's tie groups whose names the recording holds more than one of."""
    init = rec.init()
    return [[n for n in g if n in init] for g in ref.meta.get("tied") or [] if sum(n in init for n in g) > 1]


def shared_copies(layout: dict) -> dict[str, list[int]]:
    """{name: the ranks whose stages record it} for each parameter several stages record under one name (a
    tie kept as one name on each stage that uses it: an input embedding reused as the output projection)."""
    holders: dict[str, list[int]] = {}
    for r, names in enumerate(layout.get("stage_params") or []):
        for n in names:
            holders.setdefault(n, []).append(r)
    return {n: rs for n, rs in sorted(holders.items()) if len(rs) > 1}


def _shared_apart(rec: A.RecordingSet, shared: dict[str, list[int]]) -> Check | None:
    """Each copy of a parameter several stages record under one name, rank by rank against its first
    holder's, bitwise: parameters and gradients before and at every step, parameters after the last."""
    holders = sorted({r for rs in shared.values() for r in rs})
    for k in rec.steps:
        t = {r: rec.step_tensors(r, k) for r in holders}
        for prefix, what in ((A.PARAM, "parameters before"), (A.GRAD, "gradients at")):
            for n, (first, *others) in shared.items():
                for r in others:
                    a, b = t[r].get(prefix + n), t[first].get(prefix + n)
                    if (a is None) != (b is None):
                        return Check("ranks", False, f"{n}, recorded by the stages of ranks {first} and {r}, has "
                                                     f"{what} step {k} on one of them alone: every copy of a "
                                                     "parameter several stages hold must receive the same gradient")
                    if a is not None and (d := _apart(a, b)) is not None:
                        return Check("ranks", False, f"the copies of {n} on the stages of ranks {first} and {r} "
                                                     f"differ in their {what} step {k} by {d:.3g}: every copy must "
                                                     "receive the sum of every stage's gradient part (an all-reduce "
                                                     "over the stages that hold it), and take the same step")
    final = {r: A.read_tensors(A.final_tensors_path(rec.out, r), "final tensors")[0] for r in holders}
    for n, (first, *others) in shared.items():
        for r in others:
            a, b = final[r].get(A.PARAM + n), final[first].get(A.PARAM + n)
            if a is not None and b is not None and (d := _apart(a, b)) is not None:
                return Check("ranks", False, f"the copies of {n} on the stages of ranks {first} and {r} differ after "
                                             f"the last step by {d:.3g}: every copy must receive the sum of every "
                                             "stage's gradient part")
    return None


def check_tied(rec: A.RecordingSet, ref: ReferenceSet) -> Check | None:
    """None when the model ties no parameters the recording holds twice; else the copies compared."""
    groups = tied_groups(rec, ref)
    shared = shared_copies(rec.recorded.layout or {})
    if shared and (apart := _shared_apart(rec, shared)):
        return apart
    if not groups and not shared:
        return None
    for k in rec.steps:
        for prefix, what in ((A.PARAM, "parameters before"), (A.GRAD, "gradients at")):
            t = rec.tensors_at(k, prefix)
            for g in groups:
                first = g[0]
                for n in g[1:]:
                    if first in t and n in t and (d := _apart(t[n], t[first])) is not None:
                        return Check("ranks", False, f"the tied {first} and {n} (one parameter of the model, a copy "
                                                     f"on each stage that holds it) differ in their {what} step {k} "
                                                     f"by {d:.3g}: every copy must receive the sum of every stage's "
                                                     "gradient part (an all-reduce over the stages that hold it), "
                                                     "and take the same step")
    final = rec.final(A.PARAM)
    for g in groups:
        for n in g[1:]:
            if g[0] in final and n in final and (d := _apart(final[n], final[g[0]])) is not None:
                return Check("ranks", False, f"the tied {g[0]} and {n} differ after the last step by {d:.3g}: "
                                             "every copy must receive the sum of every stage's gradient part")
    ties = [" = ".join(g) for g in groups] + [f"{n} on the stages of ranks {', '.join(map(str, rs))}"
                                               for n, rs in shared.items()]
    return Check("ranks", True, f"pipeline: each rank holds its own stage's parameters (each exists once, but the "
                                f"tied {'; '.join(ties)}: their copies are equal bitwise, parameters and gradients, "
                                "at every step and after the last); merged by name, they are what the other checks "
                                "judge")
