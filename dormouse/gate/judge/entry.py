"""The judge's entry: one call per run format, each listing every fact that applies in the
order the verdict prints them. `judge(out)` takes either a recording (any loop, and
dormouse's own fleet's recording) or the gate's traced artifacts.

The judge: pure functions from a gate run's artifacts to typed results. It
trains nothing (the references, the replay included, are artifacts the
running side produced) and writes nothing.

What a PASS claims: this fleet trains the network one process would train at
the global batch. The checks, each against a reference that shares as little
code as possible with the fleet:

What no reference can see: code shared by the fleet and every reference (the
optimizer's internals, the lr schedule, the data rule's own helpers are used
by the fleet, but gradref re-derives the bytes). Unit tests and bitwise parity
with torch's optimizers cover those.
"""

from __future__ import annotations

from pathlib import Path

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import LEG1, ArtifactSet, ReferenceSet, references
from dormouse.gate.judge.facts.bias import check_bias, check_bias_recorded
from dormouse.gate.judge.facts.clip import check_clip
from dormouse.gate.judge.facts.curve import check_curve, first_failure
from dormouse.gate.judge.facts.data import check_data
from dormouse.gate.judge.facts.exact import check_exact
from dormouse.gate.judge.facts.finite import (
    check_finite,
    check_finite_traced,
    first_nonfinite,
    first_nonfinite_state,
)
from dormouse.gate.judge.facts.gradient import check_grad_mask, check_gradient
from dormouse.gate.judge.facts.gradref import check_gradref
from dormouse.gate.judge.facts.independence import check_independence, check_window
from dormouse.gate.judge.facts.intact import check_intact
from dormouse.gate.judge.facts.layouts import check_layout
from dormouse.gate.judge.facts.loss import check_loss, check_loss_traced
from dormouse.gate.judge.facts.probe import check_probe
from dormouse.gate.judge.facts.provenance import (
    check_complete,
    check_config,
    check_provenance,
    provenance,
)
from dormouse.gate.judge.facts.ranks import check_ranks, check_ranks_traced
from dormouse.gate.judge.facts.replay import (
    check_buffers,
    check_replay,
    check_replay_traced,
)
from dormouse.gate.judge.facts.series import settings_of
from dormouse.gate.judge.verdict import Check, Verdict


def judge(out, settings=None) -> Verdict:
    """The verdict on `out`: a recording (recording.json: any loop's, through
    the Recorder) by judge_recording, else the gate's traced artifacts by
    judge_gate for `settings`."""
    if A.recording_path(out).exists():
        if settings is not None:
            raise DormouseError(f"{out} holds a recording: its settings are its own (recording.json), not a gate's")
        return judge_recording(out)
    return judge_gate(out, settings)


def judge_gate(out, settings=None) -> Verdict:
    """Every check that applies, over the gate's traced artifacts in `out`, for
    `settings` (the drivers pass the settings the run was asked for; None:
    those rank 0 was launched with). Which references apply comes from the
    settings (artifacts.references of their record). A missing fleet or
    reference fails; a PASS needs every check to pass."""
    a = ArtifactSet(Path(out))
    if not a.has("rank0"):
        c = Check("complete", False, f"incomplete: no fleet artifacts (rank0.json) in {str(out)!r}: run the rank mode")
        return Verdict(str(out), False, [c], [])
    try:
        s = settings_of(a, settings)
        need = references(s)
    except DormouseError as e:
        c = Check("complete", False, f"cannot tell which references apply: {e}")
        return Verdict(str(out), False, [c], [])
    checks = [check_complete(a, settings)]
    present = [n for n in need if a.has(n)]
    names = a.ranks(LEG1) + a.ranks() + present
    checks.append(check_provenance(a, names, settings))
    if checks[-1].passed and present and (a.has("gradref") or a.has("single")):
        checks.append(check_config(a, "gradref" if a.has("gradref") else "single"))
    if checks[1].passed:
        checks.append(check_finite_traced(a, names))
        checks.append(check_ranks_traced(a))
        if a.has("gradref"):
            checks.append(check_window(a))
            checks.append(check_gradref(a))
            if s["reduce"] == "bf16" and not a.meta("gradref").get("config", {}).get("model", {}).get("bf16"):
                checks.append(check_bias(a))  # (a bfloat16 model's own arithmetic is no wire rounding)
            checks.append(check_loss_traced(a))
        if a.has("replay"):
            checks.append(check_replay_traced(a))
        exact = check_exact(a) if a.has("exact") else None
        if a.has("single") and "single" in need:
            checks.append(check_curve(a, failed=first_failure(checks + ([exact] if exact else []))))
        if exact:
            checks.append(exact)
    ok = all(c.passed for c in checks)
    return Verdict(str(out), ok, checks, present, a.meta("rank0").get("provenance", {}))



def judge_references(out) -> Verdict:
    """The per-step references alone (03): window, gradref and replay."""
    a = ArtifactSet(Path(out))
    checks = [check_window(a), check_gradref(a), check_replay_traced(a)]
    return Verdict(str(out), all(c.passed for c in checks), checks, ["gradref", "replay"])


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
    if rec.meta.get("wire") == "bf16":  # the declared bf16 wire's rounding, unbiased (facts/bias.py)
        checks.append(check_bias_recorded(rec, ref))
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
    layout = check_layout(rec, ref)  # a tensor-parallel / 2-D recording's own check (judge/facts/layouts.py)
    checks.extend([layout] if layout is not None else [])
    probed = check_probe(rec, ref)  # where the run parts from one process, module by module (judge/facts/probe.py)
    checks.extend([probed] if probed is not None else [])
    return Verdict(str(out), all(c.passed for c in checks), checks, ["one-process reference"], provenance(rec))
