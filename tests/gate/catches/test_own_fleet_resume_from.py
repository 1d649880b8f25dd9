"""`--resume-from` in the gate: a fleet continued from a checkpoint is gated from that
checkpoint's weights and optimizer state, at the steps it resumes, in every reduce mode
(on main the resumed rank launch wrote no `init` and the gate stopped: "init missing")."""

from __future__ import annotations

import dataclasses

import pytest

from dormouse.gate.judge.entry import judge
from dormouse.gate.fixtures import build, make_run
from dormouse.train.loop import train
from dormouse.gate.settings import GateSettings, ParameterError
from gatekit import QUIET, fleets, references

CASES = {"fp32": dict(reduce="fp32"), "bf16": dict(reduce="bf16"),
         "exact": dict(reduce="exact", profile="3,3"), "fsdp": dict(reduce="fp32", shard="fsdp")}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per case: the settings' run in one process, stopped at step 2 of 4 with a checkpoint
    there (any topology resumes any checkpoint), then a gate that resumes from it at world 2
    and runs steps 3 and 4."""
    base = tmp_path_factory.mktemp("resume_from")
    second = {}
    for k, kw in CASES.items():
        s = GateSettings(out=str(base / k), steps=4, resume_world=0, **kw).validate()
        run = make_run(s, name="first", dist=False)
        run.train.stop_at, run.train.ckpt_every = 2, 2
        train(build(run), run, log=QUIET)
        ckpt = s.out_dir / "ckpts" / "first.pt"
        second[k] = dataclasses.replace(s, resume_from=str(ckpt)).validate()
    fleets(list(second.values()))
    for s in second.values():
        references(s)
    return second


# outside CI's time (`pytest -m slow`): the gate resumed from a checkpoint in each reduce mode; CI keeps
# gated fleets resumed from checkpoints of every kind (tests/train/test_resume_parity.py) and the CLI's (test_cli.py)
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_gate_resumed_from_a_checkpoint_passes_in_every_reduce_mode(resumed, case):
    s = resumed[case]
    v = judge(s.out_dir)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    from dormouse.gate.artifacts import RecordingSet

    rec = RecordingSet(s.out_dir)  # a recording of its own, from the checkpoint's step on
    assert rec.steps == [3, 4] and rec.meta["build_kwargs"]["start"] == 2
    assert rec.meta["build_kwargs"]["checkpoint"] == str(s.resume_path())  # rebuilt from the checkpoint
    assert "bitwise at all 2 steps" in v.check("replay").reason


def test_resume_from_with_a_stop_and_resume_is_refused_in_one_line(tmp_path):
    with pytest.raises(ParameterError, match="resume_world = 1 is not allowed: it starts from resume_from") as e:
        GateSettings(out=str(tmp_path), resume_from="ckpts/fleet.pt").validate()
    assert "\n" not in str(e.value)
