"""The exact reduce's one summation order, shared by the single process and the fleet.

A step's global batch is cut into N slices (micro-batches of train.micro_batch
windows), numbered in rank order: rank r's slices follow every slice of the
ranks before it. Slice i backpropagates L_i t_i / T into a buffer of its own,
g_i, and the step's gradient is

    g = tree_sum(g_0, ..., g_{N-1})

the fixed pairwise tree over the slice index: level by level, (g_0 + g_1),
(g_2 + g_3), ..., an odd last term carried up unchanged, until one term is
left. The tree is a function of N alone, so the float32 result (and the
float64 loss and expert loads, summed by the same tree) is bitwise the same
whoever computed which slice and whatever algorithm moved the bytes: one
process, 2 ranks or 4 ranks over the same global batch and micro_batch train
bitwise the same network. Autograd would instead accumulate a process's
slices as a left chain ((g_0 + g_1) + g_2) + g_3, whose grouping depends on
how many slices each process holds: that is why each slice's gradient is
taken out of p.grad (`take_grads`) before the next slice's backward.
"""

from __future__ import annotations

import torch


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum x over dim 0 by the fixed pairwise tree: (x0+x1), (x2+x3), ...,
    an odd last row carried up, level by level. Elementwise, so any slicing of
    the other dims (a chunk of the vector) sums identically."""
    if x.shape[0] == 0:
        raise ValueError("tree_sum of no slices: a step has at least one slice")
    while x.shape[0] > 1:
        n = x.shape[0]
        pairs = x[0:n - 1:2] + x[1:n:2]
        x = torch.cat([pairs, x[n - 1:]]) if n % 2 else pairs
    return x[0]


def flat_grads(params: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The parameters' gradients as one `dtype` vector (a missing one is zeros)."""
    return torch.cat([p.grad.reshape(-1).to(dtype) if p.grad is not None
                      else torch.zeros(p.numel(), dtype=dtype, device=p.device)
                      for p in params])


def take_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """One slice's gradients as a float32 vector of its own, leaving p.grad
    empty so the next slice's backward starts from nothing (no left chain)."""
    flat = flat_grads(params)
    for p in params:
        p.grad = None
    return flat


def put_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write the vector `flat` (flat_grads' layout) back as the parameters' gradients."""
    offset = 0
    for p in params:
        g = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
        offset += p.numel()
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


def stats_row(loss_part: torch.Tensor, loads: torch.Tensor) -> torch.Tensor:
    """One slice's float64 row [t_i L_i / T, loads_i...]: what the tree sums for
    the logged loss and the expert loads."""
    return torch.cat([loss_part.reshape(1).double(), loads.reshape(-1).double().to(loss_part.device)])


def split_stats(total: torch.Tensor, loads: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(loss, loads) from a summed stats row, loads in the shape and dtype of `loads`."""
    return float(total[0]), total[1:].view_as(loads).to(loads.dtype)
