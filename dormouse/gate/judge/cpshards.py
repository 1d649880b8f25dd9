"""A context-parallel group's sequence shards in their declared order ("contiguous" or torch's
"load_balanced" head-tail balancer): cut a global tensor into the ranks' shards and join them back,
as the layout check (facts/layouts.py) and the probe check (facts/probe.py) read them."""

from __future__ import annotations

import torch


def cp_chunks(n: int, order: str) -> list[list[int]]:
    """The chunks of a row's sequence each of a CP group's n ranks holds, in its local order (the judge's own
    reading of the declared order): "contiguous" n chunks, rank i chunk i; "load_balanced" torch's head-tail
    balancer, 2n chunks, rank i chunk i then chunk 2n - 1 - i."""
    return [[i] for i in range(n)] if order == "contiguous" else [[i, 2 * n - 1 - i] for i in range(n)]


def cp_split(t: torch.Tensor, dim: int, n: int, order: str) -> list[torch.Tensor]:
    """The global tensor t cut into the n shards of a CP group, rank by rank, in `order`."""
    held = cp_chunks(n, order)
    chunks = t.chunk(sum(len(h) for h in held), dim)
    return [torch.cat([chunks[c] for c in h], dim) for h in held]


def cp_join(pieces: list[torch.Tensor], dim: int, order: str) -> torch.Tensor | None:
    """The global tensor of a CP group's shards (in its rank order) along `dim`; None when they do not cut."""
    held = cp_chunks(len(pieces), order)
    chunks: dict[int, torch.Tensor] = {}
    for piece, h in zip(pieces, held):
        if piece.shape[dim] % len(h):
            return None
        for c, part in zip(h, piece.chunk(len(h), dim)):
            chunks[c] = part
    return torch.cat([chunks[c] for c in sorted(chunks)], dim)
