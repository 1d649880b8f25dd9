"""The clip coefficient, typed once: the factor gradient clipping multiplies
every gradient by, as torch.nn.utils.clip_grad_norm_ computes it. The loop
clips with it, the gate's recording and references work out what a loop
clipped by with it, and the recording reader checks a recording's max_grad_norm by it
(a base module: every layer may use it)."""

from __future__ import annotations

import torch

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def clip_coef(max_norm: float, norm):
    """min(1, max_norm / (norm + 1e-6)); `norm` a float (gives a float) or a
    tensor (gives a tensor, clamped as torch.nn.utils.clip_grad_norm_ clamps
    it, so that the scaled gradients are bitwise torch's)."""
    coef = max_norm / (norm + CLIP_EPS)
    if isinstance(coef, torch.Tensor):
        return torch.clamp(coef, max=1.0)
    return min(1.0, coef)
