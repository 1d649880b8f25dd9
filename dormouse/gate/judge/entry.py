"""The judge's entry: one call, `judge(out)`, for every recording: any loop's
(through the Recorder) and dormouse's own fleet's, which adds the references
only its own trainer has (gradref, the single process and its floor, the
exact reference: artifacts.references says which apply). Each fact's check,
in the order the verdict prints them.

The judge: pure functions from a run's artifacts to typed results. It trains
nothing (the references, the replay included, are artifacts the running side
produced) and writes nothing.

What a PASS claims: this fleet trains the network one process would train at
the global batch. The checks, each against a reference that shares as little
code as possible with the fleet.

What no reference can see: code shared by the fleet and every reference (the
optimizer's internals, the lr schedule, the data rule's own helpers are used
by the fleet, but gradref re-derives the bytes). Unit tests and bitwise parity
with torch's optimizers cover those.
"""

from __future__ import annotations

from pathlib import Path

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import EXACT, FLOOR, GRADREF, SINGLE, GateReferences, ReferenceSet
from dormouse.gate.judge.facts.bias import check_bias_recorded
from dormouse.gate.judge.facts.clip import check_clip
from dormouse.gate.judge.facts.curve import check_curve, first_failure
from dormouse.gate.judge.facts.data import check_data
from dormouse.gate.judge.facts import draws
from dormouse.gate.judge.facts.exact import check_exact
from dormouse.gate.judge.facts.finite import check_finite, first_nonfinite, first_nonfinite_state
from dormouse.gate.judge.facts.gradient import ONE_FORWARD_SHAPE, check_grad_mask, check_gradient
from dormouse.gate.judge.facts.gradref import check_gradref
from dormouse.gate.judge.facts.independence import check_independence
from dormouse.gate.judge.facts.intact import check_intact
from dormouse.gate.judge.facts.layouts import check_layout
from dormouse.gate.judge.facts.loss import check_loss
from dormouse.gate.judge.facts.probe import check_probe
from dormouse.gate.judge.facts.provenance import (
    check_complete,
    check_config,
    check_provenance,
    gate_settings,
    provenance,
)
from dormouse.gate.judge.facts.ranks import check_ranks
from dormouse.gate.judge.facts.reduction import check_reduction
from dormouse.gate.judge.facts.replay import check_buffers, check_replay
from dormouse.gate.judge.facts.tied import check_tied
from dormouse.gate.judge.verdict import Check, Verdict


def judge(out, settings=None) -> Verdict:
    """The verdict on the recording in `out` (recording.json): every fact
    every recording gets, then, for dormouse's own fleet (its recording keeps
    the gate's settings), those of the gate's references, judged against
    `settings` (the drivers pass the settings the run was asked for; None:
    those the fleet recorded)."""
    out = Path(out)
    if not A.recording_path(out).exists():
        return Verdict(str(out), False, [Check("complete", False, f"incomplete: no recording in {str(out)!r} "
                                               "(recording.json): run the fleet (02), or point at the directory "
                                               "a Recorder wrote")], [])
    v = judge_recording(out)
    rec = A.RecordingSet(out)
    want = gate_settings(rec, settings)
    if want is None:
        if settings is not None:
            raise DormouseError(f"{out} holds a recording of another loop than dormouse's gate fleet: its settings "
                                "are its own (recording.json), not a gate's")
        present = GateReferences(out).present
        if present:  # a gate's out dir whose recording lost its settings would be judged without its references
            first = Check("complete", False, f"the gate's references ({', '.join(present)}) are here but "
                          "recording.json keeps no gate settings: not judged as a plain loop without them (re-run "
                          "the fleet, or give the verdict the settings the run was made with)")
            return Verdict(v.out, False, [first] + v.checks[1:], v.references, v.provenance)
        return v
    complete, *checks = _gate_checks(rec, GateReferences(out), want, v.checks)
    first = v.checks[0]  # one "complete": the recording's, and the gate's references'
    both = Check("complete", first.passed and complete.passed,
                 complete.reason if first.passed and not complete.passed else
                 first.reason if not first.passed else f"{first.reason}; {complete.reason}")
    every = [both] + v.checks[1:] + checks
    return Verdict(v.out, all(c.passed for c in every), every, v.references + GateReferences(out).present,
                   v.provenance)


def _gate_checks(rec: A.RecordingSet, refs: GateReferences, settings: dict, before: list[Check]) -> list[Check]:
    """The facts of dormouse's own gate's references, in the order printed."""
    try:
        complete = check_complete(refs, settings)
    except DormouseError as e:
        return [Check("complete", False, f"cannot tell which references apply: {e}")]
    checks = [complete, check_provenance(rec, refs, settings)]
    if not checks[-1].passed:  # references of another run are not compared with this one
        return checks
    if refs.has(GRADREF):
        checks.append(check_config(rec, refs))
        checks.append(check_gradref(rec, refs.meta(GRADREF)))
    exact = check_exact(rec, refs.recording(EXACT)) if refs.has(EXACT) else None
    if refs.has(SINGLE) and refs.has(FLOOR):
        checks.append(check_curve(rec, refs.recording(SINGLE), refs.meta(FLOOR),
                                  failed=first_failure(before + checks + ([exact] if exact else []))))
    if exact:
        checks.append(exact)
    return checks


