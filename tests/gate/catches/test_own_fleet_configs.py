"""The gate on configurations other than the tiny fixture: a preset, a
RunConfig file written by hand (Engram off, the block applied three times),
the user's own corpus, and clean fixture runs over seeds 1-3 (no false alarm;
the wider sweeps of docs/gate.md and tests/gate/catches/test_own_fleet_once_false_passes_and_alarms.py's seeds
stand behind the suite's few). All in one torchrun launch, without the
stop-and-resume (tests/gate/catches/test_own_fleet_faults.py gates that)."""

from __future__ import annotations

import dataclasses

import casecheck
import catalogue
import pytest

# outside CI's time (run them with `pytest -m slow`): the own trainer's other configurations; its default one stays in CI (test_own_fleet_faults.py)
pytestmark = pytest.mark.slow
from gatekit import fleets, references

from dormouse.config import RunConfig, TrainConfig, preset
from dormouse.gate.artifacts import GRADREF, GateReferences, RecordingSet
from dormouse.gate.settings import GateSettings

FILES = ("config", "data")  # the settings whose row names a file the fixture writes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("configs")
    cfg = RunConfig(model=dataclasses.replace(preset("tiny"), engram_rows=0, engram_dim=0, max_iter=3),
                    train=TrainConfig(seq_len=32, lr=2e-3, grad_clip=1.0, warmup=2, schedule="cosine"))
    (base / "run.json").write_text(cfg.to_json())
    text = base / "text.txt"
    text.write_bytes(b"".join(p.read_bytes() for p in sorted((base.parents[2]).glob("*.txt")))
                     or bytes(range(256)) * 40)
    plan = {c.id: GateSettings(out=str(base / c.id), **{k: str(base / v) if k in FILES else v
                                                        for k, v in c.config.items()})
            for c in catalogue.of("configs")}  # the small preset's row: its size is the point
    plan = {k: dataclasses.replace(s, resume_world=0).validate() for k, s in plan.items()}
    fleets(list(plan.values()))
    for s in plan.values():
        references(s)
    return plan


def run_of(s) -> dict:
    """The RunConfig the fleet recorded (what its recording's reference rebuilds)."""
    return RecordingSet(s.out_dir).meta["build_kwargs"]["run"]


@casecheck.rows("configs")
def test_the_verdict_is_the_catalogues(runs, case):
    """Every configuration passes (tests/support/catalogue.py, the "configs" rows)."""
    casecheck.gives(casecheck.judged(runs[case.id].out_dir, fleet=True), case)


def test_the_small_preset_is_built_at_its_size(runs):
    assert run_of(runs["small"])["model"]["d_model"] == 256


def test_a_runconfig_file_with_engram_off_and_three_iterations_is_what_the_fleet_trained(runs):
    model = run_of(runs["file"])["model"]
    assert model["engram_rows"] == 0 and model["max_iter"] == 3
    assert GateReferences(runs["file"].out_dir).meta(GRADREF)["profile"] == [[3, 32], [1, 32]]  # the file's window


def test_the_users_corpus_is_read_in_place(runs):
    assert run_of(runs["data"])["train"]["data"] == runs["data"].data


# `dormouse pipeline --config` on the run.json a `dormouse train` wrote: tests/gate/catches/test_own_fleet_bf16_model.py
