"""The model as the sharded reference holds it (reference/sharded.py): sharded by FSDP2 over the
ranks of the launch, on the CPU (gloo), and never reduced by it.

Each entry of the outermost nn.ModuleList (a transformer's layers) is an FSDP2 unit of its own,
then the root: a rank holds 1/N of every parameter, and one unit's full parameters while its
forward and backward run (reshard_after_forward). set_requires_gradient_sync(False): FSDP2's
reduce-scatter never runs; each backward's gradient stays unsharded on the rank that computed it
(FSDP2's own accumulation buffer), where `take_grads` reads it and empties it for the next one.
That buffer is FSDP2's internal state (FSDPParam), read here alone: a torch whose FSDP2 lacks it
says so in one line."""

from __future__ import annotations

import torch

from dormouse.gate.record.reference.error import ReferenceError


def shard(model, world: int):
    """Shard `model` in place over a 1-D CPU mesh of `world` ranks, gradient sync off."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_requires_gradient_sync(False)
    _param_states(model)  # fails now, in one line, where torch's FSDP2 holds its state otherwise
    return model


def _blocks(model) -> list[torch.nn.Module]:
    """The entries of every outermost nn.ModuleList (a transformer's layers) whose parameters no module
    outside the entry shares (a tied embedding stays with the root): FSDP2 units of their own."""
    lists = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    outer = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    named = dict(model.named_modules())
    blocks = [(f"{n}.{c}" if n else c, b) for n in outer for c, b in named[n].named_children()
              if any(True for _ in b.parameters())]
    owners: dict[int, set] = {}
    for name, m in model.named_modules():
        owner = next((bn for bn, _ in blocks if name == bn or name.startswith(bn + ".")), None)
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(owner)
    return [b for bn, b in blocks if all(owners[id(p)] == {bn} for p in b.parameters())]


def _param_states(model) -> list[tuple[str, object]]:
    """(name, FSDP2's FSDPParam) of every parameter, in named_parameters order."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, object] = {}
    try:
        for mod in model.modules():
            if isinstance(mod, FSDPModule):
                for group in mod._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        found[names[id(fp.sharded_param)]] = fp
                        fp.unsharded_accumulated_grad  # noqa: B018 (present in the torch this reads)
    except (AttributeError, KeyError) as e:
        raise ReferenceError(f"this torch's FSDP2 ({torch.__version__}) holds its unsharded gradients otherwise "
                             f"({type(e).__name__}: {e}): run `dormouse gate check` in one process") from None
    return [(n, found[n]) for n in names.values() if n in found]


def load(model, params, buffers=None) -> None:
    """The recorded parameters (full tensors, each rank reading them) into this rank's shards, and the
    recorded persistent buffers (FSDP2 does not shard buffers)."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for n, p in model.named_parameters():
            full = params[n].to(p.dtype)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        for n, b in model.named_buffers():
            if buffers and n in buffers:
                b.copy_(buffers[n])


def take_grads(model) -> list[tuple[str, torch.Tensor]]:
    """The last backward's full gradient of every parameter that has one, as this rank computed it
    (name order), emptied from FSDP2's buffers for the next backward."""
    out = []
    for n, fp in _param_states(model):
        g = fp.unsharded_accumulated_grad
        if g is None and hasattr(fp, "_unsharded_param"):
            g = fp._unsharded_param.grad
        fp.unsharded_accumulated_grad = None
        if hasattr(fp, "_unsharded_param"):
            fp._unsharded_param.grad = None
        if g is not None:
            out.append((n, g.detach()))
    return out

