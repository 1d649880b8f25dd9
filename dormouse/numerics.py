"""Facts of floating-point arithmetic every layer may use, and the one
relative difference of a tensor from another (the floors the running side
measures and the judge's comparisons of them use the same; no rule of the
gate lives here: its bounds are gate/judge/bounds.py)."""

from __future__ import annotations

import torch

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significand bits: round-to-nearest is within 2^-8 relative
FP32_UNIT_ROUNDOFF = 2.0 ** -24  # float32: 24 significand bits


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
