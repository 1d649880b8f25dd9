"""Reading a model's tensors the same way everywhere: plain CPU copies and a
fingerprint, whether the tensors are ordinary or FSDP2 DTensor shards."""

from __future__ import annotations

import hashlib

import torch


def plain(t: torch.Tensor, *, gather: bool = False) -> torch.Tensor:
    """A plain contiguous CPU tensor. A DTensor is gathered whole when `gather`
    (a COLLECTIVE: every rank must call this in the same order) or else read as
    this rank's local shard."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor() if gather else t.to_local()
    return t.cpu().contiguous()


def named_state(model: torch.nn.Module, *, gather: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by name (the routing bias is part
    of the network: two fleets that disagree on it compute different functions)."""
    return {name: plain(t, gather=gather) for name, t in model.state_dict().items()}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor of any dtype (bfloat16 included)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def named_grads(model: torch.nn.Module, *, gather: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (zeros where there is none); after a
    training step these are the gradients the step applied."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = plain(g, gather=gather)
    return out


def rel_per_step(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """max |a_k - b_k| / max |b_k| for each step k of two stacked traces."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    diff = (a - b).abs().amax(dim=1)
    scale = b.abs().amax(dim=1)
    return torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff).tolist()
