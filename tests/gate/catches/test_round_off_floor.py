"""A clean fleet whose network amplifies float32 round-off passes within ten
times its measured normalisation floor, and a fault far above that floor
still fails.

The fleet is dormouse's own: AdamW at lr 0.1 for 30 steps, which collapses
the tiny network towards near-uniform predictions, so per-token gradients
cancel. The loop normalises each slice's loss before the backward (its mean
times its share of the step's tokens). The reference sums the loss and
divides the gradient after it. In float32 the two part by round-off that
reached 2e-4 here, and a fixed 1e-5 bound failed this right fleet. The
reference measures that round-off as "normalisation_floor": the same
gradient through the loss / 3 against it.

The floor is confirmed by the test's own arithmetic, which shares no code
with the gate's judge. It rebuilds the model at the recorded parameters of
the worst step and differentiates the recorded rows two ways with plain
torch: the loop's way and the reference's. Those two differ by about what
separates the fleet from the reference, while the fleet equals the loop's
way far more closely."""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

import pytest
import torch.nn.functional as F
from gatekit import copy_of, edit_json, edit_tensors
from safetensors.torch import load_file

from dormouse.gate import artifacts as A
from dormouse.gate import pipeline, settings
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.entry import judge


@pytest.fixture(scope="module")
def high_lr(tmp_path_factory) -> Path:
    s = settings.check(out=str(tmp_path_factory.mktemp("roundoff") / "g"), opt="adamw", lr=0.1, steps=30, seed=41)
    pipeline.gate(s, log=lambda line: None)
    return s.out_dir


def l2(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every tensor of b, in float64."""
    num = sum(float((a[n].double() - b[n].double()).norm()) ** 2 for n in b)
    return math.sqrt(num) / math.sqrt(sum(float(b[n].double().norm()) ** 2 for n in b))


def two_ways(out: Path, k: int) -> tuple[dict, dict]:
    """The gradient of step k's recorded rows at its recorded parameters: (the loop's way, each micro-batch's
    mean loss times its share of the step's tokens, then backward; the reference's way, the summed loss, backward,
    then / the count)."""
    from dormouse.gate.record.dormouse_loop import build_model

    meta = json.loads(A.recording_path(out).read_text())
    first = load_file(str(A.step_tensors_path(out, 0, k)))
    state = {n[2:]: v for n, v in first.items() if n.startswith(("p/", "b/"))}
    rows = []
    for f in sorted(glob.glob(str(out / "rank*" / f"step{k:06d}.safetensors"))):
        t = load_file(f)
        rows += [(t[f"in/{i}/arg0"], t[f"in/{i}/arg1"])
                 for i in sorted({n.split("/")[1] for n in t if n.startswith("in/")}, key=int)]
    total = sum(y.numel() for _, y in rows)
    ways = []
    for loop_way in (True, False):
        model = build_model(**meta["build_kwargs"])
        model.load_state_dict(state, strict=False)
        model.train()
        for x, y in rows:
            logits, loss, _ = model(x, y)
            if loop_way:
                (loss * (y.numel() / total)).backward()
            else:
                F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").backward()
        g = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
        ways.append(g if loop_way else {n: v / total for n, v in g.items()})
    return ways[0], ways[1]


def test_a_right_fleet_past_the_fixed_bound_passes_within_its_measured_normalisation_floor(high_lr):
    v = judge(high_lr)
    g = v.check("gradient")
    assert v.passed, [(c.name, c.reason) for c in v.checks if not c.passed]
    assert g.worst > 1e-5, g.reason  # the fixed float32 bound alone would fail this right fleet
    assert "float32 normalisation floor" in g.reason, g.reason
    ref = ReferenceSet(high_lr)
    assert ref.info(1)["normalisation_floor"] < 1e-6  # before the collapse the float32 bound stands (10 x < 1e-5)
    assert ref.info(g.worst_step)["normalisation_floor"] > 1e-5


def test_the_floor_is_where_the_loss_is_normalised_by_the_tests_own_arithmetic(high_lr):
    k = judge(high_lr).check("gradient").worst_step
    loop_way, ref_way = two_ways(high_lr, k)
    m = json.loads(A.step_meta_path(high_lr, 0, k).read_text())
    coef = m.get("clip_coef") if m.get("clipped") else 1.0
    fleet = {n[2:]: v.double() / coef for n, v in load_file(str(A.step_tensors_path(high_lr, 0, k))).items()
             if n.startswith("g/")}
    one = {n[2:]: v for n, v in load_file(str(A.reference_step_tensors_path(high_lr, k))).items() if n.startswith("g/")}
    apart = l2(fleet, one)  # what the gradient check measured
    assert apart > 1e-5
    assert l2(ref_way, one) < 0.05 * apart  # the test's reference way is the reference's
    assert l2(loop_way, ref_way) > 0.3 * apart  # the two ways part by the same order as the fleet and reference
    assert l2(fleet, loop_way) < 0.3 * apart  # the fleet is the loop's way, closer than to the reference's


def test_a_fault_far_above_the_floor_still_fails(high_lr, tmp_path):
    out = copy_of(high_lr, tmp_path / "g")
    k = judge(high_lr).check("gradient").worst_step
    world = A.RecordingSet(out).world_at(k)
    def scale(t):
        for n in t:
            if n.startswith("g/"):
                t[n] *= 1.05

    for r in range(world):  # every rank's recorded gradient at step k x 1.05 (the ranks still agree)
        edit_tensors(A.step_tensors_path(out, r, k), scale)
    g = judge(out).check("gradient")
    assert not g.passed and g.first_step == k and g.worst > g.bound, g.reason
    bound = 10 * ReferenceSet(out).info(k)["normalisation_floor"]
    assert g.worst > 5 * bound  # far above the measured floor's bound


def test_a_floor_past_the_cap_is_not_judged_naming_the_float32_floor(high_lr, tmp_path):
    """A float32 step whose normalisation floor is past PRECISION_CAP / 10: the gradient is not judged (a
    fault that size would pass as round-off), and the verdict says it is the float32 floor, not reduced
    precision."""
    out = copy_of(high_lr, tmp_path / "g")
    edit_json(A.reference_step_meta_path(out, 7), lambda d: d.update(normalisation_floor=0.02))  # 10 x > 0.1
    g = judge(out).check("gradient")
    assert not g.passed and g.first_step == 7, g.reason
    assert g.reason.startswith("not judged: at step 7 the float32 normalisation floor is 0.02"), g.reason
    assert "gate it at a lower learning rate" in g.reason and "reduced precision" not in g.reason, g.reason
