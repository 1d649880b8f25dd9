"""Topology invariance of the exact reduce, on real torchrun fleets (gloo, CPU).

With dist_reduce="exact" and micro_batch=1 a run depends only on the global
batch (4 windows) and the micro-batch: one process (LocalSync, 4 slices),
2 ranks x 2 and 4 ranks x 1 end bitwise equal, every parameter, buffer and
logged loss, at lr 1e-2 over 8 steps (where the fp32 ring's round-off has
grown far beyond one ulp) (3 uneven ranks "2,1,1": the exact gate,
tests/gate/catches/test_own_fleet_exact.py, bitwise at every step). An uneven profile "3,1" equals "2,2", and a
checkpoint written by 4 ranks at step 4 resumes on 2 ranks to the same bits.
FSDP2 with one slice per rank is exact too. The fp32 ring at 4 ranks over the
same slices is NOT bitwise equal: the check can fail. One torchrun launch per world size carries all its runs (a plan).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gatekit import SUPPORT
from runs import make_run
from dormouse.gate.record.launcher import torchrun
from dormouse.train.data import FleetPlan, RankShape
from dormouse.train.exact import tree_sum
from dormouse.train.loop import LocalSync, build_model, train
from dormouse.train.tensors import named_state

RANK = str(SUPPORT / "exact_rank.py")
LR, STEPS = 1e-2, 8
AT = STEPS // 2  # the 4-rank fleet that stops, checkpoints and is resumed on 2 ranks
NS = ("float32", "bfloat16")  # Newton-Schulz dtype: the gate's and torch's


def single(out: Path, *, ns: str, micro: int = 1, reduce: str = "exact", shapes=None, steps: int = STEPS,
           clip: float | None = None) -> dict:
    """The exact reference: one process, global batch 4, in slices of `micro` windows."""
    run = make_run(out, steps=steps, batch=4, lr=LR, reduce=reduce)
    run.train = dataclasses.replace(run.train, micro_batch=micro, ns_dtype=ns)
    if clip is not None:
        run.train = dataclasses.replace(run.train, grad_clip=clip)
    model = build_model(run)
    plan = FleetPlan(shapes, micro) if shapes else None  # another cut of the step, computed alone
    report = train(model, run, log=lambda _: None, sync=LocalSync(run, plan))
    return {"losses": report["losses"], "state": named_state(model)}


def fleet_result(out: Path, rank: int = 0) -> dict:
    meta = json.loads((out / f"rank{rank}.json").read_text())
    return {"losses": meta["losses"], "state": load_file(str(out / f"rank{rank}.safetensors")), **meta}


def launch(world: int, plan: list[dict], base: Path) -> None:
    plan_file = base / f"plan{world}.json"
    plan_file.write_text(json.dumps(plan))
    cmd = torchrun([RANK, str(plan_file)], world=world)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def entry(out: Path, *, batch: int, ns: str, profile: str = "", reduce: str = "exact", steps: int = STEPS,
          resume_from: str = "", micro: int = 1, shard: str = "none") -> dict:
    Path(out).mkdir(parents=True, exist_ok=True)
    return {"out": str(out), "steps": steps, "batch": batch, "profile": profile, "lr": LR, "reduce": reduce,
            "resume_from": resume_from, "train": {"micro_batch": micro, "ns_dtype": ns, "dist_shard": shard}}


def differing(a: dict, b: dict) -> list[str]:
    """Names of tensors (and 'losses') that are not bitwise equal."""
    bad = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    assert set(a["state"]) == set(b["state"])
    return bad + (["losses"] if a["losses"] != b["losses"] else [])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """single(ns=ns) at its defaults, computed once per dtype in this module (three tests hold the
    float32 one against something): a dict nobody edits."""
    done: dict[str, dict] = {}

    def get(ns: str) -> dict:
        if ns not in done:
            done[ns] = single(tmp_path_factory.mktemp(f"single_{ns}"), ns=ns)
        return done[ns]

    return get


@pytest.fixture(scope="module")
def fleets(tmp_path_factory) -> Path:
    """Every fleet of this module: one launch per world size (4, then 2)."""
    base = tmp_path_factory.mktemp("exact")
    four, two = [], []
    for ns in NS:
        four.append(entry(base / f"w4_{ns}", batch=1, ns=ns))
        two.append(entry(base / f"w2_{ns}", batch=2, ns=ns))
    four.append(entry(base / "w4_ckpt", batch=1, ns="float32"))
    four[-1]["train"]["stop_at"] = AT  # stops at step AT of the same STEPS-step schedule, checkpointing there
    four.append(entry(base / "w4_ring", batch=1, ns="float32", reduce="fp32"))
    two.append(entry(base / "w2_uneven", batch=2, profile="3,1", ns="float32"))
    two.append(entry(base / "w2_resumed", batch=2, ns="float32",
                     resume_from=str(base / "w4_ckpt" / "ckpts" / "gate.pt")))
    two.append(entry(base / "w2_micro2", batch=2, ns="float32", micro=2))
    two.append(entry(base / "w2_buckets", batch=2, ns="float32"))
    two[-1]["train"]["dist_bucket_mb"] = 0.05  # ~13 buckets, each its own all_to_all and all_gather
    # Clipping off here; with clipping the exact FSDP2 fleet computes the norm from whole gathered
    # gradients (loop.clip_grad_norm), bitwise too: tests/gate/catches/test_own_fleet_exact.py shows it.
    four.append(entry(base / "w4_fsdp", batch=1, ns="float32", micro=0, shard="fsdp"))
    four[-1]["train"]["grad_clip"] = 0.0
    two.append(entry(base / "w2_fsdp_micro_ring", batch=2, ns="float32", reduce="fp32", shard="fsdp"))
    two.append(entry(base / "w2_fsdp_uneven", batch=2, profile="3,1", ns="float32", micro=0, shard="fsdp"))
    two[-1]["train"]["grad_clip"] = 0.0
    launch(4, four, base)
    launch(2, two, base)
    return base


@pytest.mark.parametrize("ns", NS)
def test_one_process_two_ranks_and_four_ranks_end_bitwise_equal(fleets, plain, ns):
    ref = plain(ns)
    for world in (2, 4):
        for r in range(world):  # every rank holds the same bits
            got = fleet_result(fleets / f"w{world}_{ns}", r)
            assert got["world"] == world
            assert differing(got, ref) == [], f"world {world} rank {r}"
    assert len(ref["losses"]) == STEPS and len(set(ref["losses"])) == STEPS  # it trained: every step moved the loss


def test_uneven_profile_and_many_small_buckets_train_bitwise_like_the_even_one_bucket_fleet(fleets):
    even = fleet_result(fleets / "w2_float32", 0)
    assert differing(fleet_result(fleets / "w2_uneven", 1), even) == []
    assert differing(fleet_result(fleets / "w2_buckets", 1), even) == []


def test_checkpoint_of_four_ranks_resumes_on_two_bitwise(fleets):
    resumed = fleet_result(fleets / "w2_resumed")
    assert resumed["start_step"] == AT and len(resumed["losses"]) == STEPS - AT
    assert len(fleet_result(fleets / "w4_ckpt")["losses"]) == AT
    full = fleet_result(fleets / "w4_float32")
    assert resumed["losses"] == full["losses"][AT:]
    assert differing({**resumed, "losses": []}, {**full, "losses": []}) == []


def test_micro_batch_two_on_two_ranks_equals_one_process_in_slices_of_two(fleets, tmp_path):
    assert differing(fleet_result(fleets / "w2_micro2", 1), single(tmp_path, ns="float32", micro=2)) == []


def test_the_fp32_ring_at_four_ranks_is_close_but_not_bitwise_equal(fleets):
    ring, exact = fleet_result(fleets / "w4_ring"), fleet_result(fleets / "w4_float32")
    assert differing(ring, exact)  # the check sees the ring's summation order
    dev = max(abs(a - b) / abs(b) for a, b in zip(ring["losses"], exact["losses"]))
    assert 0 < dev < 1e-2  # the same training otherwise


def test_fsdp_with_one_slice_per_rank_is_exact_too(fleets, tmp_path):
    # Four ranks of one window: the same 4 slices as the replicated exact fleets and one process
    # (which end bitwise equal to each other: test_one_process_two_ranks_and_four_ranks_end_bitwise_equal).
    assert differing(fleet_result(fleets / "w4_fsdp", 3), single(tmp_path / "noclip", ns="float32", clip=0.0)) == []
    # Uneven "3,1", one slice per rank: one process computing slices of 3 and 1 windows.
    ref = single(tmp_path / "uneven", ns="float32", micro=0, shapes=[RankShape(3, 64), RankShape(1, 64)], clip=0.0)
    assert differing(fleet_result(fleets / "w2_fsdp_uneven", 1), ref) == []


def test_fsdp_fp32_with_micro_batches_trains_the_same_network_up_to_summation_order(fleets):
    # FSDP2 reduce-scatters each slice's backward and adds: (g0 + g2) + (g1 + g3), not the tree.
    fsdp, exact = fleet_result(fleets / "w2_fsdp_micro_ring"), fleet_result(fleets / "w2_float32")
    dev = max(abs(a - b) / abs(b) for a, b in zip(fsdp["losses"], exact["losses"]))
    assert 0 < dev < 1e-2 and len(set(fsdp["losses"])) == len(fsdp["losses"])


# In-process -----------------------------------------------------------------------------------

def test_tree_sum_is_the_fixed_pairwise_tree_of_the_slice_count():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0], dtype=torch.float32)
    # ((x0 + x1) + (x2 + x3)) + x4, each + rounded in float32
    want = ((x[0] + x[1]) + (x[2] + x[3])) + x[4]
    assert tree_sum(x).item() == want.item() == 3.0
    assert tree_sum(x[:3]).item() == ((x[0] + x[1]) + x[2]).item()
    rows = torch.randn(7, 5)
    assert torch.equal(tree_sum(rows)[2:4], tree_sum(rows[:, 2:4]))  # chunks sum alike


def test_exact_single_process_is_the_same_whether_slices_come_from_shapes_or_micro_batch(tmp_path, plain):
    by_micro = plain("float32")
    by_shapes = single(tmp_path / "b", ns="float32", micro=0, shapes=[RankShape(1, 64)] * 4)
    assert differing(by_micro, by_shapes) == []


def test_one_ulp_in_one_slice_is_seen_by_the_exact_reference(tmp_path, plain):
    from dormouse.train import hooks

    ref = plain("float32")  # computed without the hook below
    seen = []

    def nudge(piece):  # step 2, slice 1: every element to its float neighbour
        seen.append((piece.step, piece.slice))
        if (piece.step, piece.slice) == (2, 1):
            for g in piece.grads.values():
                g.copy_(torch.nextafter(g, torch.full_like(g, torch.inf)))

    remove = hooks.install(hooks.Hooks(on_local_grads=[nudge]))
    try:
        nudged = single(tmp_path / "nudged", ns="float32")
    finally:
        remove()
    assert seen[:5] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]  # once per slice, in slice order
    assert differing(nudged, ref)


def test_a_micro_batch_that_does_not_divide_a_rank_and_several_slices_under_fsdp_are_refused(tmp_path):
    from dormouse.errors import FleetError, PlanError
    from dormouse.train.distributed import refuse_incompatible

    run = make_run(tmp_path, steps=1, batch=2, profile="3,2", dist=True, reduce="exact")
    run.train = dataclasses.replace(run.train, micro_batch=2)
    with pytest.raises(FleetError, match=r"micro_batch = 2: it does not divide every rank's batch \(3, 2\)"):
        refuse_incompatible(run, world_size=2)
    run.train = dataclasses.replace(run.train, micro_batch=1, dist_shard="fsdp")
    with pytest.raises(FleetError, match="micro_batch = 1 gives a rank several slices, which FSDP2 adds"):
        refuse_incompatible(run, world_size=2)
    run.train = dataclasses.replace(run.train, micro_batch=0)
    refuse_incompatible(run, world_size=2)  # one slice per rank: exact under FSDP2
    run.train = dataclasses.replace(run.train, micro_batch=2)
    with pytest.raises(PlanError, match=r"does not divide every rank's batch \(3, 2\)"):
        LocalSync(run, FleetPlan([RankShape(3, 64), RankShape(2, 64)], 2))


def test_fleetsync_exact_sums_five_uneven_slices_by_the_tree_with_missing_gradients(tmp_path):
    # Ranks hold 2, 1, 2 slices; b's gradient exists only in slices 1 and 3.
    # Buckets go out during a rank's LAST slice's backward: rank 0's (slice 1)
    # completes all three; on ranks 1 and 2 the last slice lacks b, so [b] and
    # [a] after it wait for reduce() (b as zeros), in the same order everywhere.
    script = str(SUPPORT / "exact_sync_rank.py")
    cmd = torchrun([script, str(tmp_path)], world=3)
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["slices"] == [0, 1, 2, 3, 4] for r in ranks)
    assert [r["launched_in_last_backward"] for r in ranks] == [3, 1, 1]
    assert all(r["exact"] for r in ranks)
