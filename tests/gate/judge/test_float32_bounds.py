"""The float32 bounds are derived from the arithmetic they bound (bounds.py):
torch's float32 norm of n elements (what clip_grad_norm_ computes) stays within
norm_rtol at sizes where a fixed bound fails, and the bound is still tight
enough that a norm off by 1e-3 fails; each checked against the test's own
float64 sum of the same squares."""

from __future__ import annotations

import math

import pytest
import torch

from dormouse.gate.judge import bounds
from dormouse.numerics import FP32_UNIT_ROUNDOFF


def _data(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if kind == "lognormal":  # a few large elements carry the sum
        return (torch.randn(n, generator=g) * 3).exp() * x.sign()
    if kind == "small":  # most elements far below the mean square (a softmax's gradient)
        return x * torch.rand(n, generator=g) ** 8
    return x


@pytest.mark.parametrize("kind, n", [("normal", 10**6), ("small", 10**6), ("normal", 4 * 10**6),
                                     ("small", 4 * 10**6), ("lognormal", 10**7)])
def test_torch_float32_norm_stays_within_the_derived_bound_and_a_1e_3_fault_does_not(kind, n):
    x = _data(kind, n)
    exact = math.sqrt(float(x.double().square().sum()))  # the test's own float64 sum
    got = float(torch.linalg.vector_norm(x))  # torch's float32 arithmetic, as clip_grad_norm_ calls it
    bound = bounds.norm_rtol({"x": x})
    off = abs(got - exact) / exact
    assert off <= bound, (off, bound)
    assert bound < 1e-3 and abs(got * 1.001 - exact) / exact > bound, bound
    # a fixed sqrt(n) u model alone is below torch's own error at this size where the data has a bias
    # (terms under an ulp of their lane's running sum are dropped): the bound must not be one
    if kind == "small" and n >= 4 * 10**6:
        assert off > math.sqrt(n) * FP32_UNIT_ROUNDOFF


def test_the_gradient_bound_grows_with_its_summands_and_dot_length_and_fails_a_one_rank_fault():
    small = bounds.grad_rtol({"sum_terms": 2, "partials": 1.0, "dot_length": 64})
    wide = bounds.grad_rtol({"sum_terms": 2, "partials": 1.0, "dot_length": 50257})
    many = bounds.grad_rtol({"sum_terms": 64, "partials": 4.0, "dot_length": 64})
    assert small < wide and small < many
    u = FP32_UNIT_ROUNDOFF
    assert wide == pytest.approx(3 * u + bounds.LAMBDA * u * math.sqrt(50257))
    # x 1.001 on one of two ranks moves the mean by 5e-4: far above the bound at GPT-2's vocabulary
    assert 5e-4 > 5 * wide
    assert bounds.grad_rtol({}) == bounds.GRAD_RTOL  # no figures of the arithmetic: the fixed bound
    # data parallelism (products not split): the kernel term averages over the elements of the L2 norm. A
    # review's DDP loop (3.1M parameters, a 32k vocabulary, 2 ranks x 2 micro-batches) departed 4e-8 clean and
    # 4.55e-5 with rank 1's loss x 1.00007 at one step (its own plain-PyTorch figure); with LAMBDA's tail the
    # bound was 5.8e-5 and passed it
    dp = bounds.grad_rtol({"sum_terms": 4, "partials": 1.0, "dot_length": 32000, "elements": 3_100_000,
                           "split_products": False})
    split = bounds.grad_rtol({"sum_terms": 4, "partials": 1.0, "dot_length": 32000, "elements": 3_100_000,
                              "split_products": True})
    assert 4e-8 * 100 < dp < 4.55e-5 / 3 < split
