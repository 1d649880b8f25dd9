"""The declared objective of one micro-batch: its loss sum and count (see the package docstring),
the labels the built-in objectives read, and each example of a micro-batch alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dormouse.errors import DormouseError
from dormouse.gate.record import routeraux
from dormouse.gate.record.options import LOSS_LABELS, OBJECTIVES
from dormouse.gate.record.reference.error import ReferenceError


def logits(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits") and isinstance(getattr(out, "logits"), torch.Tensor):
        return out.logits
    if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, (tuple, list)) and out:
        # transformers' return_dict=False convention: (loss, logits, ...) when labels were given, (logits, ...)
        # otherwise; the logits are the first tensor with a class dimension, never a 0-d loss
        found = next((t for t in out if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        if found is not None:
            return found
    raise ReferenceError(f"the model's output ({type(out).__name__}) holds no logits the declared objective "
                         "can read: return a tensor, or an object with .logits, or declare objective='pkg.mod:fn'")


def call(model, batch: dict[str, torch.Tensor]):
    args = [batch[f"arg{i}"] for i in range(len(batch)) if f"arg{i}" in batch]
    kwargs = {k: v for k, v in batch.items() if not k.startswith("arg") and k != LOSS_LABELS}
    return model(*args, **kwargs)


def labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's labels; without a "labels" input, the input ids (or arg0)
    with -100 where attention_mask is 0. Labels the loop gave its loss and
    not the model (rec.labels) come first."""
    if LOSS_LABELS in batch:
        return batch[LOSS_LABELS]
    if "labels" in batch:
        return batch["labels"]
    ids = batch.get("input_ids", batch.get("arg0"))
    if ids is None:
        raise ReferenceError("the recorded batch has no labels, input_ids or positional tensor: the Recorder "
                             "reads the tensors the model's forward gets as positional arguments or keywords (a dict "
                             "passed as one argument is not read: call model(**batch)); or declare "
                             "objective='pkg.mod:fn', or pass labels to the model")
    mask = batch.get("attention_mask")
    return ids.masked_fill(mask == 0, -100) if mask is not None else ids


def objective_sum(objective: str, model, batch: dict[str, torch.Tensor], user=None, *, upcast: bool = True,
                  aux_weight: float | None = None):
    """(loss_sum, count) of one micro-batch under the declared objective (see the package docstring).
    upcast=False leaves the logits in the dtype the forward gives (a reduced-precision loop's loss).
    A transformers MoE model's own load-balancing term (routeraux) joins a built-in objective's loss
    sum weighted by aux_weight (the step's count; this batch's own count when None)."""
    if objective not in OBJECTIVES:
        try:
            loss_sum, count = user(model, batch)
        except DormouseError:
            raise
        except Exception as e:
            raise ReferenceError(f"objective {objective!r} failed on a recorded batch ({type(e).__name__}: {e})")
        return loss_sum, float(count)
    out = call(model, batch)
    loss_sum, count = objective_of_logits(objective, logits(out), batch, upcast=upcast)
    aux = routeraux.term(out, model, batch)
    if aux is not None:
        loss_sum = loss_sum + aux * (count if aux_weight is None else aux_weight)
    return loss_sum, count


def objective_count(objective: str, batch: dict[str, torch.Tensor]) -> float:
    """A built-in objective's count of one micro-batch, from its labels alone (no forward)."""
    y = labels(batch)
    if objective == "causal_lm":
        y = y[..., 1:]
    if objective == "example_mean":
        return float(y.shape[0])
    return float((y != -100).sum())


def aux_weight(objective: str, model, mbs) -> float | None:
    """The step's count, which a transformers MoE model's per-forward load-balancing term is weighted by
    (routeraux), where the objective is built in and the model adds one; else None."""
    if objective not in OBJECTIVES or not any(routeraux.coef(model, b) is not None for _, _, b in mbs):
        return None
    return sum(objective_count(objective, b) for _, _, b in mbs)


def objective_of_logits(objective: str, z: torch.Tensor, batch: dict[str, torch.Tensor], *, upcast: bool = True):
    """A built-in objective's (loss_sum, count) from a micro-batch's logits z
    (in float32, or with upcast=False in the dtype they are given in)."""
    z = z.float() if upcast else z
    y = labels(batch)
    if objective == "causal_lm":
        z, y = z[..., :-1, :], y[..., 1:]
    if objective == "example_mean" and z.dim() == 2:
        if y.shape != z.shape[:1]:
            raise ReferenceError(f"objective 'example_mean' does not fit the model's outputs: logits of shape "
                                 f"{tuple(z.shape)} against labels of shape {tuple(y.shape)}")
        return F.cross_entropy(z, y, reduction="sum"), float(z.shape[0])
    if z.dim() < 2 or tuple(z.shape[:-1]) != tuple(y.shape):
        raise ReferenceError(f"objective {objective!r} does not fit the model's outputs: logits of shape "
                             f"{tuple(z.shape)} against labels of shape {tuple(y.shape)}"
                             + (" (after the shift by one)" if objective == "causal_lm" else ""))
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="none")
    if objective == "example_mean":
        ce, valid = ce.view(y.shape), (y != -100)
        per = (ce * valid).flatten(1).sum(1) / valid.flatten(1).sum(1).clamp_min(1)
        return per.sum(), float(y.shape[0])
    return ce.sum(), float((y != -100).sum())


def rows(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Each example of a micro-batch alone (tensors whose first dim is the
    batch's), and, where a 2-D 0/1 attention_mask marks one contiguous run of
    its positions, trimmed to that run (every tensor with the row's length in
    its second dim): the example as one process at another padded length
    sees it. A forward that depends on its padding (left padding with absolute
    positions) then differs from its micro-batch's, which fact 1's check sees.
    A row whose labels make padding targets (labels = input_ids with padding
    not masked to -100) keeps its padded length: trimmed, it would lose
    targets its micro-batch's loss has."""
    b = next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), 0)
    mask = batch.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or mask.shape[0] != b or not bool(((mask == 0) | (mask == 1)).all())):
        mask = None
    rows = []
    for i in range(b):
        row = {k: (v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b else v)
               for k, v in batch.items()}
        if mask is not None:
            T, on = mask.shape[1], mask[i].nonzero().flatten()
            a, e = (int(on[0]), int(on[-1]) + 1) if on.numel() else (0, T)
            # padding the labels make targets (labels = input_ids, padding not masked) is part of the row
            y = row.get(LOSS_LABELS, row.get("labels"))
            pads_are_targets = (isinstance(y, torch.Tensor) and y.dim() == 2 and y.shape[1] == T
                                and bool((torch.cat([y[0, :a], y[0, e:]]) != -100).any()))
            if on.numel() and e - a == on.numel() and (a > 0 or e < T) and not pads_are_targets:
                row = {k: (v[:, a:e] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == 1
                           and v.shape[1] == T else v)
                       for k, v in row.items()}
        rows.append(row)
    return rows


def labels_source(batch: dict) -> str:
    """What the built-in objectives read as labels in this batch (see labels)."""
    return next((k for k in (LOSS_LABELS, "labels", "input_ids", "arg0") if k in batch), "none")
