"""The one assertion of a catalogue row (catalogue.Case): the verdict on a recording is the row's,
every check it names fails (or passes) with the words it gives, no check outside those the row
allows fails; a row the reference must refuse is refused in one line with its words."""

from __future__ import annotations

from pathlib import Path

import pytest

import catalogue
import looprec
from catalogue import Case


def rows(*fleets: str):
    """The parametrisation of a test by the fleets' catalogue rows (`case`), each named by its run (and
    its fleet, when there are several: the test reads that fleet's fixture, named as the fleet)."""
    cases = [c for f in fleets for c in catalogue.of(f)]
    return pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in cases],
                                   ids=[f"{c.fleet}-{c.id}" if len(fleets) > 1 else c.id for c in cases])


def _reasons(v) -> str:
    return "\n".join(f"{'ok' if c.passed else 'FAIL'} {c.name}: {c.reason}" for c in v.checks)


def _says(c, words, case: Case) -> None:
    for w in words:
        assert w in c.reason, f"{case.id}: {c.name}'s reason lacks {w!r}: {c.reason}"


def gives(v, case: Case) -> None:
    """The verdict `v` is what the row `case` says it must be."""
    assert v.passed == (case.verdict == "PASS"), f"{case.id}: expected {case.verdict}\n{_reasons(v)}"
    for name, words in case.fails.items():
        c = v.check(name)
        assert c is not None and not c.passed, f"{case.id}: {name} should fail\n{_reasons(v)}"
        _says(c, words, case)
    for name, words in case.holds.items():
        c = v.check(name)
        assert c is not None and c.passed, f"{case.id}: {name} should pass\n{_reasons(v)}"
        _says(c, words, case)
    if case.may_fail is not None:
        allowed = set(case.fails) | set(case.may_fail)
        assert looprec.failed(v) <= allowed, f"{case.id}: only {sorted(allowed)} may fail\n{_reasons(v)}"
        for name, words in case.may_fail.items():
            c = v.check(name)
            if c is not None and not c.passed:
                _says(c, words, case)


def refused(out: Path, case: Case) -> None:
    """The reference refuses the recording in `out` in one line holding the row's words."""
    from dormouse.errors import DormouseError
    from dormouse.gate.record.reference import make_reference

    with pytest.raises(DormouseError) as e:
        make_reference(out, log=looprec.QUIET)
    said = str(e.value)
    assert "\n" not in said, said
    for w in case.fails.get("reference", ()):
        assert w in said, f"{case.id}: the refusal lacks {w!r}: {said}"


_JUDGED: dict = {}


def judged(out: Path, *, fleet: bool = False):
    """The verdict on the recording in `out` whose references are made already (cached): a Recorder's
    recording, or (fleet) a run of the gate's own fleet."""
    from dormouse.gate.judge.entry import judge, judge_recording

    if str(out) not in _JUDGED:
        _JUDGED[str(out)] = judge(out) if fleet else judge_recording(out)
    return _JUDGED[str(out)]


_GATED: dict = {}


def gated(s):
    """The verdict on the gate's own fleet already in s.out (gatekit.judged: its references made first), cached."""
    from gatekit import judged as judged_fleet

    if str(s.out_dir) not in _GATED:
        _GATED[str(s.out_dir)] = judged_fleet(s)
    return _GATED[str(s.out_dir)]


def holds(out: Path, case: Case, *, reference: bool = True) -> None:
    """The row's verdict on the recording in `out` (its reference made first, unless `reference` is
    False: its client made it already)."""
    if case.verdict == "refused":
        refused(out, case)
    else:
        gives(looprec.verdict(out) if reference else judged(out), case)
