"""Buffers: the recorded state loaded into the model, and the declared buffer_update rule applied
in one process ("bu/", compared bitwise with the recorded buffers after the step)."""

from __future__ import annotations

import torch

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.record.userfns import import_path
from dormouse.gate.record.reference.error import ReferenceError


def load_params(model, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> None:
    """The recorded parameters (and persistent buffers, "b/", where recorded: state
    outside the optimizer, e.g. a routing bias, that the step's forward reads)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
        for n, b in model.named_buffers():
            if buffers and n in buffers:
                b.copy_(buffers[n])


def buffer_rule(rec: A.RecordingSet):
    """The recording's declared buffer_update rule and its description (None, "" when none)."""
    path = rec.spec.buffer_update
    if not path:
        return None, ""
    fn = import_path(path, "buffer_update")
    doc = (fn.__doc__ or "").strip().split("\n\n")[0]
    return fn, " ".join(doc.split()) or path


@torch.no_grad()
def updated_buffers(fn, path: str, model, rec: A.RecordingSet, k: int) -> dict[str, torch.Tensor]:
    """The declared rule's buffers after step k, from the model as it stands
    (the recorded state before k) and every rank's micro-batches of k."""
    batches = [b for _, _, b in rec.micro_batches(k)]
    try:
        out = fn(model, batches, **rec.spec.build_kwargs)
    except DormouseError:
        raise
    except Exception as e:
        raise ReferenceError(f"buffer_update {path!r} failed at step {k} ({type(e).__name__}: {e})")
    if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise ReferenceError(f"buffer_update {path!r} returned a {type(out).__name__}, not a dict of buffer name to "
                             "tensor")
    return {n: v.detach().cpu().clone() for n, v in out.items()}
