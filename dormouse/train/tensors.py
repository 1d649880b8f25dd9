"""Reading a model's tensors the same way everywhere: plain CPU copies and a
fingerprint, whether the tensors are ordinary or FSDP2 DTensor shards."""

from __future__ import annotations

import torch

from dormouse.digest import fingerprint, tensor_bytes  # noqa: F401  (the train side reads them here)


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


def named_grads(model: torch.nn.Module, *, gather: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (zeros where there is none); after a
    training step these are the gradients the step applied."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = plain(g, gather=gather)
    return out


def copy_module(model: torch.nn.Module) -> torch.nn.Module:
    """copy.deepcopy(model), also where the model keeps a tensor of its last forward's graph as a plain
    attribute (an MoE layer's self.aux, a cached activation), which deepcopy refuses ("Only Tensors
    created explicitly by the user (graph leaves) support the deepcopy protocol"): such a tensor is
    copied detached (it is the last forward's output, not part of the model's state)."""
    import copy

    memo: dict[int, object] = {}

    def visit(v, depth: int = 0) -> None:
        if isinstance(v, torch.Tensor):
            if not v.is_leaf and id(v) not in memo:
                memo[id(v)] = v.detach().clone()
        elif depth < 3 and isinstance(v, (list, tuple)):
            for x in v:
                visit(x, depth + 1)
        elif depth < 3 and isinstance(v, dict):
            for x in v.values():
                visit(x, depth + 1)

    for m in model.modules():
        for k, v in vars(m).items():
            if k not in ("_parameters", "_buffers", "_modules"):
                visit(v)
    return copy.deepcopy(model, memo)
