"""Resume parity: a fleet stopped at step 10 and resumed is the uninterrupted
fleet, bit for bit; checkpoints cross topologies (2-rank fleet -> one process,
one process -> 2-rank fleet, replicated and FSDP2) and stay within the
measured round-off floor of the uninterrupted single-process run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dormouse.gate.artifacts import load_meta, load_tensors
from dormouse.gate.launcher import launch_plan
from dormouse.gate.modes import GateSettings, run_single
from dormouse.gate.verdict import floor_envelope, tolerance_from

QUIET = lambda line: None  # noqa: E731


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("resume")
    d = {name: base / name for name in (
        "single", "single10", "fleet", "fleet10", "fleet_resumed", "fsdp", "fsdp10", "fsdp_resumed",
        "fleet_from_single", "fsdp_from_single", "single_from_fleet", "single_from_fsdp")}
    run_single(GateSettings(out=str(d["single"]), steps=20, batch=4), log=QUIET)
    run_single(GateSettings(out=str(d["single10"]), steps=10, batch=4), log=QUIET)
    single_ckpt = str(d["single10"] / "ckpts" / "single.pt")
    plan = [
        GateSettings(out=str(d["fleet"]), steps=20),
        GateSettings(out=str(d["fleet10"]), steps=10),
        GateSettings(out=str(d["fleet_resumed"]), steps=20, resume_from=str(d["fleet10"] / "ckpts/fleet.pt")),
        GateSettings(out=str(d["fsdp"]), steps=20, shard="fsdp"),
        GateSettings(out=str(d["fsdp10"]), steps=10, shard="fsdp"),
        GateSettings(out=str(d["fsdp_resumed"]), steps=20, shard="fsdp",
                     resume_from=str(d["fsdp10"] / "ckpts/fleet.dcp")),
        GateSettings(out=str(d["fleet_from_single"]), steps=20, resume_from=single_ckpt),
        GateSettings(out=str(d["fsdp_from_single"]), steps=20, shard="fsdp", resume_from=single_ckpt),
    ]
    launch_plan(plan, timeout_s=300, stream=QUIET)
    for name, source in (("single_from_fleet", "fleet10/ckpts/fleet.pt"),
                         ("single_from_fsdp", "fsdp10/ckpts/fleet.dcp")):
        run_single(GateSettings(out=str(d[name]), steps=20, batch=4, resume_from=str(base / source)), log=QUIET)
    return d


def tensors_equal(a: Path, an: str, b: Path, bn: str) -> bool:
    x, y = load_tensors(a, an), load_tensors(b, bn)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("kind", ["fleet", "fsdp"])
def test_a_fleet_stopped_at_step_ten_and_resumed_equals_the_uninterrupted_fleet_bitwise(runs, kind):
    assert tensors_equal(runs[kind], "rank0", runs[f"{kind}_resumed"], "rank0")
    full = load_meta(runs[kind], "rank0")["losses"]
    resumed = load_meta(runs[f"{kind}_resumed"], "rank0")["losses"]
    assert resumed == full[10:]  # the same bytes, the same learning rates, the same state


def within_single_floor(runs, name: str, artifact: str) -> None:
    """Steps 11..20 of a cross-topology resume against the uninterrupted single
    process, each within that step's floor-derived tolerance."""
    single = load_meta(runs["single"], "single")
    tolerance = tolerance_from(floor_envelope(single))  # the verdict's own rule
    resumed = load_meta(runs[name], artifact)["losses"]
    assert len(resumed) == 10
    for k, loss in enumerate(resumed, start=10):
        ref = single["losses"][k]
        tol = tolerance[k]
        assert abs(loss - ref) / ref <= tol, f"step {k + 1}: {loss} vs {ref} (tolerance {tol:.1e})"


@pytest.mark.parametrize("name", ["single_from_fleet", "single_from_fsdp"])
def test_a_fleet_checkpoint_resumed_by_one_process_stays_within_the_floor(runs, name):
    within_single_floor(runs, name, "single")


@pytest.mark.parametrize("name", ["fleet_from_single", "fsdp_from_single"])
def test_a_single_process_checkpoint_resumed_by_a_fleet_stays_within_the_floor(runs, name):
    within_single_floor(runs, name, "rank0")
