"""The pytest gate's planted faults on dormouse's own trainer: every faulty fleet in ONE torchrun launch
(a plan, each run with its own fault), each failing for its own named reason; the clean fleets are
test_own_fleet_faults.py's (two files, so that two workers launch them side by side)."""

from __future__ import annotations

import pytest

from dormouse.gate.settings import GateSettings
from gatekit import faulty_fleets, judged

# --------------------------------------------------------------------------- planted faults

# Every faulty fleet here runs in ONE torchrun launch (a plan, each run with its
# own fault: fleet_faults.scoped undoes a fault after its run), without the
# stop-and-resume (resume_world 0: no fault here is about the resume), and a
# clean run last in the same launch shows that no fault leaks into the next run.
FAULTY = {
    "grad_x2": ("grad_x2", {"steps": 6}),
    "window_weights": ("window_weights", {"profile": "4x32,2x64", "steps": 6}),
    # made-up gradient where every window's is exactly zero, under mixed lengths (no curve)
    "zero_fill": ("zero_fill", {"profile": "4x32,1x64", "steps": 6}),
    "plain_mean": ("plain_mean", {"steps": 5}),
    "loads_reversed": ("loads_reversed", {"steps": 3}),  # the routing bias by the loads reversed
    "wrong_step": ("wrong_step", {"steps": 6}),
    "batch_stats": ("batch_stats", {"steps": 5}),
    "skip_param": ("skip_param", {"steps": 3}),
    "seeds": ("seeds", {"steps": 3}),
    "capacity_moe": ("capacity_moe", {"steps": 3}),
    "clean_after": (None, {"steps": 3}),
}
EVERYWHERE = {"batch_stats", "capacity_moe"}  # faults in the network itself: the references run it too


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("faulty")
    plan = {name: GateSettings(out=str(base / name), resume_world=0, **extra).validate()
            for name, (_, extra) in FAULTY.items()}
    faulty_fleets([(plan[name], fault) for name, (fault, _) in FAULTY.items()])
    return plan


def faulty_gate(faulty, name):
    return judged(faulty[name], FAULTY[name][0] if name in EVERYWHERE else None)


def test_gradient_times_two_fails_the_gradient_naming_the_factor_and_the_curve_at_step_one(faulty):
    v = faulty_gate(faulty, "grad_x2")
    assert not v.passed
    g = v.check("gradient")
    assert not g.passed and "times 2" in g.reason and g.worst > 0.5
    c = v.check("curve")
    assert not c.passed and "step-1 gradients differ" in c.reason
    assert v.check("replay").passed and v.check("gradref").passed  # it applied its gradient; it read the right bytes


def test_window_weighting_under_mixed_window_lengths_fails_the_gradient(faulty):
    v = faulty_gate(faulty, "window_weights")
    g = v.check("gradient")
    assert not v.passed and not g.passed and g.first_step == 1 and g.worst > 1e-2
    assert "not by a constant factor" in g.reason  # windows weighted alike where their tokens differ
    assert v.check("independence").passed  # the network is fine; the fleet's weights are not


def test_gradient_made_up_where_no_rank_has_any_fails_the_gradient_exactly(faulty):
    """2^-22 of the tensor's largest element: far within the relative bound,
    so only the exact zeros check sees it (reviews' false passes)."""
    v = faulty_gate(faulty, "zero_fill")
    assert not v.passed
    g = v.check("gradient")
    assert not g.passed and g.first_step == 1 and g.worst <= g.bound  # the relative bound alone passes it
    assert "where one process's gradient is exactly zero every way it computes it" in g.reason and "embed.weight" in g.reason, g.reason


def test_plain_mean_instead_of_token_weighting_fails_the_gradient_naming_the_weighting(faulty):
    v = faulty_gate(faulty, "plain_mean")
    g = v.check("gradient")
    # one slice per rank, so each rank's own token mean is its micro-batch's; the replay holds (it applied
    # what it computed)
    assert not v.passed and not g.passed and "not the global mean the objective declares" in g.reason
    assert "at step 1" in g.reason and v.check("replay").passed and v.check("ranks").passed


def test_a_routing_bias_moved_by_the_loads_reversed_fails_the_buffers_check_alone(faulty):
    v = faulty_gate(faulty, "loads_reversed")
    b = v.check("buffers")
    assert not v.passed and not b.passed and b.reason.startswith("block.moe.router_bias before step 2 is not")
    # its gradients and update are right, the bias alone moved wrongly (the curve follows it)
    assert all(c.passed for c in v.checks if c.name not in ("buffers", "curve")), \
        "\n".join(f"{c.name}: {c.reason}" for c in v.checks)


def test_a_fleet_reading_step_k_plus_8s_bytes_fails_gradref(faulty):
    v = faulty_gate(faulty, "wrong_step")
    g = v.check("gradref")
    assert not v.passed and not g.passed and "other bytes than the data rule gives at step 1" in g.reason


@pytest.mark.parametrize("name, check", [
    ("batch_stats", "independence"),  # a batch-dependent layer
    ("seeds", "ranks"),  # ranks whose models start apart after the start check
    ("capacity_moe", "independence"),  # a capacity-dropping MoE forced past the refusal
])
def test_a_fault_in_the_network_or_its_start_fails_its_check(faulty, name, check):
    v = faulty_gate(faulty, name)
    c = v.check(check)
    assert not v.passed and not c.passed, c.reason


def test_a_parameter_left_out_of_the_reduce_is_named(faulty):
    v = faulty_gate(faulty, "skip_param")
    assert not v.passed
    assert not v.check("ranks").passed and "head.weight" in v.check("ranks").reason, v.check("ranks").reason


def test_a_clean_run_after_faulty_ones_in_the_same_launch_passes_no_fault_leaks(faulty):
    v = faulty_gate(faulty, "clean_after")
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks if not c.passed)
