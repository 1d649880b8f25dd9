"""One forward and backward as the loop ran it: its module modes, autocast, dtypes and the model's
plain attributes, the gradient left in p.grad (or copied out)."""

from __future__ import annotations

import contextlib

import torch

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record.reference.error import ReferenceError
from dormouse.gate.record.reference.objective import objective_sum


def scan(model) -> dict:
    """Modules that break fact 1 by construction: active dropout, batch statistics; and the parameters
    the model ties (one tensor under several names)."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    tied: dict[int, list[str]] = {}  # one parameter under several names (tied embeddings): a pipeline's copies
    for n, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(n)
    return {"dropout": [n for n, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0 and m.training],
            "batchnorm": [n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training],
            "tied": [names for names in tied.values() if len(names) > 1]}


def set_modes(model, eval_names: list[str]) -> None:
    """The loop's module modes: training, but for the submodules it ran in
    eval mode (a frozen BatchNorm uses its running statistics, a dropout
    switched off draws nothing), as the recording says."""
    model.train()
    named = dict(model.named_modules())
    for n in eval_names:
        if n == "":  # the model itself (its own flag alone: its submodules' are listed)
            model.training = False
            continue
        if n not in named:
            raise ReferenceError(f"the recording ran submodule {n!r} in eval mode, but the rebuilt model has no "
                                 "such submodule: build_model must build the recorded model")
        named[n].eval()


def dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ReferenceError(f"the recording names a dtype {name!r} torch does not have")
    return dtype


def autocast(ac: dict | None):
    """The recorded autocast of a micro-batch, as a context for the
    reference's forward (which runs on the CPU)."""
    if ac is None:
        return contextlib.nullcontext()
    if ac.get("device_type") != "cpu":
        raise ReferenceError(f"the loop ran its forward under {ac.get('device_type')} autocast "
                             f"({ac.get('dtype')}): the reference computes on the CPU, whose reduced-precision "
                             "kernels round otherwise; record a CPU run, or the run without autocast")
    return torch.autocast("cpu", dtype=dtype(ac.get("dtype")))


def grads(model, objective, batch, user, ac=None, scale: float = 1.0, aux_weight: float | None = None):
    model.zero_grad(set_to_none=True)
    with autocast(ac):  # the forward (and the objective) under the loop's autocast; the backward outside
        ls, c = objective_sum(objective, model, batch, user, aux_weight=aux_weight)
    if not isinstance(ls, torch.Tensor) or not ls.requires_grad:
        raise ReferenceError(f"objective {objective!r} gives a loss with no gradient: it must be computed from "
                             "the model's outputs")
    (ls * scale if scale != 1.0 else ls).backward()
    return float(ls.detach()), c, {n: (p.grad.detach().clone() if p.grad is not None else None)
                                   for n, p in model.named_parameters()}


def backward(model, objective, batch, user, ac=None, scale: float = 1.0, aux_weight: float | None = None):
    """_grads without the copies: (loss_sum, count), the gradient left in p.grad."""
    model.zero_grad(set_to_none=True)
    with autocast(ac):
        ls, c = objective_sum(objective, model, batch, user, aux_weight=aux_weight)
    if not isinstance(ls, torch.Tensor) or not ls.requires_grad:
        raise ReferenceError(f"objective {objective!r} gives a loss with no gradient: it must be computed from "
                             "the model's outputs")
    (ls * scale if scale != 1.0 else ls).backward()
    return float(ls.detach()), c


def attrs(model, rec: A.RecordingSet, r: int, step: int, m: int):
    try:
        return BS.apply_attrs(model, BS.attr_changes_at(rec, r, step, m), rec.recorded.attrs)
    except DormouseError as e:
        raise ReferenceError(str(e)) from None
