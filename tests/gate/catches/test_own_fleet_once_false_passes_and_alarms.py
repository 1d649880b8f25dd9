"""A skeptical review's attacks, kept as tests: wrong fleets that once PASSED
the gate (false passes) and clean fleets that once FAILED it (false alarms),
found by planting fleet_faults.py's "review attacks" in real gloo fleets.
Each now fails (or passes) for its reason; the one the gate still cannot see
is marked xfail(strict) with the limit it shows.

Root causes (fixed: the judge's `config` check, the final parameters in the
recording the replay judges, a floor run nudging gradients by an ulp of their
tensor's magnitude):
- the replay builds its run from the config the FLEET recorded
  (RunConfig.from_dict(rank0.json["config"])), and nothing compares that
  config with the one the settings give (make_run(s)): a fleet at the wrong
  lr / schedule / clip is replayed at its own wrong lr and matches bitwise.
  Only the curve's tensor floor can see it, and the curve is absent for
  mixed window lengths and judges losses only under the bf16 wire (or when
  the fleet's own config says ns_dtype bfloat16 / bf16 model).
- the fleet's final tensors were compared only with each other, never with
  the per-step parameters that the replay and the curve judge (now the
  recording's final parameters are the replay's last step).
"""

from __future__ import annotations

import pytest

# outside CI's time (run them with `pytest -m slow`): a past review's own-trainer fleets; the own trainer's faults and clean runs stay in CI (test_own_fleet_faults.py)
pytestmark = pytest.mark.slow

from dormouse.gate.settings import GateSettings
from dormouse.gate.judge.entry import judge
from gatekit import faulty_fleets, references

FALSE_PASSES = {
    # fleet trains at 1.5 x lr (recorded in its config); no single process for mixed lengths
    "lr_x1_5_mixed": ("lr_x1_5", {"profile": "4x32,2x64", "resume_world": 0}),
    # fleet's cosine ends at min_lr_frac 0.9 instead of 0.1; bf16 wire: tensors not judged, loss tol 1e-3
    "lr_last_bf16": ("lr_last_x3", {"reduce": "bf16"}),
    # fleet at 1.5 x lr under the bf16 wire: curve judges the loss only (tolerance 1e-3; measured off 2.5e-4)
    "lr_x1_5_bf16": ("lr_x1_5", {"reduce": "bf16"}),
    # fleet runs Newton-Schulz in bfloat16 (recipe: float32) and records it: the judge then
    # stops judging tensors (judge_tensors reads the FLEET's config); loss within 1e-6
    "ns_bf16": ("ns_bf16", {}),
    # fleet does not clip (recorded in its config); mixed lengths: no curve
    "no_clip_mixed": ("no_clip_mixed", {"profile": "4x32,2x64", "resume_world": 0}),
    # head.weight += 1e-3 in every rank's final model, after the last step was recorded
    "final_tamper": ("final_tamper", {}),
}


# every wrong fleet of this file in ONE torchrun launch (each run with its own
# fault), without the stop-and-resume (no attack here is about the resume)
BIAS = ("bf16_decay_small", {"steps": 10, "reduce": "bf16"})


@pytest.fixture(scope="module")
def review(tmp_path_factory) -> tuple[dict, dict]:
    """Every fleet of this file in one plan: the wrong fleets (each with its
    fault, without the stop-and-resume) and the clean ones of the false alarms
    (no fault; stopped and resumed at one rank): two launches, the first legs
    and the wrong fleets, then the second legs."""
    base = tmp_path_factory.mktemp("review")
    runs = {**FALSE_PASSES, "bias": BIAS}
    plan = {name: GateSettings(out=str(base / name), **{"steps": 6, "resume_world": 0, **extra}).validate()
            for name, (_, extra) in runs.items()}
    clean = {name: GateSettings(out=str(base / name), **extra).validate() for name, extra in FALSE_ALARMS.items()}
    faulty_fleets([(plan[name], fault) for name, (fault, _) in runs.items()] + [(s, None) for s in clean.values()])
    for s in [*plan.values(), *clean.values()]:
        references(s)
    return plan, clean


@pytest.fixture(scope="module")
def wrong(review) -> dict:
    return review[0]


@pytest.mark.parametrize("name", list(FALSE_PASSES))
def test_review_wrong_fleet_fails(wrong, name):
    v = judge(wrong[name].out_dir, wrong[name])
    assert not v.passed, "false pass: " + "; ".join(f"{c.name}: {c.reason}" for c in v.checks)


# A clean fleet (no fault) that FAILS: false alarms. Found in a sweep of 37+
# clean gates (seeds 11-50, lr 1e-3 / 1e-2, profiles 4,2 / 1,5 / 3,3 / 2,1,3,
# FSDP, AdamW, bf16, exact, resume worlds 0-2, 10-20 steps).
FALSE_ALARMS = {
    # curve: block.attn.out leaves its floor at step 1 (2.3e-04 > 1.9e-04: AdamW's first step is
    # ~lr*sign(g), elements with |g| near eps amplify round-off beyond 10x the 3-nudge floor), and
    # the loss leaves the floor at step 16 (3.2e-05 > 1.0e-06)
    "adamw_lr1e-2_20_s47": {"opt": "adamw", "lr": 0.01, "steps": 20, "seed": 47},
    # (seed 47 at the recipe's own lr 1e-3 left the same floor the same way, at step 1: the same
    # finding as lr 1e-2 above, dropped from the suite to keep CI in budget)
    # engram.value leaves its floor at step 1 (3.6e-06 > 1.1e-06)
    "adamw_s50": {"opt": "adamw", "steps": 10, "seed": 50},
    # issue 16: the bf16 wire judged by a fixed 1e-3 on the loss: loss 4.8e-3 off at step 16 (gradref within
    # its bound, replay bitwise); now the curve's floor runs round their gradients as the wire rounds
    "bf16_adamw_lr1e-2_s66": {"reduce": "bf16", "opt": "adamw", "lr": 0.01, "seed": 66},
}


@pytest.fixture(scope="module")
def alarms(review) -> dict:
    return review[1]


@pytest.mark.parametrize("name", list(FALSE_ALARMS))
def test_review_clean_fleet_passes(alarms, name):
    v = judge(alarms[name].out_dir, alarms[name])
    assert v.passed, "false alarm: " + "; ".join(f"{c.name}: {c.reason}" for c in v.checks if not c.passed)


def test_a_decay_folded_into_the_bf16_wires_result_fails_the_gradient_and_the_bias_test(wrong):
    # g += 0.2 W u |g| sign(p) after the bf16 reduce, every step: an extra weight decay near the elementwise
    # bound (once a known limit: the per-element bound alone passed it). Now the element bound, with each
    # rank's contribution as one process computes it, is exceeded (1.2 of it, measured), and the errors are
    # biased along the decay. (Added to each rank's contribution before the wire instead, below half a bf16 ulp
    # of a value already rounded, it vanishes in the rounding: mean 2.5e-4 of the bound along the decay.)
    v = judge(wrong["bias"].out_dir, wrong["bias"])
    g = v.check("gradient")
    assert not v.passed and not g.passed and "the declared bf16 wire's bound" in g.reason, g.reason
    bias = v.check("bias")
    assert not bias.passed and bias.stats["decay"] > 6 and "biased beyond the bf16 wire's rounding" in bias.reason
