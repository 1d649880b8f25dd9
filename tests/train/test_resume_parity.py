"""Resume parity: a run stopped after step 3 of 6 and resumed is the uninterrupted
run, bit for bit (a replicated fleet, an FSDP2 fleet, one process); checkpoints
cross topologies (2-rank fleet -> one process, one process -> 2-rank fleet,
replicated and FSDP2 .dcp) and stay within the curve tolerance the judge
derives from the uninterrupted single process's one-ulp floor.

Real torchrun fleets (three launches: the runs that write checkpoints and the
first legs of the gate's own stop-and-resume, its second legs, then the resumed ones) and the gate's own modes. The gate writes no checkpoints
(fixtures.make_run: ckpt_every=0), so the runs that must leave one run through
tests/support/ckpt_rank.py: ckpt_every=AT and the step-AT checkpoint kept beside the
final one, which is what a run stopped after step AT leaves. The uninterrupted
references are plain gate runs (they checkpoint nothing).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dormouse.gate.record import modes
from dormouse.gate.record.modes import one_process
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import FLOOR, SINGLE, GateReferences, RecordingSet
from dormouse.gate.judge.facts.curve import curve_tolerance
from dormouse.gate.judge.metrics import running_max
from dormouse.gate.record.launcher import launch_plan
from dormouse.gate.settings import GateSettings

import ckpt_rank
from gatekit import FORK_RANKS

ENTRY = str(Path(ckpt_rank.__file__))
AT, STEPS = 3, 6  # stop after step AT of STEPS
QUIET = lambda line: None  # noqa: E731


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("resume")
    d = {name: base / name for name in (
        "single", "single_ckpt", "single_resumed", "fleet", "fleet_ckpt", "fleet_resumed", "fsdp", "fsdp_ckpt",
        "fsdp_resumed", "fleet_from_single", "fsdp_from_single", "single_from_fleet", "single_from_fsdp",
        "even", "even_legs", "fsdp_even", "fsdp_even_legs")}

    def gs(name, **kw):
        # resume_world=0 unless given: these runs stop and resume by the test's own checkpoints
        return GateSettings(out=str(d[name]), steps=STEPS, **{"resume_world": 0, **kw}).validate()

    def ckpt(name, suffix):
        stem = "single" if name.startswith("single") else "fleet"  # the gate's ckpt_name of the mode
        return str(ckpt_rank.kept(d[name] / "ckpts" / f"{stem}{suffix}", AT))

    # The runs that leave a step-AT checkpoint: one launch for the fleets, the
    # single process in this process (patched here, undone by the monkeypatch).
    ckpt_outs = [str(d[n]) for n in ("fleet_ckpt", "fsdp_ckpt", "single_ckpt")]
    # With them, the gate's own stop and resume (resume_world) at the same world and shapes: its
    # first legs share the launch, its second legs run in one more (launcher.launches).
    launch_plan([gs("fleet"), gs("fleet_ckpt"), gs("fsdp", shard="fsdp"), gs("fsdp_ckpt", shard="fsdp"),
                 gs("even", profile=""), gs("fsdp_even", profile="", shard="fsdp"),
                 gs("even_legs", profile="", resume_world=2),
                 gs("fsdp_even_legs", profile="", resume_world=2, shard="fsdp")],
                timeout_s=400, stream=QUIET, fork_ranks=FORK_RANKS, entry=[ENTRY],
                env={"DORMOUSE_TEST_CKPT_AT": str(AT), "DORMOUSE_TEST_CKPT_OUTS": os.pathsep.join(ckpt_outs)})
    modes.run_single(gs("single"), log=QUIET)  # the uninterrupted reference, with its ulp floor
    with pytest.MonkeyPatch.context() as mp:
        remove = ckpt_rank.install(AT, ckpt_outs)
        mp.setattr(one_process, "measure_floor", lambda *a, **k: {})  # only its checkpoint and tensors are used
        try:
            modes.run_single(gs("single_ckpt"), log=QUIET)
        finally:
            remove()
    # The resumed runs: the fleets in one launch, the single processes here.
    launch_plan([
        gs("fleet_resumed", resume_from=ckpt("fleet_ckpt", ".pt")),
        gs("fsdp_resumed", shard="fsdp", resume_from=ckpt("fsdp_ckpt", ".dcp")),
        gs("fleet_from_single", resume_from=ckpt("single_ckpt", ".pt")),
        gs("fsdp_from_single", shard="fsdp", resume_from=ckpt("single_ckpt", ".pt")),
    ], timeout_s=400, stream=QUIET, fork_ranks=FORK_RANKS)
    # The resumed single processes: only their tensors and losses are compared (the
    # tolerance is the uninterrupted single's floor), so they measure no floor of their own.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(one_process, "measure_floor", lambda *a, **k: {})
        # resume_from relative to out
        modes.run_single(gs("single_resumed", resume_from=f"../single_ckpt/ckpts/single.step{AT}.pt"), log=QUIET)
        modes.run_single(gs("single_from_fleet", resume_from=ckpt("fleet_ckpt", ".pt")), log=QUIET)
        modes.run_single(gs("single_from_fsdp", resume_from=ckpt("fsdp_ckpt", ".dcp")), log=QUIET)
    return d


def recording(out: Path, who: str) -> tuple[RecordingSet, int]:
    """The recording holding `who` ("single": the single process's; "rank<r>": the fleet's) and its rank."""
    if who == "single":
        return RecordingSet(A.gate_reference_dir(out, SINGLE)), 0
    return RecordingSet(out), int(who[len("rank"):])


def final(out: Path, who: str) -> dict[str, torch.Tensor]:
    """`who`'s own tensors after the last step (a rank's local shards under FSDP2)."""
    rec, r = recording(out, who)
    return A.read_tensors(A.final_tensors_path(rec.out, r), "final")[0]


def losses(out: Path, who: str) -> list[float]:
    """The loss `who` logged at each step it recorded."""
    rec, r = recording(out, who)
    return [rec.step_meta(r, k)["loss"] for k in rec.steps if r < rec.world_at(k)]


def equal_tensors(a: Path, an: str, b: Path, bn: str) -> list[str]:
    """The names of the tensors that differ (or are missing on one side)."""
    x, y = final(a, an), final(b, bn)
    return sorted(set(x) ^ set(y)) + sorted(k for k in set(x) & set(y) if not torch.equal(x[k], y[k]))


def test_the_checkpoints_were_written_midway_and_saving_them_changed_nothing(runs):
    for name, artifact in (("fleet_ckpt", "rank0"), ("fsdp_ckpt", "rank0"), ("single_ckpt", "single")):
        ckpts = sorted(p.name for p in (runs[name] / "ckpts").iterdir() if not p.name.endswith(".jsonl"))
        stem = "single" if name.startswith("single") else "fleet"
        suffix = ".dcp" if name.startswith("fsdp") else ".pt"
        assert ckpts == sorted([f"{stem}{suffix}", f"{stem}.step{AT}{suffix}"]), ckpts
        plain = name.split("_")[0]
        assert equal_tensors(runs[plain], artifact, runs[name], artifact) == []
        assert losses(runs[plain], artifact) == losses(runs[name], artifact)
    assert not (runs["fleet"] / "ckpts" / "fleet.pt").exists()  # the plain gate checkpoints nothing


@pytest.mark.parametrize("kind, artifact", [("fleet", "rank0"), ("fleet", "rank1"), ("fsdp", "rank0"),
                                            ("single", "single")])
def test_a_run_stopped_midway_and_resumed_equals_the_uninterrupted_run_bitwise(runs, kind, artifact):
    full, resumed = runs[kind], runs[f"{kind}_resumed"]
    assert equal_tensors(full, artifact, resumed, artifact) == []
    assert recording(resumed, artifact)[0].steps[0] == AT + 1  # a recording of its own, from the checkpoint on
    # the same bytes, the same learning rates, the same optimizer state: the same losses
    assert losses(resumed, artifact) == losses(full, artifact)[AT:]


@pytest.mark.parametrize("kind", ["even", "fsdp_even"])
def test_the_gates_own_stop_and_resume_at_the_same_world_equals_the_uninterrupted_fleet_bitwise(runs, kind):
    """resume_world = world over an even profile: leg 1 stops after step AT,
    leg 2 resumes its checkpoint at the same shapes; the run is the
    uninterrupted fleet's, bit for bit, on every rank."""
    full, legs = runs[kind], runs[f"{kind}_legs"]
    rec = RecordingSet(legs)
    assert [(seg["start"], seg["end"], seg["world"]) for seg in rec.meta["segments"]] == [(1, AT, 2), (AT + 1, 6, 2)]
    shapes = [[tuple(b["arg0"].shape) for _, _, b in r.micro_batches(k)] for r in (rec, RecordingSet(full))
              for k in (1, STEPS)]
    assert shapes == [[(2, 64), (2, 64)]] * 4
    for artifact in ("rank0", "rank1"):
        assert equal_tensors(full, artifact, legs, artifact) == []
        assert losses(legs, artifact) == losses(full, artifact)


