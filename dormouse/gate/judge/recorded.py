"""The verdict on a recording: every fact's check over a recording and its
one-process reference, in the order the verdict prints them (the checks
themselves: judge/recording.py, finite.py, intact.py, layouts.py, probe.py)."""

from __future__ import annotations

from pathlib import Path

from dormouse.gate import artifacts as A
from dormouse.gate.judge.finite import check_finite, first_nonfinite, first_nonfinite_state
from dormouse.gate.judge.intact import check_intact
from dormouse.gate.judge.layouts import check_layout
from dormouse.gate.judge.probe import check_probe
from dormouse.gate.judge.recording import (_Ref, check_buffers, check_clip, check_data, check_grad_mask,
                                           check_gradient, check_independence, check_loss, check_ranks,
                                           check_replay, provenance)
from dormouse.gate.judge.verdict import Check, Verdict


def judge_recording(out) -> Verdict:
    """The verdict on a recording whose references are in <out>/reference/."""
    out = Path(out)
    rec = A.RecordingSet(out)
    rec.validate()
    if not A.reference_meta_path(out).exists():
        return Verdict(str(out), False, [Check("complete", False, "no one-process reference: run "
                                                                  "`dormouse gate check --out DIR`, which makes it")],
                       [], provenance(rec))
    ref = _Ref(out)
    if ref.meta.get("run") != rec.run or ref.meta.get("steps") != rec.steps:
        return Verdict(str(out), False, [Check("complete", False, "the reference was made from another recording:"
                                                                  " re-run `dormouse gate check`")],
                       [], provenance(rec))
    checks = [Check("complete", True, f"recording of {len(rec.steps)} steps, {rec.world_at(rec.steps[-1])} ranks, "
                                      f"{len(rec.meta['segments'])} segment(s); the one-process reference made "
                                      f"from it ({ref.meta.get('mode')})")]
    checks.append(check_intact(rec))
    found = first_nonfinite(rec) or ()
    finite = check_finite(rec, found)
    checks.append(finite)
    checks.append(check_independence(rec, ref))
    grad = check_gradient(rec, ref)
    if grad.passed and found and found[2].startswith(("g/", "gs/")):  # a rank's copy the check does not compare
        grad.passed = False
        grad.reason = (f"rank {found[1]}'s gradient at step {found[0]} holds NaN or inf (see finite), which no bound "
                       f"allows; the copy compared: {grad.reason}")
    checks.append(grad)
    checks.append(check_grad_mask(rec, ref))
    replay = check_replay(rec, ref)
    checks.append(replay)
    buffers = check_buffers(rec, ref)
    checks.extend([buffers] if buffers is not None else [])
    checks.append(check_data(rec))
    checks.append(check_loss(rec, ref, grad.passed and replay.passed))
    ranks = check_ranks(rec)
    if ranks.passed and not finite.passed and (where := first_nonfinite_state(rec)):
        ranks = Check("ranks", False, f"the ranks' parameters agree by hash, but {where} they hold NaN or inf: "
                                      "not an agreement to pass (see finite)")
    checks.append(ranks)
    checks.append(check_clip(rec, ref))
    layout = check_layout(rec, ref)  # a tensor-parallel / 2-D recording's own check (judge/layouts.py)
    checks.extend([layout] if layout is not None else [])
    probed = check_probe(rec, ref)  # where the run parts from one process, module by module (judge/probe.py)
    checks.extend([probed] if probed is not None else [])
    return Verdict(str(out), all(c.passed for c in checks), checks, ["one-process reference"], provenance(rec))
