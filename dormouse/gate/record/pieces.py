"""This rank's piece of a tensor as the Recorder stores it: a copy on the CPU
(a DTensor's local shard), a view for the sketches, and a DTensor's placement
(FSDP2's Shard(dim) and the global shape) for init.safetensors' metadata."""

from __future__ import annotations

import torch

from dormouse.gate.record.options import RecorderError


def local(t: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """This rank's part of t on the CPU, always a copy: the digest's .numpy()
    marks a storage non-resizable, and FSDP2 resizes the storage of its
    unsharded parameters (a live one, after a no-grad forward at world 1)."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    out = t.cpu().contiguous()
    return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out


def shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t as it is (a view: a DTensor's local shard), for
    sketching, which reads it once into a copy of its own."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def placement(t) -> dict | None:
    """Shard(dim) and the global shape of a DTensor (None for a plain tensor)."""
    if not hasattr(t, "placements"):
        return None
    from torch.distributed.tensor import Replicate, Shard

    shards = [p for p in t.placements if isinstance(p, Shard)]
    if any(not isinstance(p, (Shard, Replicate)) for p in t.placements) or len(shards) > 1:
        raise RecorderError(f"placements {t.placements} are not supported: the Recorder records FSDP2's Shard(0)")
    if not shards:
        return None
    return {"dim": shards[0].dim, "shape": list(t.shape)}
