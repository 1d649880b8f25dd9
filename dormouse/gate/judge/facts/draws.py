"""A forward's random draws (torch's own dropout) as the reference put them back
(record/reference/rngstate.py; the reference's step JSON, "rng_states"): on the
CPU each micro-batch's forward restarts from the RNG state its rank's forward
started from, so the gradient, the loss and the clip are judged against the
masks the ranks drew; a row alone or the step's rows in one forward draw other
masks (their shape is another), so independence is not judged. A forward that
ran on CUDA drew its masks from CUDA's generator, which the CPU reference cannot
draw again: the checks that compare with one process's gradient say so, not
judged, instead of failing."""

from __future__ import annotations

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.gradtools import masks_replayed
from dormouse.gate.judge.verdict import Check

ON_CUDA = ("not judged: dropout masks drawn on cuda (the forward draws from the RNG state, and a forward on "
           "CUDA draws from CUDA's generator, which the reference on the CPU cannot draw again): record the "
           "loop on the CPU, or with the dropout off (p = 0 or the module in eval mode), to judge its gradient")
# the checks one process's gradient (or loss) at the ranks' masks decides
COMPARED = ("gradient", "loss", "clip", "independence")


def _states(rec: A.RecordingSet, ref: ReferenceSet) -> set:
    return {ref.info(k).get("rng_states") for k in rec.tensor_steps()}


def sensitive(rec: A.RecordingSet, ref: ReferenceSet) -> bool:
    """Whether one process's gradient changed with the RNG state at any recorded step (active dropout)."""
    return any(ref.info(k).get("rng_sensitive") for k in rec.tensor_steps())


def replayed(rec: A.RecordingSet, ref: ReferenceSet) -> bool:
    """gradtools.masks_replayed: every step's forwards drew again from their ranks' RNG states."""
    return masks_replayed(rec, ref)


def unrecorded(rec: A.RecordingSet, ref: ReferenceSet) -> bool:
    """A recording made before the Recorder kept the RNG states (the reference drew from one seed), where
    recording it again would have them replayed (no layout, the objective per micro-batch)."""
    return _states(rec, ref) == {None} and not rec.recorded.layout and rec.spec.objective_scope != "step"


def on_cuda(rec: A.RecordingSet, ref: ReferenceSet) -> bool:
    """Whether the gradient changes with the draws and the forwards drew them on CUDA."""
    return "cuda" in _states(rec, ref) and sensitive(rec, ref)


def unjudged_on_cuda(rec: A.RecordingSet, ref: ReferenceSet, checks: list[Check]) -> list[Check]:
    """The checks, those one process's gradient decides said not judged where the masks were drawn on CUDA
    (the gradient's line says why; the others point at it)."""
    if not on_cuda(rec, ref):
        return checks
    return [Check(c.name, True, ON_CUDA if c.name == "gradient" else "not judged: dropout masks drawn on cuda "
                  "(see gradient)") if c.name in COMPARED else c for c in checks]
