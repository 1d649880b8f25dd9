"""A bfloat16 model (model.bf16 = true) gated end to end: every mode builds and casts
its own model (on main `dormouse pipeline --config run.json` stopped with exit 3,
"model.bf16 is True but a pre-built model was passed"); under the exact reduce the
fleet is bitwise the exact reference; the recording's gradient check measures the bfloat16
arithmetic's floor (docs/gate.md), which still fails a fleet that
averages its ranks instead of weighting them by tokens."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

# outside CI's time (run them with `pytest -m slow`): the own trainer's bf16 model; reduced precision stays in CI (test_reduced_precision_loops.py, test_autocast_loops.py)
pytestmark = pytest.mark.slow
import torch

from dormouse.gate.fixtures import base_run
from dormouse.gate.settings import GateSettings
from dormouse.gate.judge.entry import judge
from gatekit import faulty_fleets, references


@pytest.fixture(scope="module")
def bf16_config(tmp_path_factory):
    """The gate fixture's network and recipe, trained in bfloat16, as a run.json."""
    path = tmp_path_factory.mktemp("bf16") / "run.json"
    run = base_run(GateSettings())
    path.write_text(dataclasses.replace(run, model=dataclasses.replace(run.model, bf16=True)).to_json())
    return path


def test_dormouse_pipeline_gates_the_bf16_config_a_training_run_wrote(tmp_path, capsys):
    """`dormouse train` writes run.json (a bf16 model, the block applied three
    times: not the gate fixture's network), then `dormouse pipeline --config`
    gates that network and recipe, to PASS."""
    from dormouse.__main__ import main
    from dormouse.gate.artifacts import RecordingSet

    assert main(["train", "--preset", "tiny", "--steps", "2", "--out", str(tmp_path / "run"),
                 "--set", "model.max_iter=3", "--set", "model.bf16=true"]) == 0, capsys.readouterr().err
    config = tmp_path / "run" / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "dormouse", "pipeline", "--config", str(config), "--steps", "2",
                           "--out", str(tmp_path / "gate"), "--resume-world", "0", "--only", "04", "--quiet"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "gate verdict" in done.stdout and ": PASS" in done.stdout
    verdict = json.loads((tmp_path / "gate" / "verdict.json").read_text())
    assert verdict["pass"] and verdict["settings"]["config"] == str(config)
    rec = RecordingSet(tmp_path / "gate")
    model = rec.meta["build_kwargs"]["run"]["model"]
    assert model["max_iter"] == 3 and model["bf16"] is True
    assert rec.init()["head.weight"].dtype == torch.bfloat16 and rec.final("p/")["head.weight"].dtype == torch.bfloat16


@pytest.fixture(scope="module")
def bf16_fleets(bf16_config, tmp_path_factory):
    """The exact gate of the bf16 model and a bf16 fleet that averages its ranks, in one torchrun launch."""
    base = tmp_path_factory.mktemp("bf16_fleets")
    exact = GateSettings(out=str(base / "exact"), config=str(bf16_config), reduce="exact", profile="3,3", steps=4,
                         resume_world=0).validate()
    mean = GateSettings(out=str(base / "mean"), config=str(bf16_config), steps=2, resume_world=0).validate()
    faulty_fleets([(exact, None), (mean, "plain_mean")])
    for s in (exact, mean):
        references(s)
    return exact, mean


def test_a_bf16_model_passes_the_exact_gate_bitwise(bf16_fleets):
    # (FSDP2 in bfloat16 passes too: docs/gate.md's sweep; its clipping norm, a bfloat16 number
    # summed from shard norms, is within BF16_MODEL_RTOL of the replay's own.)
    v = judge(bf16_fleets[0].out_dir)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    assert "bitwise at all 4 steps" in v.check("replay").reason
    assert "bitwise equal at all 4 steps" in v.check("exact").reason


def test_a_bf16_fleet_that_averages_its_ranks_fails_the_gradient(bf16_fleets):
    s = bf16_fleets[1]
    v = judge(s.out_dir, s)
    g = v.check("gradient")
    assert not v.passed and not g.passed and g.first_step == 1, g.reason
