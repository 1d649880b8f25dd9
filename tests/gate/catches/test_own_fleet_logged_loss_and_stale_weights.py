"""Issue 16's findings on the judge, each a real gloo fleet with a fault from
fleet_faults.py that once PASSED the gate or was excused by it:

- a fleet that logs the plain mean of its ranks' losses under a profile with
  two window lengths (no single process applies): its gradients are right,
  its curve is not — the verdict says "the logged loss is wrong";
- a fleet whose eval reports a constant: eval losses are judged too;
- rank 1 computing one step on the previous step's weights, and an FSDP2
  shard keeping last step's gradient: the gradient fails at that step, and the
  curve's summary names that check and step instead of blaming round-off
  amplified by a routing flip.
"""

from __future__ import annotations

import casecheck
import catalogue
import pytest
from fleet_faults import STALE_STEP
from gatekit import faulty_fleets

from dormouse.gate.settings import GateSettings


@pytest.fixture(scope="module")
def wrong(tmp_path_factory) -> dict:
    """The four wrong fleets (the catalogue's "own" rows) in ONE torchrun launch, each run with its own fault."""
    base = tmp_path_factory.mktemp("trust")
    plan = {c.id: GateSettings(out=str(base / c.id), resume_world=0, **c.config).validate()
            for c in catalogue.of("own")}
    faulty_fleets([(plan[c.id], c.fault) for c in catalogue.of("own")])
    return plan


def gate(wrong, fault):
    return casecheck.gated(wrong[fault])


@casecheck.rows("own")
def test_the_verdict_is_the_catalogues(wrong, case):
    casecheck.gives(gate(wrong, case.id), case)


def _failed(v) -> str:
    return "; ".join(f"{c.name}: {c.reason}" for c in v.checks if not c.passed)


def test_a_fleet_logging_the_plain_mean_of_its_ranks_losses_fails_as_a_wrong_logged_loss(wrong):
    v = gate(wrong, "mean_of_ranks_loss")  # its row: the loss alone fails (the gradients are right), named
    loss = v.check("loss")
    assert loss.first_step == 1 and loss.worst > 1e-4
    assert loss.reason.endswith("the logged loss is wrong, not the training")
    assert v.check("curve") is None  # no single process holds this batch


def test_an_eval_that_reports_a_constant_fails_as_a_wrong_logged_eval_loss(wrong):
    v = gate(wrong, "eval_wrong")
    g = v.check("gradref")  # gradref computes the held-out loss at the fleet's recorded parameters
    assert g.reason.startswith("the logged eval loss is wrong: at step 5"), g.reason  # its row: gradref alone fails


def _blames_the_first_failing_check(v, name: str = "gradient"):
    check, curve = v.check(name), v.check("curve")
    assert not v.passed and not check.passed and check.first_step == STALE_STEP, _failed(v)
    assert not curve.passed, curve.reason  # the fault moves the curve too ...
    # ... and the summary names the check that failed there, not round-off or a flip
    assert "round-off" not in curve.summary and "routing flip" not in curve.summary, curve.summary
    assert f"first failing check: {name} at step {STALE_STEP}" in curve.summary, curve.summary


def test_a_rank_computing_on_the_previous_steps_weights_is_not_excused_as_round_off(wrong):
    v = gate(wrong, "stale_weights")
    _blames_the_first_failing_check(v)


def test_an_fsdp_shard_keeping_last_steps_gradient_is_not_excused_as_round_off(wrong):
    _blames_the_first_failing_check(gate(wrong, "fsdp_stale_shard"))


def test_the_bf16_floor_runs_round_gradients_as_the_wire_does():
    """round_like_wire: bfloat16 values, unbiased, off by at most one bf16 ulp
    plus the summands' dither u m; the cancelling draw reads elements below
    W u m as zero."""
    import torch

    from dormouse.gate.record.modes import round_like_wire

    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 1e-3
    m = 2.0**-8 * x.abs().mean()
    y = x.clone()
    round_like_wire([y], seed=0)
    assert torch.equal(y, y.bfloat16().float())  # every element a bfloat16 value
    assert ((y - x).abs() <= 2.0**-7 * (x.abs() + m) + m).all()
    err = (y - x).double()
    assert abs(float(err.mean())) < 5 * float(err.std()) / len(err) ** 0.5  # unbiased
    other = x.clone()
    round_like_wire([other], seed=1)
    assert not torch.equal(other, y)  # independent draws
    z = x.clone()
    round_like_wire([z], seed=2, cancel=2.0)
    small = x.abs() < 2 * m
    assert small.any() and (z[small] == 0).all() and (z[~small] != 0).all()
