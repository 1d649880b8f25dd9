"""The fleet on torch.distributed: real torchrun launches on CPU (gloo) — a
two-agent rendezvous, FleetSync's overlap, the refusals before any collective,
a refused and a killed fleet. The gate's verdicts are tests/gate/catches/test_own_fleet_*.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from dormouse.config import ModelConfig
from dormouse.gate.artifacts import RecordingSet
from dormouse.errors import PEER_LOST, DormouseError, FleetError
from dormouse.gate.fixtures import make_run
from dormouse.gate.record.launcher import failure_summary, launch_fleet, torchrun, torchrun_command
from dormouse.gate.settings import GateSettings
from dormouse.model import DormouseModel
from dormouse.train.distributed import parse_capacity, refuse_incompatible, train_dist
from dormouse.gate.judge.entry import judge
from gatekit import FAULTS, FORK_RANKS, QUIET, SUPPORT, references

# 6 --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_agents_with_c10d_rendezvous_form_one_fleet(tmp_path):
    s = GateSettings(out=str(tmp_path), steps=4, profile="", resume_world=0)  # one launch: two agents
    port = _free_port()
    args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=dormouse-gate-test", "--max-restarts=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(torchrun_command(s, torchrun_args=args, fork_ranks=FORK_RANKS), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    assert any("world_size=2" in o for o in outputs)
    references(s)
    v = judge(tmp_path)
    assert v.passed, v


def test_fleetsync_overlaps_backward_and_a_missing_gradient_keeps_collectives_in_order(tmp_path):
    # Rank 0's backward completes every bucket, so all three reduces start
    # inside backward; rank 1 never gets b's gradient, so bucket [b] and the
    # one after it wait for reduce() and go out as zeros, in the same order.
    script = str(SUPPORT / "fleetsync_rank.py")
    cmd = torchrun([script, str(tmp_path)], world=2)
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["launched_in_backward"] for r in ranks] == [3, 1]
    assert all(r["exact_sum"] for r in ranks)


# 7 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile,problem", [
    ("4,x", "rank 1's entry 'x' is not a batch size"),
    ("4,2,1", "has 3 entries but world = 2"),
    ("0,2", "rank 0's entry '0' must be positive"),
    ("-1,2", "rank 0's entry '-1' is not a batch size"),
    ("four,two", "rank 0's entry 'four' is not a batch size"),
    ("4x65,2", "exceeds the model's max_seq_len 64"),
    ("\u0664,2", "rank 0's entry '\u0664' is not a batch size"),  # an Arabic-Indic four is no ASCII digit
])
def test_malformed_profile_is_refused_with_a_message_naming_it(tmp_path, profile, problem):
    cfg = make_run(GateSettings(out=str(tmp_path), profile=""), name="t", dist=True).train
    with pytest.raises(FleetError, match=problem.replace("(", r"\(")):
        parse_capacity(profile, world_size=2, cfg=cfg, max_seq_len=64)


def _run(tmp_path, *, profile="", dist_on=True):
    s = GateSettings(out=str(tmp_path), steps=5, profile="")
    run = make_run(s, name="fleet", dist=dist_on)
    run.train.dist_profile = profile
    return run


def _refusal(tmp_path, monkeypatch, *, profile="", model_changes=None, prebuilt=False, dist_on=True):
    run = _run(tmp_path, profile=profile, dist_on=dist_on)
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
    assert "has 3 entries" in _refusal(tmp_path, monkeypatch, profile="4,2,1")
    assert "train.dist is False" in _refusal(tmp_path, monkeypatch, dist_on=False)
    run = _run(tmp_path)
    other = DormouseModel(ModelConfig(**{**vars(run.model), "rank": 4}))
    with pytest.raises(FleetError, match="another ModelConfig"):
        refuse_incompatible(run, world_size=2, model=other)


@pytest.mark.parametrize("profile, micro, counts", [("4,2", 1, "rank 0 4, rank 1 2"), ("4,2", 2, "rank 0 2, rank 1 1")])
def test_fsdp_with_ranks_of_unequal_slice_counts_is_refused_not_a_hang(tmp_path, profile, micro, counts):
    # every FSDP2 forward and backward is a collective: a review's 4,2 fleet at micro_batch 1 hung
    # until the launcher's timeout (rank 0 in its third slice's all-gather, rank 1 in the reduce)
    with pytest.raises(DormouseError, match=f"different numbers of slices \\({counts}\\)"):
        GateSettings(out=str(tmp_path), shard="fsdp", profile=profile, micro_batch=micro).validate()
    GateSettings(out=str(tmp_path), shard="fsdp", profile="4,4", micro_batch=2).validate()  # 2 slices each
    GateSettings(out=str(tmp_path), shard="fsdp", profile=profile).validate()  # one slice each: the default


def test_a_refused_fleet_launch_fails_fast_and_trains_nothing(tmp_path):
    s = GateSettings(out=str(tmp_path), steps=5, profile="4,x")  # refused before any process starts
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(DormouseError, match="profile = '4,x' is not allowed"):
        launch_fleet(s, timeout_s=120, stream=lines.append)
    assert time.monotonic() - t0 < 60
    assert not any("loss=" in line for line in lines)
    assert not list(tmp_path.glob("rank*"))


# 8 --------------------------------------------------------------------------------------------

def test_a_killed_rank_fails_the_fleet_fast_naming_it_and_leaves_no_torn_files(tmp_path):
    s = GateSettings(out=str(tmp_path), steps=20, profile="", resume_world=0)
    t0 = time.monotonic()
    lines: list[str] = []
    with pytest.raises(FleetError) as info:
        launch_fleet(s, timeout_s=120, stream=lines.append, entry=[FAULTS], fork_ranks=True,  # torchrun reports one rank
                     env={"DORMOUSE_TEST_FAULT": "kill_rank1"})
    assert time.monotonic() - t0 < 60
    assert str(info.value).endswith("rank 1 exited with -9"), failure_summary(lines)
    # the rank the agent then stopped (SIGTERM) is not reported as crashed: forked from the agent,
    # it once inherited the agent's handler and printed a SignalException traceback; and if its
    # reduce saw the peer's socket close first, it says that, not that it crashed
    assert not [line for line in lines if "SignalException" in line or "rank 0: dormouse gate: the run crashed" in line
                or ("rank 0" in line and PEER_LOST not in line and "error: " in line)], lines
    # The recording is not closed (nothing says it complete: the judge refuses it in one line), and
    # every file it holds is whole (written atomically: a rank killed mid-write leaves at most a hidden
    # temporary file, never a torn one).
    assert json.loads((tmp_path / "recording.json").read_text())["closed"] is False
    with pytest.raises(DormouseError, match="no finished segment: the loop must call rec.close"):
        RecordingSet(tmp_path)
    from safetensors.torch import load_file

    for p in tmp_path.rglob("*"):
        if ".tmp" in p.name:
            assert p.name.startswith("."), p
        elif p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".safetensors":
            load_file(str(p))
    # The checkpoint is whole: the one from step 2 (rank 1 died after step 3,
    # so the fleet never finished writing step 4's, and atomically so).
    payload = torch.load(tmp_path / "ckpts" / "fleet.pt", weights_only=True)
    assert json.loads(payload["meta"])["step"] == 2


def test_a_rank_that_raises_mid_run_is_named_with_its_reason_not_a_timeout(tmp_path):
    """Rank 1 raises after step 2 while rank 0 is in step 3's reduce: rank 1
    leaves the group without waiting for its peers (a barrier there hung the
    fleet until the launcher's timeout: a review found it), rank 0's reduce
    then fails, and the error names rank 1 and its reason."""
    s = GateSettings(out=str(tmp_path), steps=4, profile="", resume_world=0)
    t0 = time.monotonic()
    with pytest.raises(FleetError) as info:
        launch_fleet(s, timeout_s=60, stream=lambda line: None, entry=[FAULTS],
                     env={"DORMOUSE_TEST_FAULT": "raise_rank1"})
    assert time.monotonic() - t0 < 45, str(info.value)
    assert "rank 1: dormouse gate: the run crashed: RuntimeError: planted failure on rank 1" in str(info.value)
