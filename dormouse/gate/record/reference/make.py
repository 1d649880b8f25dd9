"""make_reference: <out>/reference/ for a recording, by replay (full tensors at every step: replay.py) or by
training the run itself in one process (sketches, or tensors every k-th step: run.py)."""

from __future__ import annotations

from pathlib import Path

from dormouse.gate import artifacts as A
from dormouse.gate.record.options import OBJECTIVES
from dormouse.gate.record.userfns import objective_fn
from dormouse.gate.record.reference.forward import set_modes
from dormouse.gate.record.reference.rebuild import check_provenance, rebuild
from dormouse.gate.record.reference.replay import make_replayed
from dormouse.gate.record.reference.run import make_run
from dormouse.gate.record.reference.staleness import is_current


def make_reference(out, *, log=print, force: bool = False, normalised=True) -> Path:
    """Write <out>/reference/ for the recording in `out` (skipped when current). normalised: whether each
    step gets "gn", or fn(rec, step, info, g) -> bool saying where (gradients.step_gradient_parts)."""
    rec = A.RecordingSet(out)
    rec.validate()
    if not force and is_current(out):
        return A.reference_meta_path(out)
    check_provenance(rec)
    user = objective_fn(rec.spec.objective, rec.spec.build_kwargs) if rec.spec.objective not in OBJECTIVES else None
    for stale in A.reference_dir(out).glob("*" + A.REPLAY_SUFFIX):  # another reference's replay: never read
        stale.unlink()
    model = rebuild(rec)
    set_modes(model, rec.eval_modules(rec.steps[0]) if rec.steps else [])
    if rec.sketch == 0 and rec.every == 1:  # full tensors at every step
        return make_replayed(out, rec, model, user, log, normalised=normalised)
    return make_run(out, rec, model, user, log, normalised=normalised)
