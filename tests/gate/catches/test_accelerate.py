"""The gate on a hand-written `accelerate` loop (tests/support/accelerate_loop.py):
`Accelerator(gradient_accumulation_steps=2, cpu=True)` under torchrun (2 gloo
ranks), `with accelerator.accumulate(model):`, `accelerator.clip_grad_norm_`,
recorded by the plain Recorder (three lines).

The fleet is the field sweep's own command on its accelerate slice
(`examples/field/sweep.py --only accelerate:...`: one launch, the gate's
reference and verdict per run, the sweep's independent confirmation, the
report), so CI runs that command too; the tests then judge the recordings
and confirm each verdict once more against a one-process gradient computed
by hand here (fieldkit.one_process_gradient), not the gate's reference."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# found, not imported: the fleet's ranks import it, this process need not (seconds of CI)
if importlib.util.find_spec("accelerate") is None:
    pytest.skip("needs accelerate (pip install 'dormouse[dev]')", allow_module_level=True)


import casecheck  # noqa: E402
import catalogue  # noqa: E402
import fieldkit  # noqa: E402
import loopmodel  # noqa: E402
import looprec  # noqa: E402

from dormouse.gate import artifacts as A  # noqa: E402

SWEEP = Path(__file__).resolve().parents[3] / "examples" / "field" / "sweep.py"
CONFIGS = catalogue.ids("accelerate")  # the sweep's accelerate configurations (K = 2)
W, K = 2, 2


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("field")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(SWEEP), "--out", str(out), "--report", str(out / "report.md"),
           "--only", ",".join(f"accelerate:{r}" for r in CONFIGS), "--launch", "client"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fleet(sweep):
    return sweep / "accelerate"


@casecheck.rows("accelerate")
def test_the_verdict_is_the_catalogues(fleet, case):
    """Each configuration's verdict (tests/support/catalogue.py, the "accelerate" rows): the sweep made
    the reference, the judge reads it."""
    casecheck.holds(fleet / case.id, case, reference=False)


def test_the_sweep_command_confirms_its_slice_and_writes_the_report(sweep):
    """The sweep's accelerate slice: every verdict confirmed by its independent
    check, and the report holds one row per configuration with its verdict."""
    rows = json.loads((sweep / "report.json").read_text())
    assert [r["spec"].split(":")[0] for r in rows] == CONFIGS and all(r["confirmed"] for r in rows)
    assert [r["gate"]["passed"] for r in rows] == [True, False, False]
    text = (sweep / "report.md").read_text()
    assert "3 configurations" in text and "3 of 3 verdicts confirmed" in text
    assert text.count("| accelerate |") == 3


checks = looprec.checks


def step1_batches(seed: int) -> list[dict]:
    return [b for r in range(W) for b in fieldkit.step_batches(seed=seed, world=W, rank=r, k=K, steps=4)[:K]]


def recorded_gradient(fleet, name) -> dict:
    """Rank 0's recorded gradient at step 1 over its clip coefficient (the loop clips before rec.step)."""
    rec = A.RecordingSet(fleet / name)
    c = rec.step_meta(0, 1)["clip_coef"]
    return {n: t.double() / c for n, t in rec.tensors_at(1, "g/").items()}


@pytest.mark.parametrize("name, seed", [("clean", 0)])
def test_accumulate_with_the_global_token_count_passes_and_equals_one_process(fleet, name, seed):
    """S_m / N_step * K * W under accumulate() (backward divides by K, DDP averages):
    every check passes, and the recorded gradient at step 1 is the hand-computed
    global token mean's over the step's 8 rows."""
    assert checks(casecheck.judged(fleet / name))["gradient"].worst <= 1e-5  # its row: PASS, the replay bitwise
    rec = A.RecordingSet(fleet / name)
    assert [rec.step_meta(0, k)["micro_batches"] for k in rec.steps] == [K] * 4
    g_ref = fieldkit.one_process_gradient(lambda: loopmodel.build_model(seed=seed), step1_batches(seed))
    assert fieldkit.relative(recorded_gradient(fleet, name), g_ref) < 1e-6


def test_accumulate_with_a_per_micro_batch_token_mean_fails_named(fleet):
    """Each micro-batch's own token mean under accumulate(): the gradient check
    names the mean of per-micro-batch means, which the hand-computed gradient
    with weights 1 / (W K n_m) reproduces."""
    # (its row: gradient and loss fail; the probe, where it fails too, names the loss: the ranks
    # backpropagate their losses at other scales)
    batches = step1_batches(0)
    weights = [1.0 / (W * K * fieldkit.targets(b)) for b in batches]
    g = recorded_gradient(fleet, "micro_mean")
    build = lambda: loopmodel.build_model(seed=0)  # noqa: E731
    assert fieldkit.relative(g, fieldkit.one_process_gradient(build, batches, weights=weights)) < 1e-6
    assert fieldkit.relative(g, fieldkit.one_process_gradient(build, batches)) > 1e-3


def test_a_prepared_scheduler_steps_world_times_per_step_and_fails_the_replay(fleet):
    """The lr scheduler through accelerator.prepare: accelerate's AcceleratedScheduler
    steps it num_processes times per optimizer step (by design: it assumes each
    process's batch is the one-process batch). The gradient is right, the lr
    is not the one-process schedule's at the same global batch: the replay
    check says so; by hand, the lr at step 2 is the schedule's at index W."""
    rec = A.RecordingSet(fleet / "sched_prepared")
    lr = [rec.step_meta(0, k)["lr"] for k in rec.steps]
    assert lr[1] == pytest.approx(1e-2 * loopmodel.lr_factor(W), rel=1e-12)
    assert lr[1] != pytest.approx(1e-2 * loopmodel.lr_factor(1), rel=1e-3)