def judge_recording(out) -> Verdict:
    """The verdict on a recording whose references are in <out>/reference/."""
    out = Path(out)
    rec = A.RecordingSet(out)
    rec.validate()
    if not A.reference_meta_path(out).exists():
        return Verdict(str(out), False, [Check("complete", False, "no one-process reference: run "
                                                                  "`dormouse gate check --out DIR`, which makes it")],
                       [], provenance(rec))
    ref = ReferenceSet(out)
    if ref.meta.get("run") != rec.run or ref.meta.get("steps") != rec.steps:
        return Verdict(str(out), False, [Check("complete", False, "the reference was made from another recording:"
                                                                  " re-run `dormouse gate check`")],
                       [], provenance(rec))
    checks = [Check("complete", True, f"recording of {len(rec.steps)} steps, {rec.world_at(rec.steps[-1])} ranks, "
                                      f"{len(rec.recorded.segments)} segment(s); the one-process reference made "
                                      f"from it ({ref.meta.get('mode')})")]
    checks.append(check_intact(rec))
    found = first_nonfinite(rec) or ()
    finite = check_finite(rec, found)
    checks.append(finite)
    independence = check_independence(rec, ref)
    grad = check_gradient(rec, ref)
    # the fleet is one forward over the whole step (a synchronised BatchNorm, one micro-batch a rank): the
    # gradient line's declaration advice comes first, the rows' dependence it explains after it
    one_forward = not grad.passed and getattr(grad, "shape", None) == ONE_FORWARD_SHAPE
    checks.extend([] if one_forward else [independence])
    if grad.passed and found and found[2].startswith((A.GRAD, A.SKETCHED_GRAD)):  # a rank's copy the check does not compare
        grad.passed = False
        grad.reason = (f"rank {found[1]}'s gradient at step {found[0]} holds NaN or inf (see finite), which no bound "
                       f"allows; the copy compared: {grad.reason}")
    checks.extend([grad, independence] if one_forward else [grad])
    if rec.spec.wire == "bf16":  # the declared bf16 wire's rounding, unbiased (facts/bias.py)
        checks.append(check_bias_recorded(rec, ref))
    checks.append(check_grad_mask(rec, ref))
    replay = check_replay(rec, ref)
    checks.append(replay)
    buffers = check_buffers(rec, ref)
    checks.extend([buffers] if buffers is not None else [])
    checks.append(check_data(rec))
    loss = check_loss(rec, ref, grad.passed and replay.passed)
    checks.append(loss)
    ranks = check_ranks(rec, grad.passed and replay.passed and loss.passed)
    if ranks.passed and (rec.recorded.layout or {}).get("pipeline"):  # a tied parameter's copies on its stages
        ranks = check_tied(rec, ref) or ranks
    if ranks.passed and not finite.passed and (where := first_nonfinite_state(rec)):
        ranks = Check("ranks", False, f"the ranks' parameters agree by hash, but {where} they hold NaN or inf: "
                                      "not an agreement to pass (see finite)")
    checks.append(ranks)
    checks.append(check_clip(rec, ref))
    reduction = check_reduction(rec)  # the in-run checks' sketches, where the Recorder took them (selfcheck=k)
    checks.extend([reduction] if reduction is not None else [])
    layout = check_layout(rec, ref)  # a tensor-parallel / 2-D recording's own check (judge/facts/layouts.py)
    checks.extend([layout] if layout is not None else [])
    probed = check_probe(rec, ref)  # where the run parts from one process, module by module (judge/facts/probe.py)
    if probed is not None and not probed.passed and one_forward:  # a module over the step's rows parts by design
        probed = Check("probe", True, "not judged: the fleet's gradient is the step's rows in one forward (see "
                                      "gradient), so a module computing over every rank's rows (a synchronised "
                                      "BatchNorm) departs from one micro-batch's forward by design, not by a fault")
    checks.extend([probed] if probed is not None else [])
    checks = draws.unjudged_on_cuda(rec, ref, checks)  # dropout masks CUDA drew: one process cannot draw them
    return Verdict(str(out), all(c.passed for c in checks), checks, ["one-process reference"], provenance(rec))


def judge_references(out) -> Verdict:
    """The per-step references of dormouse's fleet alone (notebook 03): every
    fact of its recording against the one-process reference, and gradref."""
    v = judge_recording(out)
    refs = GateReferences(out)
    g = (check_gradref(A.RecordingSet(out), refs.meta(GRADREF)) if refs.has(GRADREF)
         else Check("gradref", False, "incomplete: no gradref (run 03)"))
    return Verdict(v.out, v.passed and g.passed, v.checks + [g], v.references + [GRADREF], v.provenance)
