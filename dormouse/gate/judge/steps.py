"""Per-step arithmetic of the judge over stacked traces."""

from __future__ import annotations

import torch


def routing_flips(single_topk: torch.Tensor, fleet_topk: torch.Tensor) -> torch.Tensor:
    """Tokens whose set of chosen experts differs, per step and iteration:
    (steps, max_iter). Both (steps, B, T, I, k); the fleet's ranks concatenated
    along B in rank order, which is the single process's window order."""
    a = single_topk.sort(dim=-1).values
    b = fleet_topk.sort(dim=-1).values
    differs = (a != b).any(dim=-1)  # (steps, B, T, I)
    return differs.sum(dim=(1, 2))
