"""The judge's measures of difference. Two, for two questions: `relative`
(dormouse.numerics: one tensor's max |a - b| / max |b|, what the floors are
measured in: the curve's tensors against their floors, a rank's tensors apart)
and `rel` (a whole gradient's ||a - b|| / ||b||, every tensor as one vector:
what a gradient is bounded and fitted by, where a fault in one tensor shows in
proportion to its share). Beside them ulps, a least-squares fit and the named
constant factor it may be.
"""

from __future__ import annotations

import math

import torch

from dormouse.gate.judge.bounds import FACTOR_RTOL
from dormouse.numerics import relative  # noqa: F401  (the judge's, re-exported)


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest number of representable floats between a and b, element by
    element (float32; float64 for float64 inputs): 1 for float neighbours."""
    dtype, itype = (torch.float64, torch.int64) if torch.float64 in (a.dtype, b.dtype) else (torch.float32, torch.int32)

    def ordered(x):  # the bit patterns, made monotone in the value
        i = x.to(dtype).contiguous().view(itype).to(torch.int64)
        if itype == torch.int32:
            return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
        return torch.where(i < 0, -(i & 0x7FFFFFFFFFFFFFFF), i)

    return float((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0.0



def running_max(xs: list[float]) -> list[float]:
    out, top = [], 0.0
    for x in xs:
        top = max(top, x)
        out.append(top)
    return out



def first_difference(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> tuple[str, int, float] | None:
    """The first (tensor, flat element, ulps) that differs, or None."""
    for name, x, y in pairs:
        if not torch.equal(x, y):
            flat = (x.reshape(-1) != y.reshape(-1)).nonzero()
            i = int(flat[0]) if len(flat) else 0
            return name, i, ulps(x.reshape(-1)[i:i + 1], y.reshape(-1)[i:i + 1])
    return None



def _sq(x: torch.Tensor) -> float:
    """sum x_i^2 in float64, one pass (a dot product: no squared copy)."""
    x = x.double().reshape(-1)
    return float(torch.dot(x, x))


def norm(d: dict[str, torch.Tensor], names) -> float:
    return math.sqrt(sum(_sq(d[n]) for n in names))



def dot(a, b, names) -> float:
    return sum(float(torch.dot(a[n].double().reshape(-1), b[n].double().reshape(-1))) for n in names)



def rel(a: dict, b: dict, names=None) -> float:
    """||a - b|| / ||b|| over the tensors `names` (all of b's) taken as one vector."""
    names = sorted(b) if names is None else names
    den = norm(b, names)
    num = math.sqrt(sum(_sq(a[n].double() - b[n].double()) for n in names))
    x = num / den if den > 0 else num
    return x if math.isfinite(x) else math.inf  # NaN compares false with every bound: above all of them



def parts(a: dict, b: dict, names) -> dict[str, tuple[float, float, float]]:
    """Per tensor n, in one pass over a[n] and b[n]: (||a - b||^2, ||b||^2, a.b),
    each summed exactly as rel, norm and dot sum it (so rel_of gives rel's
    figures to the last bit, and dd / bb fit's c, without reading the tensors again)."""
    out = {}
    for n in names:
        x, y = a[n].double().reshape(-1), b[n].double().reshape(-1)
        out[n] = (_sq(x - y), float(torch.dot(y, y)), float(torch.dot(x, y)))
    return out


def rel_of(p: dict, names) -> float:
    """rel(a, b, names) from parts(a, b, ...): the same sums in the same order."""
    den = math.sqrt(sum(p[n][1] for n in names))
    num = math.sqrt(sum(p[n][0] for n in names))
    x = num / den if den > 0 else num
    return x if math.isfinite(x) else math.inf


def fit_c(p: dict, names) -> float:
    """fit(a, b, names)[0] from parts(a, b, ...) (the residual not computed)."""
    bb = sum(p[n][1] for n in names)
    return sum(p[n][2] for n in names) / bb if bb > 0 else 0.0


def fit(a: dict, b: dict, names) -> tuple[float, float]:
    """The c minimising ||a - c b|| and the residual ||a - c b|| / ||c b||."""
    bb = dot(b, b, names)
    c = dot(a, b, names) / bb if bb > 0 else 0.0
    if not c:
        return c, math.inf
    # rel(a, c b) tensor by tensor, c b never held whole (a gradient of 124M parameters in float64 is 1 GB)
    num = math.sqrt(sum(_sq(a[n].double() - b[n].double() * c) for n in names))
    den = abs(c) * math.sqrt(bb)
    x = num / den if den > 0 else num
    return c, (x if math.isfinite(x) else math.inf)



def factor_name(c: float, world: int, micro: int, rtol: float = FACTOR_RTOL) -> str | None:
    """W, K, 1/W, ... : the named constant c is, within rtol (None if none fits)."""
    W, K = world, micro
    cands = [("W", W), ("1/W", 1 / W), ("K", K), ("1/K", 1 / K), ("W·K", W * K), ("1/(W·K)", 1 / (W * K)),
             ("W/K", W / K), ("K/W", K / W), ("W²", W * W), ("1/W²", 1 / (W * W))]
    names = [n for n, v in cands if v != 1 and abs(c / v - 1) <= rtol]
    return " = ".join(names) if names else None
