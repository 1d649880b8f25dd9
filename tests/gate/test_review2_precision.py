"""Reviewer 2's attacks on the reduced-precision gate (bf16/fp16 autocast),
real runs of tests/support/ddp_loop.py (2 gloo ranks, GA 3, 3 steps). Each
xfail(strict) test states what the gate SHOULD say and fails today; it turns
into an XPASS (an error, strict) when the bug is fixed. Figures measured at
commit 4653309 are in each test's comment."""

from __future__ import annotations

import looprec
import pytest
from looprec import failing, launch

AC = {"seed": 8, "autocast": True}
RUNS = {
    "clean": AC,
    "fp16": {**AC, "ac_dtype": "float16"},
    # the loop's cross-entropy outside the autocast, on the forward's bfloat16 logits (a common pattern:
    # `with autocast: logits = model(x)` then `loss = F.cross_entropy(logits, y)`)
    "loss_outside": {**AC, "loss_outside": True},
    # a model with no submodules whose forward accelerate-style enters autocast: the Recorder misses it
    "flat_patch": {"seed": 8, "model": {"kind": "flat"}, "patch_forward": True},
    # a model whose gradient carries 300 x the bfloat16 round-off: the floor and bound grow without limit
    "amp_comp_twice": {**AC, "model": {"kind": "amp", "amp": 300.0}, "fault": "comp_twice"},
    # autocast at step 1 only; rank 1's loss x 1.02 at every step (steps 2 and 3 in float32)
    "ac1_eps02": {**AC, "ac_steps": [1], "fault": "rank1_eps", "eps": 0.02},
    # run mode (every 2, no sketch) under autocast, clean
    "every2": {**AC, "every": 2, "steps": 4},
    # one row of tok.weight's gradient doubled after the all-reduce
    "row_x2": {**AC, "fault": "row_x2"},
}


@pytest.fixture(scope="module")
def recs(tmp_path_factory):
    root = tmp_path_factory.mktemp("review2")
    launch([{"steps": 3, **cfg, "out": str(root / name)} for name, cfg in RUNS.items()], root)
    return {name: root / name for name in RUNS}


def test_controls_clean_bf16_and_fp16_pass(recs):
    # clean 3.5e-3 against 3.4e-2 (floor 3.4e-3); fp16 4.1e-4 against 4.2e-3
    for name in ("clean", "fp16"):
        v = looprec.verdict(recs[name])
        assert v.passed, failing(v)


@pytest.mark.xfail(strict=True, reason="loss_floor is measured under autocast, where cross_entropy upcasts: "
                                       "a bf16 loss computed outside autocast fails at 1e-5 (worst 2.5e-3)")
def test_a_clean_loop_computing_its_loss_outside_autocast_passes(recs):
    v = looprec.verdict(recs["loss_outside"])
    assert v.passed, failing(v)


@pytest.mark.xfail(strict=True, reason="no submodule pre-hook fires inside the patched forward: autocast not "
                                       "recorded, float32 reference, clean run fails gradient 1.0e-2 vs 1e-5")
def test_a_flat_model_whose_forward_enters_autocast_passes(recs):
    v = looprec.verdict(recs["flat_patch"])
    assert v.passed, failing(v)


@pytest.mark.xfail(strict=True, reason="no cap on the precision floor: floor 0.72, bound 7.2, a doubled "
                                       "gradient (error 1.5) passes every check")
def test_a_doubled_gradient_fails_however_large_the_floor(recs):
    assert not looprec.verdict(recs["amp_comp_twice"]).passed


@pytest.mark.xfail(strict=True, reason="the largest floor of the recording bounds every step: the float32 "
                                       "steps 2-3 are held to 3.3e-2, a 1.4e-2 fault passes (fails at 1e-5 "
                                       "without the bf16 step)")
def test_float32_steps_keep_the_float32_bound(recs):
    looprec.fails_for(looprec.verdict(recs["ac1_eps02"]), "gradient", "differs")


@pytest.mark.xfail(strict=True, reason="run mode's replay bound is 10 x the float32 one-ulp floor, not widened "
                                       "by the precision floor: tok.weight 4.2e-4, 11 x its bound")
def test_a_clean_every_k_recording_under_autocast_passes(recs):
    v = looprec.verdict(recs["every2"])
    assert v.passed, failing(v)


@pytest.mark.xfail(strict=True, reason="replay mode compares all tensors as one vector: one embedding row "
                                       "doubled is 1.0e-2 of the whole, under the 3.4e-2 bound")
def test_one_row_doubled_fails_under_autocast(recs):
    assert not looprec.verdict(recs["row_x2"]).passed
