"""A reviewer's attacks on the recording gate (issue 13): faults that
tests/gate/test_recorder.py does not plant, and clean loops at settings it
does not try, through tests/support/review_loop.py (a plain DDP loop, 2 gloo
ranks, real torchrun: ONE launch records every run). Attacks the gate catches
are plain tests; a false pass or a false alarm is an xfail(strict=True) that
documents the gap and turns red when it is fixed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dormouse.gate.judge.recording import judge_recording
from dormouse.gate.record.reference import make_reference

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ROOT = Path(__file__).resolve().parents[2]

# name -> review_loop.RUN settings
RUNS = {
    "clean_lowlr_noclip": {"seed": 12, "max_grad_norm": 0, "lr": 1e-3},
    "clean_sketch_every3": {"seed": 13, "sketch": 64, "every": 3, "lr": 3e-2, "steps": 7},
    "clean_drop_last": {"seed": 14, "n": 50, "steps": 10},
    "dup_data": {"fault": "dup_data"},
    "nograd_log": {"fault": "nograd_log"},
    "rank1_eps4": {"fault": "rank1_eps", "eps": 1e-4},
    "bias_x2": {"fault": "bias_x2"},
    "row_x2": {"fault": "row_x2"},
    "bias_eps_sketch": {"fault": "bias_eps", "eps": 1e-4, "sketch": 64},
    "no_shift": {"fault": "no_shift"},
    "double_shift": {"fault": "double_shift"},
    "sched_twice": {"fault": "sched_twice"},
    "wd_wrong": {"fault": "wd_wrong"},
    "fwd_no_bwd": {"fault": "fwd_no_bwd"},
    "late_x15_every3": {"fault": "late_x15", "every": 3},
}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("review")
    plan = [{**cfg, "out": str(root / name)} for name, cfg in RUNS.items()]
    (root / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(SUPPORT / "review_loop.py"), "--plan", str(root / "plan.json")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {name: root / name for name in RUNS}


_VERDICTS: dict = {}


def verdict(recordings, name):
    if name not in _VERDICTS:
        make_reference(recordings[name], log=lambda line: None)
        _VERDICTS[name] = judge_recording(recordings[name])
    return _VERDICTS[name]


def failing(v) -> str:
    return "\n".join(f"{c.name}: {c.reason}" for c in v.checks if not c.passed)


# --------------------------------------------------------------------------- caught (or clean and passing)


@pytest.mark.parametrize("name", ["clean_lowlr_noclip", "clean_sketch_every3"])
def test_clean_at_other_settings_passes(recordings, name):
    v = verdict(recordings, name)
    assert v.passed, failing(v)


# fault -> (the check that fails, words of its reason)
CAUGHT = {
    "rank1_eps4": ("gradient", "differs from one process's gradient"),  # 1+1e-4 on one rank: 7.5e-5 > 1e-5
    "bias_x2": ("gradient", "tensor ln1.bias"),
    "row_x2": ("gradient", "tensor tok.weight"),
    "no_shift": ("gradient", "not by a constant factor"),
    "double_shift": ("gradient", "not by a constant factor"),
    "sched_twice": ("replay", "the loop's lr at step 2 is 0.009 where its scheduler, replayed, gives 0.00633333"),
    "wd_wrong": ("replay", "parameters before step 2 differ"),
    "fwd_no_bwd": ("gradient", "differs from one process's gradient"),
    "late_x15_every3": ("replay", "the recorded parameters differ from one process trained"),
}


@pytest.mark.parametrize("fault", list(CAUGHT))
def test_attack_is_caught(recordings, fault):
    v = verdict(recordings, fault)
    name, words = CAUGHT[fault]
    c = v.check(name)
    assert not v.passed and not c.passed, c.reason
    assert words in c.reason, c.reason


# --------------------------------------------------------------------------- gaps


@pytest.mark.xfail(strict=True, reason="false alarm: check_data cuts the read sequence into windows of dataset_len, "
                   "but a DataLoader with drop_last=True (50 examples, 48 read per epoch) reads fewer per epoch, so "
                   "a window spans two epochs and a clean loop FAILS 'an example was read twice within epoch 0'")
def test_clean_loop_with_drop_last_passes(recordings):
    v = verdict(recordings, "clean_drop_last")
    assert v.passed, failing(v)


@pytest.mark.xfail(strict=True, reason="false alarm: without example ids the data check identifies examples by a "
                   "hash of their tokens, so a clean loop over a dataset holding duplicate rows FAILS 'every rank "
                   "read the same data (no DistributedSampler?)'")
def test_clean_loop_over_duplicate_rows_passes(recordings):
    v = verdict(recordings, "dup_data")
    assert v.passed, failing(v)


def test_clean_loop_with_a_no_grad_forward_passes(recordings):
    """A train-mode forward under torch.no_grad() (a probe loss for logging)
    is no micro-batch of the step: the hook skips forwards with gradients
    disabled, so the recording holds the loop's 3 micro-batches and passes."""
    v = verdict(recordings, "nograd_log")
    assert v.passed, failing(v)
    meta = json.loads((recordings["nograd_log"] / "rank0" / "step000001.json").read_text())
    assert meta["micro_batches"] == 3


def test_sketch_bound_holds_per_tensor(recordings):
    """ln1.bias's gradient off by 1e-4 (relative, in that tensor; ~3e-6 over
    all tensors together) under sketches k=64: each tensor's sketch is held to
    its own bound, so the stated per-tensor detection bound (~2.9e-5) holds and
    the fault is caught in that tensor. The clean sketch runs pass
    (test_clean_at_other_settings_passes, test_recorder's sketch runs)."""
    c = verdict(recordings, "bias_eps_sketch").check("gradient")
    assert "in any one tensor is detected" in c.reason and "each tensor's sketch against its own bound" in c.reason
    assert not c.passed and "in tensor ln1.bias" in c.reason, c.reason
    import re

    stated = float(re.search(r"a relative difference above (\S+) in any one tensor", c.reason).group(1))
    assert stated < 1e-4, c.reason


def test_gradient_reason_does_not_name_a_constant_one(recordings):
    """every=3, loss x1.5 at step 2 only: the constant fit sees step 1 alone,
    where the fleet is right (c = 1). A ratio within FACTOR_AWAY x bound of 1
    is no factor: the reason says the fault lies between the tensor steps."""
    c = verdict(recordings, "late_x15_every3").check("gradient")
    assert not c.passed
    assert "times a constant" not in c.reason and " = W" not in c.reason, c.reason
    assert "after the parameters parted" in c.reason, c.reason