def within_the_curve_tolerance(runs, name: str, artifact: str) -> None:
    """Steps AT+1..STEPS of a cross-topology resume against the uninterrupted single
    process, each within that step's tolerance by the judge's rule (10 x the
    running maximum of the one-ulp floor runs, at least MIN_RTOL)."""
    ref = losses(runs["single"], "single")
    floor = [0.0] * len(ref)
    for run in GateReferences(runs["single"]).meta(FLOOR)["runs"].values():
        for k, (x, y) in enumerate(zip(run["losses"], ref)):
            floor[k] = max(floor[k], abs(x - y) / abs(y))
    tolerance = curve_tolerance(running_max(floor))
    mine = losses(runs[name], artifact)
    assert recording(runs[name], artifact)[0].steps[0] == AT + 1 and len(mine) == STEPS - AT
    off = [(k + 1, abs(loss - ref[k]) / abs(ref[k]), tolerance[k]) for k, loss in enumerate(mine, start=AT)]
    assert all(r <= t for _, r, t in off), [f"step {k}: {r:.1e} > {t:.1e}" for k, r, t in off if not r <= t]
    # and the resume really continued the run (not started it again): step AT+1's
    # loss is the uninterrupted run's, not the untrained network's
    assert abs(mine[0] - ref[AT]) < abs(ref[0] - ref[AT])


@pytest.mark.parametrize("name", ["single_from_fleet", "single_from_fsdp"])
def test_a_fleet_checkpoint_resumed_by_one_process_stays_within_the_curve_tolerance(runs, name):
    within_the_curve_tolerance(runs, name, "single")


@pytest.mark.parametrize("name", ["fleet_from_single", "fsdp_from_single"])
def test_a_single_process_checkpoint_resumed_by_a_fleet_stays_within_the_curve_tolerance(runs, name):
    within_the_curve_tolerance(runs, name, "rank0")
