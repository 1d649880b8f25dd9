"""The exact gate: with reduce="exact", a fleet is bitwise the exact reference
(one process computing the same slices) at every step, at lr 1e-2 over 8
steps, at worlds 2 and 3 with uneven profiles, stopped midway and resumed in
one process (four ranks: tests/train/test_exact.py); and one ulp in one
tensor of one rank at one step fails it."""

from __future__ import annotations

import pytest

# outside CI's time (run them with `pytest -m slow`): the exact gate on the own fleet at every step; exact reduce's bitwise parity stays in CI (tests/train/test_exact.py)
pytestmark = pytest.mark.slow

from dormouse.gate.record import modes
from dormouse.gate.artifacts import EXACT, GateReferences, RecordingSet
from dormouse.gate.judge.entry import judge
from dormouse.gate.judge.facts.exact import check_exact
from dormouse.gate.settings import GateSettings, ParameterError
from gatekit import QUIET, faulty_fleets, references

PROFILES = {2: "3,1", 3: "2,1,1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every exact fleet of this file in one plan, three launches (the first
    legs and one-launch runs at worlds 2 and 3, then every second leg at one
    rank): the clean fleets, a whole exact gate at the default profile in
    slices of one window, and the same fleet with one ulp planted."""
    base = tmp_path_factory.mktemp("exact_gate")
    plan = {w: GateSettings(out=str(base / f"w{w}"), world=w, profile=c, reduce="exact", micro_batch=1, lr=1e-2,
                            steps=8).validate() for w, c in PROFILES.items()}
    # `--reduce exact --capacity 3,3` without a micro-batch, replicated and under FSDP2, stopped at
    # step 3 and resumed alone (the default): the clipping binds at every step
    even = {shard: GateSettings(out=str(base / shard), profile="3,3", reduce="exact", shard=shard,
                                steps=6).validate() for shard in ("none", "fsdp")}
    whole = GateSettings(out=str(base / "whole"), reduce="exact", micro_batch=1, steps=8, resume_world=0).validate()
    ulp = GateSettings(out=str(base / "ulp"), reduce="exact", micro_batch=1, steps=5, resume_world=0).validate()
    faulty_fleets([*((s, None) for s in [*plan.values(), *even.values(), whole]), (ulp, "one_ulp")])
    for s in plan.values():
        modes.run_exact(s, log=QUIET)
    for s in [*even.values(), whole]:
        references(s)
    modes.run_exact(ulp, log=QUIET)
    return plan, even, (whole, ulp)


def exact_check(s: GateSettings):
    """The exact fact alone: the fleet's recording against the exact reference's."""
    return check_exact(RecordingSet(s.out_dir), GateReferences(s.out_dir).recording(EXACT))


@pytest.fixture(scope="module")
def exact_runs(runs):
    return runs[0]


@pytest.mark.parametrize("world", list(PROFILES))
def test_an_exact_fleet_is_bitwise_the_exact_reference_at_every_step(exact_runs, world):
    s = exact_runs[world]
    c = exact_check(s)
    assert c.passed, c.reason
    assert c.steps_equal == [True] * 8 and "bitwise equal at all 8 steps" in c.reason
    rec = RecordingSet(s.out_dir)
    assert rec.resumed_at() == [5] and rec.world_at(8) == 1  # stopped after step 4, resumed alone


@pytest.fixture(scope="module")
def one_launch(runs):
    return runs[2]


def test_one_ulp_in_one_tensor_of_one_rank_at_one_step_fails_the_exact_check(one_launch):
    c = exact_check(one_launch[1])
    assert not c.passed
    assert c.first_step == 3 and c.first_tensor == "g/head.weight" and c.ulps >= 1
    assert c.steps_equal[:2] == [True, True] and not c.steps_equal[2]
    assert "first differs at step 3, g/head.weight element" in c.reason


def test_a_whole_exact_gate_passes_every_check(one_launch):
    v = judge(one_launch[0].out_dir)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    assert "exact" in v.references and v.check("exact").passed


@pytest.fixture(scope="module")
def even_runs(runs):
    return runs[1]


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_the_exact_gate_passes_the_fleets_it_builds_without_a_micro_batch(even_runs, shard):
    # On main: without a micro-batch the resumed leg summed one slice of 6 where the exact
    # reference summed two of 3 (1 ulp at step 4); FSDP2's clip norm summed shard norms (18 ulps at step 1).
    s = even_runs[shard]
    assert s.micro_batch == 3  # the settings chose the slices every leg shares: gcd(3, 3, 6)
    v = judge(s.out_dir)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    assert "bitwise equal at all 6 steps" in v.check("exact").reason
    rec = RecordingSet(s.out_dir)
    assert all(rec.step_meta(0, k)["grad_norm"] > 0.05 for k in rec.steps)  # the clip bound at every step: the
    # norm's order mattered


def test_exact_under_fsdp_with_several_slices_per_rank_is_refused_in_one_line(tmp_path):
    with pytest.raises(ParameterError, match="takes one slice per rank") as e:
        GateSettings(out=str(tmp_path), profile="4,2", reduce="exact", shard="fsdp").validate()
    assert "\n" not in str(e.value)
