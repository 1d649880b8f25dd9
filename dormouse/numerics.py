"""Facts of floating-point arithmetic every layer may use, and the one
relative difference of a tensor from another (the floors the running side
measures and the judge's comparisons of them use the same; no rule of the
gate lives here: its bounds are gate/judge/bounds.py)."""

from __future__ import annotations

import math

import torch

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significand bits: round-to-nearest is within 2^-8 relative
FP32_UNIT_ROUNDOFF = 2.0 ** -24  # float32: 24 significand bits


def same_value(a, b) -> bool:
    """Two plain values (a module attribute on two ranks, or before and after; dicts and lists of them) the
    same: equal and of one type (an int and a float the same number), a NaN the same as a NaN (which is
    never == itself)."""
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    if type(a) is not type(b) and not numbers:  # 1 and 1.0 are one number; True and 1 are not one value
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b or (numbers and math.isnan(a) and math.isnan(b))


def scalar_relative(a: float, b: float, scale: float = 0.0) -> float:
    """|a - b| / |b| of two numbers (a loss against one process's), over `scale` instead where that is
    larger (the magnitude of terms that cancel in b), and over at least 1e-30."""
    return abs(a - b) / max(abs(b), scale, 1e-30)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (max |a - b| where b is all zero): how far a
    tensor is from another, in units of the other's largest element."""
    a, b = a.double(), b.double()
    if not b.numel():
        return 0.0
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def rel_per_step(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """relative(a_k, b_k) for each step k of two stacked series (steps, ...), at once."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    diff = (a - b).abs().amax(dim=1)
    scale = b.abs().amax(dim=1)
    return torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff).tolist()


def sum_squares_roundoff(x: torch.Tensor, lanes: int = 8, delta: float = 1e-6, rows: int = 1 << 20) -> tuple[float, float]:
    """A bound on the rounding error of torch's float32 sum of the squares of
    `x` (the CPU kernel of `torch.linalg.vector_norm`, which clip_grad_norm_
    calls once per tensor): `lanes` accumulators (element i to lane i mod
    lanes), each a sequential float32 sum of its squares, then the lanes
    added. Returns (bound, S): S the exact sum of squares (float64), bound on
    |fl32(S) - S| with probability >= 1 - delta.

    Each addition s + q rounds to within half an ulp of its result, h/2
    (h = ulp32(s + q)), and never by more than q (s itself is a float within q):
      q < h   (the term below an ulp of the lane's running sum: it is dropped,
              or rounded up to h): |e| <= min(q, h/2), summed as they come,
              deterministically (these errors are all of one sign: the bias
              that makes the error grow faster than sqrt(n))
      q >= h  |e| <= h/2, mean zero and independent (round to nearest of a
              term whose bits below h are spread evenly): Hoeffding, with
              probability 1 - delta, |sum e| <= sqrt(ln(2/delta)/2 sum h^2)
    plus (lanes - 1) u S for adding the lanes. Each h is read from the exact
    running sum of its lane (a float64 cumulative sum, `rows` rows at a time):
    the bound follows the data's own distribution of magnitudes, not a worst
    case (n u S, useless past n ~ 1e6) nor a mean-zero model alone (sqrt(n) u
    S, which the dropped terms exceed at n ~ 1e7). Fewer lanes round coarser:
    lanes=8 (torch's AVX2 and default vectors) bounds AVX-512's 16 too."""
    q = x.detach().reshape(-1).float().square()  # each square within u of itself: the bound's (1 + 2u) below
    n = q.numel()
    if n == 0:
        return 0.0, 0.0
    m = -(-n // lanes)
    if m * lanes > n:
        q = torch.cat([q, q.new_zeros(m * lanes - n)])
    q = q.view(m, lanes)
    carry = torch.zeros(lanes, dtype=torch.float64)
    small, spread = 0.0, 0.0
    for a in range(0, m, rows):
        c = q[a:a + rows]
        s = torch.cumsum(c, 0, dtype=torch.float64).add_(carry)  # the lanes' running sums
        carry = s[-1].clone()
        # ulp32(s) = 2^(e - 23) for s's float32 exponent e: its exponent bits, 23 places lower
        bits = (s.float().view(torch.int32) & 0x7F800000) - (23 << 23)
        half = bits.clamp_min(0).view(torch.float32).mul_(0.5)
        low = c < 2 * half
        small += float(torch.where(low, torch.minimum(c, half), 0.0).sum(dtype=torch.float64))
        spread += 4 * float(torch.where(low, 0.0, half).double().square_().sum())
    S = float(carry.sum())
    bound = (small + math.sqrt(math.log(2 / delta) / 2 * spread)) * (1 + 2 * FP32_UNIT_ROUNDOFF) \
        + (lanes + 1) * FP32_UNIT_ROUNDOFF * S  # adding the lanes; each square's own rounding
    return bound, S
