"""The judge's cause-naming and non-finite rules (dormouse/gate/judge/causes.py,
finite.py) on synthetic numbers, each against a figure worked out here by
hand: the count a scalar implies and the known count it is, gradients never
all-reduced, the bfloat16 grid, a NaN's description."""

from __future__ import annotations

import math

import pytest
import torch

from dormouse.gate.judge import causes as C
from dormouse.gate.judge.facts.finite import describe
from dormouse.gate.judge.metrics import rel


def _targets(lengths: list[int], t: int) -> torch.Tensor:
    """Rows right-padded to t: token 1 where the row is, -100 on its padding."""
    y = torch.full((len(lengths), t), -100)
    for i, n in enumerate(lengths):
        y[i, :n] = 1
    return y


# two ranks, one micro-batch each at a step: rank 0 rows of 3 and 5 tokens in T = 5, rank 1 rows of 4 and 4 in T = 4
BATCHES = [(0, _targets([3, 5], 5)), (1, _targets([4, 4], 4))]


def test_step_counts_are_the_counts_a_loop_may_divide_by():
    c = C.step_counts(BATCHES, world=2, micro=1, micro_max=1)
    # after the shift: (2 + 4) + (3 + 3) targets; positions after the shift 2 x 4 + 2 x 3; before it 8 + 8
    assert c == {"targets": 12, "padding": 14, "unshifted": 16, "every_pos": 18, "rank 0": 12, "rank 1": 12}
    short = C.step_counts(BATCHES, world=2, micro=2, micro_max=3)
    assert short["short step"] == 12 * 3 / 2


@pytest.mark.parametrize("loop_count,name", [(14, "padding"), (16, "unshifted"), (18, "every_pos")])
def test_the_implied_count_names_the_count_the_loop_divided_by(loop_count, name):
    counts = C.step_counts(BATCHES, world=2, micro=1, micro_max=1)
    scalar = counts["targets"] / loop_count  # g_fleet = (N / N') g
    assert C.name_count([counts["targets"] / scalar], [counts], rtol=1e-5) == name


def test_one_ranks_count_is_named_with_its_rank_and_a_count_nobody_knows_is_not():
    a = C.step_counts([(0, _targets([3, 5], 5)), (1, _targets([2, 2], 4))], world=2, micro=1, micro_max=1)
    assert a["rank 0"] == 12 and a["rank 1"] == 4  # 2 x (2 + 4), 2 x (1 + 1)
    assert C.name_count([4.0], [a], 1e-5) == "rank 1"
    assert C.name_count([13.0], [a], 1e-5) is None


def test_a_short_step_still_divided_by_k_is_named_across_steps():
    full = C.step_counts(BATCHES, world=2, micro=3, micro_max=3)
    short = C.step_counts(BATCHES, world=2, micro=2, micro_max=3)
    implied = [full["targets"], short["targets"] * 3 / 2]  # the full step right, the short one over K / K_k
    assert C.name_count(implied, [full, short], 1e-5) == "short step"
    fits = [(1, 1.0, 0.0), (2, 2 / 3, 0.0)]
    text = C.describe_scalars(fits, [full, short], 1e-5)
    assert "1, 0.6667 at steps 1, 2" in text and "by 12, 18 where the steps hold 12, 12 targets" in text
    assert "a short last step still divided by K" in text


def test_a_per_step_scalar_needs_every_fit_exact_and_one_away_from_one():
    assert C.per_step_scalar([(1, 0.8, 1e-7), (2, 0.9, 1e-7)], bound=1e-5, away=1e-4)
    assert not C.per_step_scalar([(1, 0.8, 1e-7), (2, 0.9, 1e-3)], bound=1e-5, away=1e-4)  # step 2 not a scalar
    assert not C.per_step_scalar([(1, 1.0, 0.0), (2, 1.0 + 1e-6, 0.0)], bound=1e-5, away=1e-4)  # no factor
    assert not C.per_step_scalar([(1, math.nan, 0.0)], bound=1e-5, away=1e-4)


def test_gradients_never_all_reduced_are_each_ranks_own_with_the_right_mean():
    g = torch.Generator().manual_seed(0)
    own = [{"w": torch.randn(5, generator=g)} for _ in range(2)]  # each rank's local gradient
    mean = {"w": (own[0]["w"] + own[1]["w"]) / 2}  # one process's: their mean (equal counts)
    found = C.never_reduced(own, mean, rel, 1e-5)
    assert found is not None and found[0] > 0.1 and found[1] < 1e-6  # float32 round-off of the mean
    assert C.never_reduced([mean, mean], mean, rel, 1e-5) is None  # reduced: equal on every rank
    assert C.never_reduced(own, {"w": mean["w"] * 1.1}, rel, 1e-5) is None  # apart, but not around one process


def test_the_bfloat16_grid():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    assert C.bf16_representable({"a": x.bfloat16().float()})
    assert not C.bf16_representable({"a": x})
    assert not C.bf16_representable({})


def test_describe_names_nan_and_inf_with_their_count():
    assert describe(torch.tensor([1.0, math.nan, math.inf, 2.0])) == "NaN and inf (2 of 4 elements)"
    assert describe(torch.tensor([1.0, 2.0])) is None
    assert describe(torch.tensor([1, 2])) is None  # integers hold no NaN
    assert rel({"a": torch.tensor([math.nan])}, {"a": torch.tensor([1.0])}) == math.inf  # above every bound


def test_the_last_micro_batch_weighted_apart_is_fitted_and_named_by_its_weight():
    gen = torch.Generator().manual_seed(1)
    others, last = {"w": torch.randn(50, generator=gen)}, {"w": torch.randn(50, generator=gen)}
    g = {"w": others["w"] + last["w"]}  # one process: every micro-batch at weight 1
    counts = [{"targets": 40.0}, {"targets": 30.0}]
    for weight, words in ((1 / 3, "the loss divided by K twice on the last micro-batch (K = 3"),
                          (0.0, "last micro-batch's loss was never backpropagated"), (3.0, "not divided by K = 3 where the others")):
        fleet = {"w": others["w"] + weight * last["w"]}
        a, ratio, res = C.last_micro_fit(fleet, g, last, ["w"])
        assert a == pytest.approx(1, abs=1e-6) and ratio == pytest.approx(weight, abs=1e-6) and res < 1e-6  # float32 inputs
        fits = [(1, a, ratio, res), (2, a, ratio, res)]
        assert C.last_micro_weighted(fits, bound=1e-5, away=1e-4)
        text = C.describe_last(fits, [3, 3], counts, 1e-5)
        assert words in text, text
        if weight:  # the count the last micro-batch's loss sum was divided by: the step's targets / its weight
            assert f"divided by {40 / weight:.6g}, {30 / weight:.6g} where the steps hold 40, 30 targets" in text
    noisy = {"w": others["w"] + last["w"] / 3 + 0.01 * torch.randn(50, generator=gen)}  # not of that form
    assert not C.last_micro_weighted([(1, *C.last_micro_fit(noisy, g, last, ["w"]))], bound=1e-5, away=1e-4)
    assert not C.last_micro_weighted([(1, 1.0, 1.0, 0.0)], bound=1e-5, away=1e-4)  # weight 1: nothing apart
