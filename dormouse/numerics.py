"""Facts of floating-point arithmetic every layer may use, and the one
per-step relative difference of two stacked traces (no rule of the gate
lives here: its bounds are gate/judge/bounds.py)."""

from __future__ import annotations

import torch

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significand bits: round-to-nearest is within 2^-8 relative
FP32_UNIT_ROUNDOFF = 2.0 ** -24  # float32: 24 significand bits


def rel_per_step(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """max |a_k - b_k| / max |b_k| for each step k of two stacked traces."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    diff = (a - b).abs().amax(dim=1)
    scale = b.abs().amax(dim=1)
    return torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff).tolist()
