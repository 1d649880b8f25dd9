"""The pytest gate: real torchrun fleets on CPU (gloo) against the single
process at the global batch and the hand-computed one-step reference.

To keep the gate fast, the world-2 fleet runs of cases 1-4 share ONE torchrun
launch (a plan: several runs one after another in the same process group, the
same code path as one run per launch); worlds 3 and 4, the two-agent launch,
the refusal and the killed rank each have a launch of their own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dormouse.config import ModelConfig
from dormouse.errors import FleetError
from dormouse.gate.artifacts import load_meta, load_tensors
from dormouse.gate.fixtures import make_run
from dormouse.gate.launcher import failure_summary, launch_fleet, launch_plan, torchrun_command
from dormouse.gate.modes import GateSettings, run_gradref, run_single
from dormouse.gate.verdict import LOSS_RTOL_BF16, compare
from dormouse.model import DormouseModel
from dormouse.train.distributed import parse_capacity, refuse_incompatible, train_dist

FAULTS = str(Path(__file__).with_name("fleet_faults.py"))
QUIET = lambda line: None  # noqa: E731

# (name, fleet settings beyond the defaults, reference): curve = 20 steps at
# batch 2 per rank against the single process at batch 4; step = one step of
# capacity "4,2" against gradref.
WORLD2 = {
    "curve": ({}, "single"),
    "step": ({"steps": 1, "capacity": "4,2"}, "gradref"),
    "curve_fsdp": ({"shard": "fsdp"}, "single"),
    "step_fsdp": ({"steps": 1, "capacity": "4,2", "shard": "fsdp"}, "gradref"),
    "curve_adamw": ({"opt": "adamw"}, "single"),
    "step_adamw": ({"steps": 1, "capacity": "4,2", "opt": "adamw"}, "gradref"),
    "curve_bf16": ({"reduce": "bf16"}, "single"),
    "step_bf16": ({"steps": 1, "capacity": "4,2", "reduce": "bf16"}, "gradref"),
    "curve_buckets": ({"bucket_mb": 0.05}, "single"),  # ~13 buckets instead of one
}


def references(s: GateSettings, kind: str) -> None:
    """The in-process reference for fleet settings `s`."""
    if kind == "single":
        run_single(GateSettings(out=s.out, steps=s.steps, batch=s.batch * s.world, opt=s.opt), log=QUIET)
    else:
        run_gradref(GateSettings(out=s.out, steps=1, batch=s.batch, capacity=s.capacity, opt=s.opt,
                                 world=s.world), log=QUIET)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("world2")
    plan, dirs = [], {}
    for name, (extra, kind) in WORLD2.items():
        s = GateSettings(out=str(base / name), **extra)
        references(s, kind)
        plan.append(s)
        dirs[name] = base / name
    launch_plan(plan, timeout_s=300, stream=QUIET)
    return dirs


def verdict_of(out: Path) -> dict:
    v = compare(out)
    assert v["pass"], "\n".join(v["reasons"])
    return v


# 1 --------------------------------------------------------------------------------------------

def test_fleet_of_two_matches_single_process_curve_and_ranks_are_bitwise_equal(world2):
    v = verdict_of(world2["curve"])
    curve = v["checks"]["curve"]
    assert v["checks"]["ranks"]["pass"] and v["checks"]["ranks"]["world"] == 2
    assert len(curve["fleet"]) == len(curve["single"]) == 20
    assert all(r <= t for r, t in zip(curve["per_step"], curve["tolerance"]))
    # The tolerance is derived from a measured floor, not a constant.
    assert curve["noise_floor"][-1] > 0 and max(curve["tolerance"]) < 1e-4
    # The fleet learned: its loss fell.
    assert curve["fleet"][-1] < curve["fleet"][0] - 0.5


# 2 --------------------------------------------------------------------------------------------

def test_fleet_step_under_uneven_capacity_equals_hand_computed_gradref(world2):
    v = verdict_of(world2["step"])
    g = v["checks"]["gradref"]
    assert load_meta(world2["step"], "rank0")["shapes"] == [
        "batch=4 seq_len=64 tokens=256", "batch=2 seq_len=64 tokens=128"]
    assert max(r.get("grad_rel", 0.0) for r in g["per_tensor"].values()) < 1e-5
    assert g["max_rel"] < 1e-4


# 3 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["fsdp", "adamw"])
def test_sharded_and_adamw_fleets_pass_both_comparisons(world2, variant):
    verdict_of(world2[f"curve_{variant}"])
    verdict_of(world2[f"step_{variant}"])


def test_fsdp_fleet_ends_bitwise_equal_to_replicated_fleet_at_two_ranks(world2):
    # Two-term sums are commutative, so reduce-scatter and all-reduce agree exactly.
    a, b = load_tensors(world2["curve"], "rank0"), load_tensors(world2["curve_fsdp"], "rank0")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_many_small_buckets_reduce_exactly_like_one_flat_bucket(world2):
    a, b = load_tensors(world2["curve"], "rank0"), load_tensors(world2["curve_buckets"], "rank0")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert load_meta(world2["curve_buckets"], "rank0")["config"]["train"]["dist_bucket_mb"] == 0.05


# 4 --------------------------------------------------------------------------------------------

def test_bf16_reduce_stays_within_its_rounding_bound_and_is_measurably_off_fp32(world2):
    step = verdict_of(world2["step_bf16"])["checks"]["gradref"]
    worst = max(r.get("grad_bound_ratio", 0.0) for r in step["per_tensor"].values())
    assert 0 < worst <= 1.0  # |g_bf16 - g| <= W u sum|t_r g_r| / T, elementwise
    assert max(r.get("grad_rel", 0.0) for r in step["per_tensor"].values()) > 1e-5  # bf16 really ran
    fp32 = load_meta(world2["curve"], "rank0")["losses"]
    bf16 = load_meta(world2["curve_bf16"], "rank0")["losses"]
    dev = max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16))
    assert 0 < dev <= LOSS_RTOL_BF16
    # Judged by the fp32 tolerance, the bf16 fleet fails: the two are distinguishable.
    assert not compare(world2["curve_bf16"], judge_reduce="fp32")["pass"]


# 5 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,capacity", [(3, "4,2,1"), (4, "2,1,3,2x32")])
def test_worlds_three_and_four_with_uneven_profiles_equal_gradref(tmp_path, world, capacity):
    s = GateSettings(out=str(tmp_path), steps=1, capacity=capacity, world=world)
    references(s, "gradref")
    metas = launch_fleet(s, timeout_s=300, stream=QUIET)
    assert len(metas) == world
    verdict_of(tmp_path)


# 6 --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_agents_with_c10d_rendezvous_form_one_fleet(tmp_path):
    s = GateSettings(out=str(tmp_path), steps=20, batch=2)
    references(s, "single")
    port = _free_port()
    args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=dormouse-gate-test", "--max-restarts=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(torchrun_command(s, torchrun_args=args), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    assert any("world_size=2" in o for o in outputs)
    verdict_of(tmp_path)


def test_fleetsync_overlaps_backward_and_a_missing_gradient_keeps_collectives_in_order(tmp_path):
    # Rank 0's backward completes every bucket, so all three reduces start
    # inside backward; rank 1 never gets b's gradient, so bucket [b] and the
    # one after it wait for reduce() and go out as zeros, in the same order.
    script = str(Path(__file__).with_name("fleetsync_rank.py"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, str(tmp_path)]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["launched_in_backward"] for r in ranks] == [3, 1]
    assert all(r["exact_sum"] for r in ranks)


# 7 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("capacity,problem", [
    ("4,x", "rank 1's entry 'x' is not a batch size"),
    ("4,2,1", "has 3 entries but the fleet has 2 ranks"),
    ("0,2", "rank 0's entry '0' must be positive"),
    ("-1,2", "rank 0's entry '-1' is not a batch size"),
    ("four,two", "rank 0's entry 'four' is not a batch size"),
    ("4x65,2", "exceeds the model's max_seq_len 64"),
])
def test_malformed_capacity_is_refused_with_a_message_naming_it(tmp_path, capacity, problem):
    cfg = make_run(tmp_path, steps=1, batch=2).train
    with pytest.raises(FleetError, match=problem.replace("(", r"\(")):
        parse_capacity(capacity, world_size=2, cfg=cfg, max_seq_len=64)


def _refusal(tmp_path, monkeypatch, *, capacity="", model_changes=None, prebuilt=False, dist_on=True):
    run = make_run(tmp_path, steps=5, batch=2, capacity=capacity, dist=dist_on)
    if model_changes:
        run.model = ModelConfig(**{**vars(run.model), **model_changes})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = DormouseModel(run.model) if prebuilt else None
    with pytest.raises(FleetError) as info:
        train_dist(run, log=QUIET, model=model)
    # Refused before any collective and before any training.
    assert not dist.is_initialized()
    assert not list((tmp_path / "ckpts").glob("*.pt"))
    return str(info.value)


def test_incompatible_configurations_are_refused_before_joining_the_fleet(tmp_path, monkeypatch):
    assert "capacity-dropping MoE" in _refusal(tmp_path, monkeypatch, model_changes={"moe_capacity": 1.0})
    assert "pre-built model" in _refusal(tmp_path, monkeypatch, model_changes={"bf16": True}, prebuilt=True)
    assert "has 3 entries" in _refusal(tmp_path, monkeypatch, capacity="4,2,1")
    assert "train.dist is False" in _refusal(tmp_path, monkeypatch, dist_on=False)
    run = make_run(tmp_path, steps=5, batch=2, dist=True)
    other = DormouseModel(ModelConfig(**{**vars(run.model), "rank": 4}))
    with pytest.raises(FleetError, match="another ModelConfig"):
        refuse_incompatible(run, world_size=2, model=other)


def test_a_refused_fleet_launch_fails_fast_and_trains_nothing(tmp_path):
    s = GateSettings(out=str(tmp_path), steps=5, capacity="4,x")
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(FleetError, match="rank 1's entry 'x' is not a batch size"):
        launch_fleet(s, timeout_s=120, stream=lines.append)
    assert time.monotonic() - t0 < 60
    assert not any("loss=" in line for line in lines)
    assert not list(tmp_path.glob("rank*"))


# 8 --------------------------------------------------------------------------------------------

def test_a_killed_rank_fails_the_fleet_fast_naming_it_and_leaves_no_torn_files(tmp_path):
    s = GateSettings(out=str(tmp_path), steps=20)
    t0 = time.monotonic()
    lines: list[str] = []
    with pytest.raises(FleetError) as info:
        launch_fleet(s, timeout_s=120, stream=lines.append, entry=[FAULTS],
                     env={"DORMOUSE_TEST_FAULT": "kill_rank1"})
    assert time.monotonic() - t0 < 60
    assert "rank 1 exited with -9" in str(info.value), failure_summary(lines)
    # No artifact at all (they are written only at the end), no temporary files.
    assert not list(tmp_path.glob("rank*"))
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    # The checkpoint is whole: the one from step 2 (rank 1 died after step 3,
    # so the fleet never finished writing step 4's, and atomically so).
    payload = torch.load(tmp_path / "ckpts" / "fleet.pt", weights_only=True)
    assert json.loads(payload["meta"])["step"] == 2
