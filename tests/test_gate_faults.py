"""A gate that cannot fail is no gate: real faults injected into real fleets
(tests/fleet_faults.py patches the library inside the rank processes), and the
verdict failing for the right reason each time."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormouse.errors import FleetError
from dormouse.gate import fixtures
from dormouse.gate.launcher import launch_fleet
from dormouse.gate.modes import GateSettings, run_gradref, run_single
from dormouse.gate.verdict import compare

FAULTS = str(Path(__file__).with_name("fleet_faults.py"))
QUIET = lambda line: None  # noqa: E731


def faulty_fleet(s: GateSettings, fault: str) -> None:
    launch_fleet(s, timeout_s=240, stream=QUIET, entry=[FAULTS], env={"DORMOUSE_TEST_FAULT": fault})


def step_dir(tmp_path, fault: str) -> dict:
    """gradref for capacity "4,2" and a one-step fleet with the fault."""
    s = GateSettings(out=str(tmp_path), steps=1, capacity="4,2")
    run_gradref(s, log=QUIET)
    faulty_fleet(s, fault)
    return compare(tmp_path)


def curve_dir(tmp_path, fault: str | None, **settings) -> dict:
    """single at batch 4 and a 20-step fleet of 2 x 2 with the fault."""
    s = GateSettings(out=str(tmp_path), steps=20, batch=2, **settings)
    run_single(GateSettings(out=str(tmp_path), steps=20, batch=4), log=QUIET)
    if fault:
        faulty_fleet(s, fault)
    else:
        launch_fleet(s, timeout_s=240, stream=QUIET)
    return compare(tmp_path)


def test_plain_mean_instead_of_token_weighting_fails_the_gradient_check(tmp_path):
    v = step_dir(tmp_path, "plain_mean")
    g = v["checks"]["gradref"]
    assert not v["pass"] and not g["pass"]
    assert v["checks"]["ranks"]["pass"]  # every rank applied the same wrong gradient
    assert g["per_tensor"][g["worst_grad"]]["grad_rel"] > 1e-2
    assert "gradient max relative difference" in g["reason"] and "> 1e-05" in g["reason"]


def test_a_parameter_left_out_of_the_reduce_is_named_by_the_verdict(tmp_path):
    v = step_dir(tmp_path, "skip_param")
    assert not v["pass"]
    assert not v["checks"]["ranks"]["pass"] and "head.weight" in v["checks"]["ranks"]["reason"]
    assert v["checks"]["gradref"]["worst_grad"] == "head.weight"


def test_ranks_built_from_different_seeds_are_refused_at_start(tmp_path):
    s = GateSettings(out=str(tmp_path), steps=5)
    with pytest.raises(FleetError, match=r"ranks \[1\] start from different parameters"):
        faulty_fleet(s, "seeds_checked")


def test_ranks_from_different_seeds_fail_the_verdict_when_the_start_check_is_off(tmp_path):
    v = curve_dir(tmp_path, "seeds")
    assert not v["checks"]["ranks"]["pass"]
    assert "ranks differ" in v["checks"]["ranks"]["reason"]
    assert not v["checks"]["curve"]["pass"]


def test_bf16_reduce_judged_against_the_fp32_tolerance_fails(tmp_path):
    v = curve_dir(tmp_path, None, reduce="bf16")
    assert v["pass"]  # judged by its own, stated bound it passes ...
    strict = compare(tmp_path, judge_reduce="fp32")
    c = strict["checks"]["curve"]
    assert not strict["pass"] and c["first_bad_step"] is not None  # ... but not by fp32's floor
    assert "exceeds tolerance first at step" in c["reason"]


def test_capacity_dropping_moe_forced_past_the_refusal_fails_the_curve_at_once(tmp_path, monkeypatch):
    # The single-process reference drops by capacity too: same config, one batch.
    monkeypatch.setitem(fixtures.TINY, "moe_capacity", 0.5)
    v = curve_dir(tmp_path, "capacity_moe")
    c = v["checks"]["curve"]
    assert not v["pass"] and not c["pass"]
    assert c["first_bad_step"] == 1  # the drops differ from the very first forward
    assert "suspect the fleet's mathematics" in c["summary"]
