"""What the one-process reference (record/reference/) needs beyond each
recorded micro-batch's tensors: what else its forward received, and the
step's rows merged into as few forwards as memory allows.

What a forward received (the Recorder's step JSON, per micro-batch):
  "call"   its non-tensor arguments of plain types (a bool keyword that
           switches a branch; "argI" a positional one): forward_inputs puts
           them back into the micro-batch, so the reference passes them.
  "attrs"  the model's plain attributes (bool/int/float/str/None) that
           differ from their values when the Recorder started (a flag the
           loop set before that forward): set for that micro-batch alone
           (apply_attrs). recording.json's "attrs" are the values at the
           start; the rebuilt model takes those build_model's differ in or
           lacks (start_attrs); one on a submodule the rebuilt model does not
           have is refused in one line.

One forward for the global batch (merge_plan, merged): one process at the
global batch computes the step's rows (every rank's, every micro-batch's) in
one forward. The reference does so beside the micro-batch sums, so that a
network or objective that depends on which rows share a forward (a
load-balancing term over the forward's own routing statistics, in-batch
negatives, BatchNorm) shows even with one row per micro-batch. Rows of
different lengths are padded as the recording pads (on the right, or on the
left where a recorded attention_mask starts with padding): the attention
mask 0, labels -100, other inputs 0 there; micro-batches that cannot share a
forward (different lengths without a 2-D 0/1 attention_mask, other
non-tensor arguments, attributes, autocast or cast) go into forwards of
their own, and a forward holds at most MERGE_TOKENS positions (rows x
length): the plan's words say how many forwards it took and why.
"""

from __future__ import annotations

import hashlib
import json

import torch

from dormouse.errors import DormouseError
from dormouse.gate.record.options import LOSS_LABELS, PLAIN

# positions (rows x padded length) of one merged forward: larger global batches are merged in chunks
MERGE_TOKENS = 1 << 16
_LABEL_KEYS = ("labels", LOSS_LABELS)
_MISSING = object()  # an attribute the rebuilt module does not have


class BatchScopeError(DormouseError):
    """The recording's forward arguments cannot be reproduced as recorded."""


# --------------------------------------------------------------------------- what a forward received


def forward_inputs(rec, step: int) -> list[tuple[int, int, dict]]:
    """(rank, m, batch) of every micro-batch of `step` (rec.micro_batches),
    each batch with its recorded non-tensor arguments put back."""
    out = []
    for r, m, batch in rec.micro_batches(step):
        calls = rec.step_meta(r, step).get("call") or []
        call = calls[m] if m < len(calls) and isinstance(calls[m], dict) else {}
        out.append((r, m, {**batch, **{k: v for k, v in call.items() if type(v) in PLAIN}}))
    return out


def attr_changes_at(rec, r: int, step: int, m: int) -> dict | None:
    """The attributes micro-batch m of rank r at `step` ran with, beyond the start's (None: none)."""
    attrs = rec.step_meta(r, step).get("attrs") or []
    return attrs[m] if m < len(attrs) and isinstance(attrs[m], dict) else None


def _module(model, path: str, name: str, why: str):
    """The rebuilt model's submodule `path` (an attribute it lacks is set
    there as the loop set it on the recorded one); one line when it has none."""
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        raise BatchScopeError(f"the recorded model's attribute '{path}.{name}' ({why}) belongs to a submodule "
                              f"{path!r} the model build_model builds does not have: build the loop's model") from None


def start_attrs(model, recorded: dict | None) -> list[str]:
    """Set the rebuilt model's plain attributes to the recorded start values
    where they differ; returns the attributes set ("path.name")."""
    done = []
    for path, d in (recorded or {}).items():
        for name, v in d.items():
            mod = _module(model, path, name, f"{v!r} when the Recorder started")
            now = vars(mod).get(name, _MISSING)
            if type(now) is not type(v) or now != v:
                setattr(mod, name, v)
                done.append(f"{path}.{name}" if path else name)
    return done


def apply_attrs(model, changes: dict | None, recorded: dict | None):
    """Set `changes` (a micro-batch's attributes) on the model; returns a
    function that puts the start values back (a no-op without changes)."""
    if not changes:
        return lambda: None
    back = []
    for path, d in changes.items():
        for name, v in d.items():
            mod = _module(model, path, name, f"{v!r} at a recorded forward")
            back.append((mod, name, (recorded or {}).get(path, {}).get(name, vars(mod).get(name, _MISSING))))
            setattr(mod, name, v)

    def undo():
        for mod, name, v in back:
            if v is _MISSING:
                delattr(mod, name)
            else:
                setattr(mod, name, v)
    return undo


# --------------------------------------------------------------------------- one forward for the global batch


def _rows(batch: dict) -> int | None:
    return next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)


def _mask(batch: dict) -> torch.Tensor | None:
    """The batch's 2-D 0/1 attention_mask with its rows, else None (no padding possible)."""
    mask, rows = batch.get("attention_mask"), _rows(batch)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != rows:
        return None
    return mask if bool(((mask == 0) | (mask == 1)).all()) else None


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.view(-1).view(torch.uint8).numpy().tobytes()
                          ).hexdigest()


def _signature(batch: dict, extra) -> str:
    """What micro-batches must share to be merged into one forward."""
    rows, mask = _rows(batch), _mask(batch)
    T = mask.shape[1] if mask is not None else None
    sig = {"extra": extra, "keys": sorted(batch)}
    for k in sorted(batch):
        v = batch[k]
        if not isinstance(v, torch.Tensor):
            sig[k] = repr(v)
        elif not v.dim() or v.shape[0] != rows:  # not the batch's rows: the same in every merged micro-batch
            sig[k] = _digest(v)
        else:
            pad = T is not None and v.dim() >= 2 and v.shape[1] == T
            sig[k] = [str(v.dtype), v.dim(), list(v.shape[2:]) if pad else list(v.shape[1:])]
    return json.dumps(sig, sort_keys=True, default=str)


def merge_plan(batches: list[dict], extras: list) -> tuple[list[list[int]], str]:
    """The micro-batches (indices) of each merged forward, and the words
    saying how the step's rows were merged. extras[i]: what else micro-batch
    i's forward must share with the others (autocast, cast, attributes)."""
    groups: dict[str, list[int]] = {}
    for i, b in enumerate(batches):
        groups.setdefault(_signature(b, extras[i]), []).append(i)
    chunks, split = [], False
    for idx in groups.values():
        cur, cur_rows, cur_len = [], 0, 0
        for i in idx:
            rows = _rows(batches[i]) or 1
            length = max((v.shape[1] for v in batches[i].values() if isinstance(v, torch.Tensor) and v.dim() >= 2),
                         default=1)
            if cur and (cur_rows + rows) * max(cur_len, length) > MERGE_TOKENS:
                chunks.append(cur)
                cur, cur_rows, cur_len, split = [], 0, 0, True
            cur.append(i)
            cur_rows, cur_len = cur_rows + rows, max(cur_len, length)
        chunks.append(cur)
    rows = sum(_rows(b) or 0 for b in batches)
    padded = any(len({_length(batches[i]) for i in c}) > 1 for c in chunks)
    words = f"the step's {rows} rows in {len(chunks)} forward{'s' if len(chunks) > 1 else ''}"
    if padded:
        words += f" (padded on the {_side([batches[i] for c in chunks for i in c])} with the attention mask)"
    if len(groups) > 1:
        words += (f": {len(groups)} kinds of micro-batch that cannot share a forward (other lengths without an "
                  "attention_mask, other non-tensor arguments, attributes, autocast or cast)")
    if split:
        words += f"; at most {MERGE_TOKENS} positions a forward"
    return chunks, words


def _length(batch: dict) -> int | None:
    mask = _mask(batch)
    return mask.shape[1] if mask is not None else None


def _side(batches: list[dict]) -> str:
    """Where the recording pads: the left when a recorded mask row starts with 0 and ends with 1."""
    for b in batches:
        m = _mask(b)
        if m is not None and m.shape[1] and bool(((m[:, 0] == 0) & (m[:, -1] == 1)).any()):
            return "left"
    return "right"


def merged(batches: list[dict]) -> dict:
    """One batch of every row of `batches` (which merge_plan put in one
    forward), padded to the longest as the recording pads."""
    if len(batches) == 1:
        return batches[0]
    lengths = {_length(b) for b in batches}
    T = max((t for t in lengths if t is not None), default=None)
    side = _side(batches)
    out = {}
    for k in batches[0]:
        v0 = batches[0][k]
        if not isinstance(v0, torch.Tensor) or not v0.dim() or v0.shape[0] != _rows(batches[0]):
            out[k] = v0
            continue
        parts = []
        for b in batches:
            v, t = b[k], _length(b)
            if t is not None and T is not None and v.dim() >= 2 and v.shape[1] == t and t < T:
                fill = 0 if k == "attention_mask" else (-100 if k in _LABEL_KEYS else 0)
                pad = torch.full((v.shape[0], T - t, *v.shape[2:]), fill, dtype=v.dtype)
                v = torch.cat([pad, v] if side == "left" else [v, pad], dim=1)
            parts.append(v)
        out[k] = torch.cat(parts, dim=0)
    return out
