"""The one-process references for a recording (record/recorder.py): what one
process computes from the recorded micro-batches, never from the loop's own
loss code. It WRITES artifacts (<out>/reference/...); the judge
(judge/facts/) compares them with the recording.

Rebuild: `build_model(**build_kwargs)` must give the recorded initial state
bitwise; `build_optimizer(model, **build_kwargs)` the optimizer (and scheduler).

The declared objective, for a micro-batch b with model outputs z (logits):
  causal_lm     loss_sum(b) = sum_{i,t: y_{i,t+1} != -100} CE(z_{i,t}, y_{i,t+1}),
                count(b) = #{(i,t): y_{i,t+1} != -100}   (labels shifted by one: HF's convention)
  token_mean    the same without the shift (labels already aligned)
  example_mean  loss_sum(b) = sum_i mean_t CE(z_{i,t}, y_{i,t}) (or CE(z_i, y_i) for (B, C) logits), count = B
  "pkg.mod:fn"  fn(model, batch) -> (loss_sum, count)
The objective of a step over every rank r's micro-batches m is the GLOBAL mean
    L = sum_{r,m} loss_sum(b_rm) / sum_{r,m} count(b_rm),
and its gradient g = sum_{r,m} grad loss_sum(b_rm) / sum_{r,m} count(b_rm), each
micro-batch's gradient in float32 (as the fleet computes it) summed in float64.
Beside it, the weightings the famous bugs compute (so the judge can NAME them):
    micro_mean  (1/M) sum_{r,m} grad loss_sum(b_rm) / count(b_rm)       (mean of micro-batch means)
    rank_mean   (1/W) sum_r (sum_m grad loss_sum(b_rm)) / (sum_m count(b_rm))   (each rank its own count)
and fact 1's per-example sum over a SAMPLE S of micro-batches (example_sample):
    ex  = sum_{b in S} sum_{rows i of b} grad loss_sum(row i alone) / sum count
    exb = sum_{b in S} grad loss_sum(b) / sum count
equal when the network is a function of each example alone. S is every
rank's first micro-batch at the first recorded step and one micro-batch at
each later one, rotating over ranks and micro-batches: per-example gradients
cost about 1.5x a micro-batch's, and over every micro-batch of every step
they were half the check's time (a dependence on the batch confined to
micro-batches outside S is not seen; BatchNorm and dropout show in any).

One forward for the global batch ("gm", at judged steps): the same objective
over the step's rows merged into as few forwards as memory allows
(batchscope: every rank's and micro-batch's rows, padded as the recording
pads), normalised by its own count: equal to g when no row's gradient
depends on which rows share its forward. objective_scope (recording.json):
"example" (the default) and "forward" differentiate each micro-batch as above
(the judge holds gm to g only under "example"); "step" calls the declared
fn(model, batches) once on every rank's micro-batches of the step (rank then
micro order) and differentiates loss_sum / count (no per-example sample, no
merged forward); beside it, with more than one rank, "rank_mean": fn over
each rank's micro-batches alone, (1/W) sum_r grad(loss_sum_r / count_r) (the
step's statistics over each rank's own rows: what a fleet that never reduces
them trains); on a transformers MoE model, "fwd": the causal LM loss with the
model's own term per forward, the judge's name for a fleet that computes per
forward what the declaration computes over the step.
A transformers MoE model's own per-forward load-balancing term joins the
built-in objectives, weighted by the step's count (routeraux). "last": each
rank's last micro-batch's share of g (the judge's causes name a last
micro-batch weighted apart from the others).
What each forward received beyond its tensors (its non-tensor arguments, the
model's plain attributes the loop set) is put back as recorded (batchscope).

Reduced precision: each micro-batch's forward runs under the autocast the
recording says it ran under (the Recorder reads it), on the parameters in
the dtype they were recorded in. Under autocast, or with bfloat16/float16
parameters, the backward's round-off depends on the scale the loss is
backpropagated at, which the loop chooses (its normalisation is what is
under test), so the reference also measures it: "precision_floor" =
||3 g(loss_sum / 3) - g|| / ||g|| over the step's micro-batches, the same
gradient through a loss scaled by 1/3 (not a power of two), in one process;
the judge's bounds are FLOOR_MULTIPLE x its largest. "loss_floor" (built-in
objectives) is the step's loss computed from the logits in the dtype the
forward gives them, outside autocast (no float32 upcast), against the
objective's: how far a loop that computes its loss in that precision logs.
"precision_floor_tensors" is the floor of each tensor alone. Every
micro-batch of a step where any computes in reduced precision is measured. Parameters cast for the
forward (FSDP2's MixedPrecisionPolicy: the recording's "compute_dtype") are
computed on a copy of the model cast so.

Replay (full tensors at every step): from the initial state, the user's
optimizer (and scheduler) applied to the RECORDED gradients, clipped by
max_grad_norm when the loop's gradients were recorded before clipping; the
parameters before each step and after the last are written for the judge to
compare bitwise with the recorded ones. One uninterrupted optimizer and
scheduler run across a resume: what a correct resume equals.

Buffers (a recording with buffer_update, full tensors at every step): at
every step k, the declared rule applied in one process to the model holding
the recorded parameters and buffers before k and to every rank's recorded
micro-batches of k; its result ("bu/", the buffers after k) is written for the
judge to compare bitwise with the buffers recorded before k + 1 (or after the
last step). The rule's first docstring line names it in the verdict.

Run (sketches, or tensors every k-th step): the recorded gradients are not all
there to replay, so the reference trains the run itself in one process on the
declared objective over the recorded micro-batches, clipping by the global
norm, and writes (sketches of) its parameters and gradients at the recorded
steps: facts 3 and 4 together, within a bound. The bound is measured: the same
run from an initial state one ulp away ("np/", "ng/", "nudged_loss") shows how
far float32 round-off alone carries a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.clip import clip_coef
from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record import probe
from dormouse.gate.record.options import LOSS_LABELS, OBJECTIVES
from dormouse.gate.record.sketch import Sketcher, sketch_buckets
from dormouse.gate.record.userfns import code_hashes, import_path
from dormouse.gate.record import routeraux
from dormouse.gate.record.layouts import equal_shards
from dormouse.train.tensors import copy_module  # deepcopy past a graph tensor a forward left on a module

REFERENCE_SCHEMA = 1


class ReferenceError(DormouseError):
    """The recording cannot be rebuilt or judged as it stands (bad input)."""


# --------------------------------------------------------------------------- the objective


def _logits(out) -> torch.Tensor:
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


def _call(model, batch: dict[str, torch.Tensor]):
    args = [batch[f"arg{i}"] for i in range(len(batch)) if f"arg{i}" in batch]
    kwargs = {k: v for k, v in batch.items() if not k.startswith("arg") and k != LOSS_LABELS}
    return model(*args, **kwargs)


def _labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's labels; without a "labels" input, the input ids (or arg0)
    with -100 where attention_mask is 0. Labels the loop gave its loss and
    not the model (rec.labels) come first."""
    if LOSS_LABELS in batch:
        return batch[LOSS_LABELS]
    if "labels" in batch:
        return batch["labels"]
    ids = batch.get("input_ids", batch.get("arg0"))
    if ids is None:
        raise ReferenceError("the recorded batch has no labels, input_ids or positional tensor: declare "
                             "objective='pkg.mod:fn' or pass labels to the model")
    mask = batch.get("attention_mask")
    return ids.masked_fill(mask == 0, -100) if mask is not None else ids


def objective_sum(objective: str, model, batch: dict[str, torch.Tensor], user=None, *, upcast: bool = True,
                  aux_weight: float | None = None):
    """(loss_sum, count) of one micro-batch under the declared objective (see the module docstring).
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
    out = _call(model, batch)
    loss_sum, count = objective_of_logits(objective, _logits(out), batch, upcast=upcast)
    aux = routeraux.term(out, model, batch)
    if aux is not None:
        loss_sum = loss_sum + aux * (count if aux_weight is None else aux_weight)
    return loss_sum, count


def objective_count(objective: str, batch: dict[str, torch.Tensor]) -> float:
    """A built-in objective's count of one micro-batch, from its labels alone (no forward)."""
    y = _labels(batch)
    if objective == "causal_lm":
        y = y[..., 1:]
    if objective == "example_mean":
        return float(y.shape[0])
    return float((y != -100).sum())


def _aux_weight(objective: str, model, mbs) -> float | None:
    """The step's count, which a transformers MoE model's per-forward load-balancing term is weighted by
    (routeraux), where the objective is built in and the model adds one; else None."""
    if objective not in OBJECTIVES or not any(routeraux.coef(model, b) is not None for _, _, b in mbs):
        return None
    return sum(objective_count(objective, b) for _, _, b in mbs)


def objective_of_logits(objective: str, z: torch.Tensor, batch: dict[str, torch.Tensor], *, upcast: bool = True):
    """A built-in objective's (loss_sum, count) from a micro-batch's logits z
    (in float32, or with upcast=False in the dtype they are given in)."""
    z = z.float() if upcast else z
    y = _labels(batch)
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


def _rows(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
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


# --------------------------------------------------------------------------- the rebuild


def rebuild(rec: A.RecordingSet):
    """The user's model (checked against the recorded initial state), optimizer and scheduler."""
    meta = rec.meta
    kw = meta.get("build_kwargs", {})
    fn = import_path(meta["build_model"], "build_model")
    try:
        model = fn(**kw)
    except Exception as e:
        raise ReferenceError(f"build_model {meta['build_model']!r}(**{kw}) failed ({type(e).__name__}: {e})")
    if not isinstance(model, torch.nn.Module):
        raise ReferenceError(f"build_model {meta['build_model']!r} returned a {type(model).__name__}, not a module")
    init = rec.init()
    state = model.state_dict()
    if set(state) != set(init):
        extra, missing = sorted(set(state) - set(init)), sorted(set(init) - set(state))
        raise ReferenceError(f"build_model {meta['build_model']!r} builds other tensors than the recording's "
                             f"(not recorded: {extra[:3]}, not built: {missing[:3]}): it must build the loop's model")
    for n in sorted(init):
        a, b = state[n].detach().cpu(), init[n]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            apart = A.ranks_apart_from(rec, state)
            if apart:
                raise ReferenceError(apart)
            pattern = (((meta.get("layout") or {}).get("params") or {}).get(n) or {}).get("pattern")
            if pattern and a.shape == b.shape and a.dtype == b.dtype:  # assembled by a declared sharding (declared.py)
                raise ReferenceError(f"build_model {meta['build_model']!r} builds {n} other than the recorded initial "
                                     f"one, which the declared sharding {pattern!r} assembled from its ranks' pieces: "
                                     "if every rank built build_model's model, the group's ranks are declared in "
                                     "another order than the pieces concatenate in (or along another dim)")
            # the first differing tensor may have no layout entry (a state_dict key split from a fused
            # parameter, as torchtitan's wqkv into wq, wk, wv): any differing parameter's equal shards tell
            why = next((w for m in sorted(init) if m in state and not torch.equal(state[m].detach().cpu(), init[m])
                        and (w := equal_shards(meta.get("layout"), m, init[m]))), None)
            raise ReferenceError(f"build_model {meta['build_model']!r} builds parameters that differ from the "
                                 f"recorded initial ones (first: {n}): " + (why or "seed it as the loop does"))
    _as_recorded(model, meta)
    return model


def _as_recorded(model, meta: dict) -> None:
    """The rebuilt model as the loop ran it, beyond its tensors: the
    parameters the loop froze (requires_grad False) and, for a transformers
    model, the scalar config fields the loop's model had (the Trainer sets
    use_cache = False at its start, and GPT-2 masks packed sequences only
    then), and the modules' plain attributes the loop had set when the
    Recorder started (batchscope.start_attrs); build_model need not repeat
    what the training script did."""
    try:
        BS.start_attrs(model, meta.get("attrs"))
    except DormouseError as e:
        raise ReferenceError(str(e)) from None
    if "frozen" in meta:
        frozen = set(meta["frozen"])
        for n, p in model.named_parameters():
            p.requires_grad_(n not in frozen)
    recorded, cfg = meta.get("hf_config"), getattr(model, "config", None)
    if recorded and cfg is not None and hasattr(cfg, "to_dict"):
        now = cfg.to_dict()
        for k, v in recorded.items():
            if k in now and now[k] != v:
                try:
                    setattr(cfg, k, v)
                except (AttributeError, TypeError, ValueError):  # a derived field: not the loop's to set
                    pass


def build_optimizer(rec: A.RecordingSet, model):
    meta = rec.meta
    fn = import_path(meta["build_optimizer"], "build_optimizer")
    try:
        built = fn(model, **meta.get("build_kwargs", {}))
    except Exception as e:
        raise ReferenceError(f"build_optimizer {meta['build_optimizer']!r} failed ({type(e).__name__}: {e})")
    opt, sched = built if isinstance(built, (tuple, list)) else (built, None)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ReferenceError(f"build_optimizer {meta['build_optimizer']!r} returned no optimizer")
    return opt, sched


def check_provenance(rec: A.RecordingSet) -> None:
    """The code that would rebuild the run is the code that recorded it."""
    prov = rec.meta.get("provenance", {})
    if prov.get("torch") != torch.__version__:
        raise ReferenceError(f"the recording was made with torch {prov.get('torch')}, this is {torch.__version__}:"
                             " judge it where it was recorded")
    m = rec.meta
    now = code_hashes([m["build_model"], m["build_optimizer"], m["objective"]])
    for mod, h in prov.get("code", {}).items():
        if now.get(mod) == "" and h:  # not found from here: an import failure, not a change
            try:
                importlib.import_module(mod)
                said = "its source file cannot be found"
            except Exception as e:
                said = f"{type(e).__name__}: {e}"
            raise ReferenceError(f"module {mod!r} does not import from here ({said}): `gate check` imports the "
                                 "builders as `python -m` does, from the working directory and PYTHONPATH: run it "
                                 "from the folder the training ran in, or put the module's folder on PYTHONPATH")
        if now.get(mod) != h:
            raise ReferenceError(f"module {mod!r} changed since the recording (its source differs): "
                                 "re-record with the code the references will run")


def staleness_key(rec: A.RecordingSet) -> str:
    from dormouse.gate.artifacts import source_hash

    # every file the reference reads: the recording's fields and every rank's step JSONs and tensors (an edited
    # input or gradient makes the reference stale, never a cached one judged against it)
    files = [A.recording_path(rec.out)]
    ranks = range(max(rec.world_at(k) for k in rec.steps)) if rec.steps else range(0)
    for r in ranks:
        files += sorted(p for p in A.rank_dir(rec.out, r).iterdir() if p.is_file())
    return hashlib.sha256((A.file_digest(files) + source_hash()).encode()).hexdigest()


def is_current(out) -> bool:
    """The reference in `out` was made from this recording by this code."""
    path = A.reference_meta_path(out)
    if not path.exists():
        return False
    try:
        ref = json.loads(path.read_text())
        return ref.get("schema") == REFERENCE_SCHEMA and ref.get("key") == staleness_key(A.RecordingSet(out))
    except (ValueError, DormouseError):
        return False


# --------------------------------------------------------------------------- one step's gradients


def _scan(model) -> dict:
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
        if n not in named:
            raise ReferenceError(f"the recording ran submodule {n!r} in eval mode, but the rebuilt model has no "
                                 "such submodule: build_model must build the recorded model")
        named[n].eval()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ReferenceError(f"the recording names a dtype {name!r} torch does not have")
    return dtype


def _autocast(ac: dict | None):
    """The recorded autocast of a micro-batch, as a context for the
    reference's forward (which runs on the CPU)."""
    if ac is None:
        return contextlib.nullcontext()
    if ac.get("device_type") != "cpu":
        raise ReferenceError(f"the loop ran its forward under {ac.get('device_type')} autocast "
                             f"({ac.get('dtype')}): the reference computes on the CPU, whose reduced-precision "
                             "kernels round otherwise; record a CPU run, or the run without autocast")
    return torch.autocast("cpu", dtype=_dtype(ac.get("dtype")))


def _grads(model, objective, batch, user, ac=None, scale: float = 1.0, aux_weight: float | None = None):
    model.zero_grad(set_to_none=True)
    with _autocast(ac):  # the forward (and the objective) under the loop's autocast; the backward outside
        ls, c = objective_sum(objective, model, batch, user, aux_weight=aux_weight)
    if not isinstance(ls, torch.Tensor) or not ls.requires_grad:
        raise ReferenceError(f"objective {objective!r} gives a loss with no gradient: it must be computed from "
                             "the model's outputs")
    (ls * scale if scale != 1.0 else ls).backward()
    return float(ls.detach()), c, {n: (p.grad.detach().clone() if p.grad is not None else None)
                                   for n, p in model.named_parameters()}


def _backward(model, objective, batch, user, ac=None, scale: float = 1.0, aux_weight: float | None = None):
    """_grads without the copies: (loss_sum, count), the gradient left in p.grad."""
    model.zero_grad(set_to_none=True)
    with _autocast(ac):
        ls, c = objective_sum(objective, model, batch, user, aux_weight=aux_weight)
    if not isinstance(ls, torch.Tensor) or not ls.requires_grad:
        raise ReferenceError(f"objective {objective!r} gives a loss with no gradient: it must be computed from "
                             "the model's outputs")
    (ls * scale if scale != 1.0 else ls).backward()
    return float(ls.detach()), c


def example_sample(mbs: list[tuple[int, int, dict]], j: int) -> set[int]:
    """Which of a step's micro-batches (rank, m, batch) fact 1's per-example
    check differentiates row by row at the j-th recorded tensor step (0-based):
    j = 0 every rank's first micro-batch, j > 0 one micro-batch, the
    (j - 1)-th in rank-then-micro order, cyclically."""
    if j == 0:
        return {i for i, (r, m, _) in enumerate(mbs) if m == min(mm for rr, mm, _ in mbs if rr == r)}
    return {(j - 1) % len(mbs)}


class _Spill:
    """One step's gradients as sums of its sources, without holding them: each
    source (a micro-batch's gradient, a row's, a merged forward's) is written
    to a scratch file as the backward leaves it in p.grad (no copy in memory),
    and each output (acc[key] = sum of weight x source, in the order added, in
    float64) is formed tensor by tensor (by row ranges for a large tensor)
    when the step's file is written: the memory of a step is one model and
    its gradient, whatever the number of micro-batches and alternatives."""

    def __init__(self, model, scratch: Path):
        self.dir = Path(scratch)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: list = []
        self.terms: dict = {}

    def put(self, model) -> tuple[int, set[str]]:
        """The gradient in `model`'s p.grad as a source: (its index, the names that have one)."""
        from dormouse.gate.artifacts.tensorfile import LazyTensors, write_streamed

        held = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        path = self.dir / f"{len(self.files)}.safetensors"
        write_streamed(path, [(n, g.dtype, tuple(g.shape)) for n, g in held], ((n, g.detach()) for n, g in held),
                       durable=False)
        self.files.append(LazyTensors([path], "the reference's scratch"))
        return len(self.files) - 1, {n for n, _ in held}

    def add(self, key, src: int, w: float = 1.0) -> None:
        self.terms.setdefault(key, []).append((src, w))

    def has(self, key) -> bool:
        return bool(self.terms.get(key))

    def value(self, key, n: str, rows: tuple[int, int] | None = None):
        """sum_i w_i source_i[n] (rows a:b of it) in float64, None where no source has n."""
        acc = None
        for src, w in self.terms.get(key, []):
            f = self.files[src]
            if n in f:
                t = f[n] if rows is None else f.rows(n, *rows)
                acc = (0 if acc is None else acc) + t.double() * w
        return acc

    def same(self, src: int, model) -> bool:
        """Whether model's p.grad equals source src exactly (None where None)."""
        f = self.files[src]
        return all((n in f) == (p.grad is not None) and (p.grad is None or torch.equal(p.grad, f[n]))
                   for n, p in model.named_parameters())

    def close(self) -> None:
        import shutil

        self.files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


# a tensor above this many elements is combined (and written) key by key, by row ranges of about this size
COMBINE_ELEMENTS = 1 << 21


class _StepParts:
    """A step's reference outputs, still spread over the spilled sources:
    written to a file (write) or formed in memory (tensors, for the run mode
    that trains on them). `outputs(n, rows)` is every output of tensor n."""

    def __init__(self, spill: _Spill, names: list[str], shapes: dict, outputs, keys: list[str], info: dict,
                 dtypes: dict):
        self.spill, self.names, self.shapes, self.outputs, self.keys, self.info = spill, names, shapes, outputs, keys, info
        self.dtypes = dtypes  # the dtype each output key is written in

    def _ranges(self, n: str):
        shape = self.shapes[n]
        numel = math.prod(shape) if shape else 1
        if len(shape) == 0 or numel <= COMBINE_ELEMENTS or shape[0] < 2:
            yield None
            return
        step = max(1, COMBINE_ELEMENTS // max(1, numel // shape[0]))
        for a in range(0, shape[0], step):
            yield a, min(shape[0], a + step)

    def present(self) -> list[tuple[str, str]]:
        """(key, name) of every output there is, in writing order: tensor by tensor (each tensor's outputs
        formed together from its sources read once; a large one's key by key, by row ranges)."""
        return [(key, n) for n in self.names for key in self.keys if self.outputs.has(key, n)]

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in self.keys}
        for n in self.names:
            for key, v in self.outputs(n, None).items():
                out[key][n] = v
        self.spill.close()
        return {k: v for k, v in out.items() if v or k in ("g", "micro_mean", "rank_mean")}

    def write(self, path: Path, extra: dict[str, torch.Tensor]) -> None:
        from dormouse.gate.artifacts.tensorfile import write_streamed

        have = self.present()
        spec = [(f"{key}/{n}", self.dtypes.get(key, torch.float64), tuple(self.shapes[n])) for key, n in have]
        spec += [(k, v.dtype, tuple(v.shape)) for k, v in extra.items()]

        def pieces():
            formed: tuple[str, dict] | None = None
            for key, n in have:
                ranges = list(self._ranges(n))
                if ranges == [None]:  # every output of n at once
                    if formed is None or formed[0] != n:
                        formed = (n, self.outputs(n, None))
                    yield f"{key}/{n}", formed[1].pop(key)
                    continue
                formed = None
                for rows in ranges:
                    yield f"{key}/{n}", self.outputs(n, rows, only=key)[key]
            yield from extra.items()

        try:
            write_streamed(path, spec, pieces())
        finally:
            self.spill.close()


def step_gradients(model, rec: A.RecordingSet, step: int, user, *, examples: int | None,
                   probe: bool) -> tuple[dict, dict]:
    """The declared objective's gradient over every rank's micro-batches at
    the model's current parameters, with its alternatives and fact 1's
    per-example sum over example_sample(., examples) (None: no per-example
    check; see the module docstring), in memory."""
    parts, info = step_gradient_parts(model, rec, step, user, examples=examples, probe=probe)
    return (parts.tensors() if isinstance(parts, _StepParts) else parts), info


def _no_forward_info(names: list[str], rec: A.RecordingSet) -> dict:
    """The info of a step at which the loop called the optimizer with no forward or backward at all (no
    rank recorded a micro-batch or a gradient): one process computes no gradient either (every parameter
    without one); the replay steps the user's optimizer on that, as the loop did (pytorch #115607's
    Adam step counter lives there)."""
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    return {"loss": None, "loss_sum": 0.0, "count": 0.0, "no_forward": True,
            "loss_alt": {"micro_mean": None, "rank_mean": None, "rank_local": []}, "counts": [],
            "no_grad": list(names), "norm": 0.0, "rng_sensitive": None, "precision_floor": None,
            "precision_floor_tensors": None, "low_precision_params": [], "loss_floor": None, "ex_micro": [],
            "merged": None, "labels": None, "router_aux": None, "clip_coef": 1.0 if mgn > 0 else None}


def step_gradient_parts(model, rec: A.RecordingSet, step: int, user, *, examples: int | None,
                        probe: bool, alt_dtype: torch.dtype = torch.float64):
    """step_gradients' (outputs, info), the outputs a _StepParts that writes
    them tensor by tensor (or a plain dict for objective_scope="step").
    alt_dtype: the dtype the alternatives that only name causes are written in."""
    objective = rec.meta["objective"]
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    spill = None
    rank_n: dict[int, float] = {}
    rank_loss: dict[int, float] = {}
    n_total, loss_total, micro_means, counts, native = 0.0, 0.0, [], {}, 0.0
    present: set[str] = set()

    # reduced-precision parameters (a bfloat16 model): their gradients round as autocast's do
    lowp = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                   if p.dtype in (torch.bfloat16, torch.float16)})
    mbs = BS.forward_inputs(rec, step)  # each micro-batch with the non-tensor arguments its forward got
    if not mbs:
        if not any(rec.step_meta(r, k).get("micro_batches") for k in rec.steps for r in range(rec.world_at(k))):
            raise ReferenceError(f"step {step} recorded no micro-batch: the model's forward never ran in training "
                                 "mode between two rec.step() calls, at any step (is the Recorder on the model the "
                                 "loop calls?)")
        # an optimizer step with no forward or backward (legal: pytorch #115607's Adam step counter lives there):
        # one process computes no gradient; whatever gradient the fleet holds is judged against that
        return {}, _no_forward_info(names, rec)
    if rec.meta.get("objective_scope") == "step":  # fn(model, batches) over the whole step, once
        return _step_scope_gradients(model, rec, step, user, mbs, probe=probe, lowp=lowp, alts=examples is not None)
    spill = _Spill(model, A.reference_scratch_dir(rec.out) / f"step{step}")
    try:
        return _spilled_gradients(model, rec, step, user, mbs, spill, examples=examples, probe=probe, lowp=lowp,
                                  names=names, shapes=shapes, alt_dtype=alt_dtype)
    except BaseException:
        spill.close()
        raise


def _spilled_gradients(model, rec, step, user, mbs, spill: _Spill, *, examples, probe, lowp, names, shapes,
                       alt_dtype):
    objective = rec.meta["objective"]
    rank_n: dict[int, float] = {}
    rank_loss: dict[int, float] = {}
    ranks: list[int] = []  # in the order first seen (rank then micro order)
    n_total, loss_total, micro_means, counts, native = 0.0, 0.0, [], {}, 0.0
    present: set[str] = set()
    aw = _aux_weight(objective, model, mbs)  # an MoE model's own per-forward term: weighted by the step's count
    rng_sensitive = None
    sample = example_sample(mbs, examples) if examples is not None else set()
    cast_models: dict[str, torch.nn.Module] = {}  # the model at this step's parameters, cast for the forward
    base = model
    # the precision floor, over every micro-batch of a step where any computes in reduced precision
    measure = bool(lowp) or any(rec.autocast(r, step, m) is not None or rec.compute_dtype(r, step, m) is not None
                                for r, m, _ in mbs)
    # "gn", the normalised form: each micro-batch's loss sum / N x W backpropagated (N the step's count, W its
    # ranks: HF's Trainer, loss / num_items_in_batch x W, and DDP loops), then / W; the judge holds the fleet to
    # the nearer of g and gn. Built-in objectives (N known before the forwards). "partials": sum ||grad loss_sum||
    # over the micro-batches, "dot_length" the longest dot product of a backward (judge/bounds.py, grad_rtol)
    n_step = sum(objective_count(objective, b) for _, _, b in mbs) if objective in OBJECTIVES else 0.0
    w_step, partials = len({r for r, _, _ in mbs}), 0.0
    dot_length = max([max(p.shape) for p in base.parameters() if p.dim()] +
                     [int(_labels(b).numel()) for _, _, b in mbs if objective in OBJECTIVES] or [1])
    for i, (r, m, batch) in enumerate(mbs):
        ac, cast = rec.autocast(r, step, m), rec.compute_dtype(r, step, m)
        model = base
        if cast is not None:  # FSDP2's mixed precision: the forward and backward on cast parameters
            if cast not in cast_models:
                cast_models[cast] = copy_module(base).to(_dtype(cast))
            model = cast_models[cast]
        # the model's plain attributes this forward ran with (a flag the loop set), put back after it
        undo = _attrs(model, rec, r, step, m)
        torch.random.default_generator.manual_seed(0)
        ls, c = _backward(model, objective, batch, user, ac, aux_weight=aw)
        src, have = spill.put(model)
        present |= have
        spill.add("g", src)
        partials += math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()
                                  if p.grad is not None))
        if n_step > 0 and not measure:  # the normalised form (float32 steps: reduced precision has its floor)
            torch.random.default_generator.manual_seed(0)
            _backward(model, objective, batch, user, ac, scale=w_step / n_step, aux_weight=aw)
            spill.add("gn", spill.put(model)[0], 1.0 / w_step)
        if measure:  # the precision floor: the same gradient through the loss / 3
            _backward(model, objective, batch, user, ac, scale=1 / 3, aux_weight=aw)
            spill.add("scaled", spill.put(model)[0], 3.0)
            if objective in OBJECTIVES:  # and the loss from the logits as the forward gives them, computed
                with torch.no_grad():  # outside autocast (where cross_entropy would run in float32)
                    with _autocast(ac):
                        out = _call(model, batch)
                        aux = routeraux.term(out, model, batch)
                    native += float(objective_of_logits(objective, _logits(out), batch, upcast=False)[0])
                    native += float(aux) * aw if aux is not None and aw is not None else 0.0
        if m == max(mm for rr, mm, _ in mbs if rr == r) and m > 0:  # each rank's last micro-batch (causes)
            spill.add("last", src)
        if r not in ranks:
            ranks.append(r)
        spill.add(("rank", r), src)
        rank_n[r] = rank_n.get(r, 0.0) + c
        rank_loss[r] = rank_loss.get(r, 0.0) + ls
        counts.setdefault(r, []).append(c)
        n_total += c
        loss_total += ls
        if c > 0:
            spill.add("micro_mean", src, 1.0 / c)
            micro_means.append(ls / c)
        if probe and rng_sensitive is None:  # the same micro-batch under another RNG state
            torch.random.default_generator.manual_seed(1)
            _backward(model, objective, batch, user, ac, aux_weight=aw)
            rng_sensitive = not spill.same(src, model)
        if i in sample:
            spill.add("exb", src)
            for row in _rows(batch):
                torch.random.default_generator.manual_seed(0)
                _backward(model, objective, row, user, ac, aux_weight=aw)
                spill.add("ex", spill.put(model)[0])
        model.zero_grad(set_to_none=True)
        undo()
    model = base
    merged = None
    if examples is not None:  # a judged step: its rows in as few forwards as memory allows (batchscope)
        merged = _global_forward(base, cast_models, rec, step, user, mbs,
                                 lambda mm: spill.add("gm", spill.put(mm)[0]), aw)
    for m_ in cast_models.values():
        m_.zero_grad(set_to_none=True)
    cast_models.clear()
    model.zero_grad(set_to_none=True)
    if n_total <= 0:
        raise ReferenceError(f"step {step}: the declared objective {objective!r} counts no tokens/examples in the "
                             "recorded micro-batches (every label -100?)")
    world = len(ranks)
    # exb is g itself where the sample is every micro-batch (the judge reads g then)
    exb = bool(sample) and len(sample) < len(mbs)
    gm_count = merged.get("count") if merged is not None else None

    class Outputs:
        """Every output of one tensor (rows a:b of it), the formulas of the module docstring."""

        def has(self, key: str, n: str) -> bool:
            def held(k):
                return any(n in spill.files[s] for s, _ in spill.terms.get(k, []))
            if key == "wa":
                return not rec.sketch and held("g")
            if key == "rank_mean":
                return any(rank_n[r] > 0 and held(("rank", r)) for r in ranks)
            if key == "gm":
                return bool(gm_count) and held("gm")
            if key in ("ex", "exb"):
                return bool(sample) and (key == "ex" or exb) and held(key)
            return held(key)

        def __call__(self, n: str, rows, only: str | None = None) -> dict[str, torch.Tensor]:
            """Every output of tensor n (rows a:b), or only the one named `only`: each source read once."""
            o: dict[str, torch.Tensor] = {}
            if n not in present and not (gm_count and spill.has("gm")):
                return o
            held: dict[int, torch.Tensor] = {}

            def val(key, n_, rows_):  # spill.value over this tensor's sources, each read (made float64) once
                if only is not None and key != only and not (only in ("wa", "rank_mean") and isinstance(key, tuple)):
                    return None
                acc = None
                for src, w in spill.terms.get(key, []):
                    f = spill.files[src]
                    if n_ in f:
                        if src not in held:
                            held[src] = (f[n_] if rows_ is None else f.rows(n_, *rows_)).double()
                        acc = (0 if acc is None else acc) + held[src] * w
                return acc

            g = val("g", n, rows)
            if g is not None:
                o["g"] = g / n_total
            gn = val("gn", n, rows) if spill.has("gn") else None
            if gn is not None:
                o["gn"] = gn
            mm = val("micro_mean", n, rows)
            if mm is not None:
                o["micro_mean"] = mm / max(len(micro_means), 1)
            wa, rm = None, None
            for r in ranks:  # sum_r |g_r| / T: what the bf16 wire rounds, element by element; where it is zero
                v = val(("rank", r), n, rows)  # no rank has gradient to reduce (the made-up gradient)
                if v is None:
                    continue
                if not rec.sketch:
                    wa = (0 if wa is None else wa) + v.abs() / n_total
                if rank_n[r] > 0:
                    rm = (0 if rm is None else rm) + v / rank_n[r] / world
            if wa is not None:
                o["wa"] = wa
            if rm is not None:
                o["rank_mean"] = rm
            # the sums normalised by their counts: the last micro-batches', the merged forward's, the rows'
            for key, count, wanted in (("last", n_total, True), ("gm", gm_count, bool(gm_count)),
                                       ("ex", n_total, bool(sample)), ("exb", n_total, bool(sample and exb))):
                v = val(key, n, rows) if wanted else None
                if v is not None:
                    o[key] = v / count
            return o

    outputs = Outputs()
    parts = _StepParts(spill, names, shapes, outputs,
                       ["g", "gn", "micro_mean", "rank_mean", "wa", "last", "gm", "ex", "exb"], {},
                       {k: alt_dtype for k in ("micro_mean", "rank_mean", "wa", "last", "gm", "ex", "exb")})
    # the norm and the precision floor: sums tensor by tensor, read back from the spilled sources
    total, sq, gnorm, total_n = 0, {}, {}, 0.0
    for n in names:
        if n not in present:
            continue
        acc_n, sq_n = 0, 0
        for rows in parts._ranges(n):
            g = spill.value("g", n, rows) / n_total
            acc_n = acc_n + (g * g).sum()
            gn = spill.value("gn", n, rows) if spill.has("gn") else None
            total_n += float(gn.square().sum()) if gn is not None else 0.0
            if spill.has("scaled"):
                s = spill.value("scaled", n, rows)
                if s is not None:
                    sq_n = sq_n + ((s / n_total - g) ** 2).sum()
        total = total + acc_n
        if spill.has("scaled"):
            gnorm[n] = float(acc_n.sqrt()) if len(list(parts._ranges(n))) > 1 else \
                float((spill.value("g", n) / n_total).norm())
        if spill.has("scaled") and any(n in spill.files[s] for s, _ in spill.terms["scaled"]):
            sq[n] = float(sq_n)
    norm = float(torch.sqrt(total)) if isinstance(total, torch.Tensor) else 0.0
    floor, floors = None, None
    if spill.has("scaled"):  # ||g(loss / 3) * 3 - g|| / ||g||: reduced-precision round-off alone, and per tensor
        floor = math.sqrt(sum(sq.values())) / norm if norm > 0 else 0.0
        floors = {n: math.sqrt(x) / max(gnorm[n], 1e-300) for n, x in sq.items()}
    info = {"loss": loss_total / n_total, "loss_sum": loss_total, "count": n_total,
            "loss_alt": {"micro_mean": sum(micro_means) / max(len(micro_means), 1),
                         "rank_mean": sum(rank_loss[r] / rank_n[r] for r in rank_loss if rank_n[r] > 0) / world,
                         "rank_local": [rank_loss[r] / rank_n[r] if rank_n[r] else None for r in sorted(rank_loss)]},
            "counts": [counts[r] for r in sorted(counts)], "no_grad": [n for n in names if n not in present],
            "norm": norm, "rng_sensitive": rng_sensitive, "precision_floor": floor, "precision_floor_tensors": floors,
            "low_precision_params": lowp,
            "loss_floor": (abs(native - loss_total) / max(abs(loss_total), 1e-30)
                           if floor is not None and objective in OBJECTIVES else None),
            "ex_micro": [[mbs[i][0], mbs[i][1]] for i in sorted(sample)], "merged": merged,
            "labels": _labels_source(mbs[0][2]) if objective in OBJECTIVES else None,
            "router_aux": routeraux.coef(base, mbs[0][2]) if aw is not None else None}
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    info["clip_coef"] = clip_coef(mgn, norm) if mgn > 0 else None
    info.update(norm_normalised=math.sqrt(total_n) if spill.has("gn") else None, sum_terms=len(mbs),
                partials=partials / n_total / norm if norm > 0 else 1.0, dot_length=dot_length,
                elements=sum(p.numel() for p in base.parameters() if p.requires_grad),
                split_products=bool(rec.meta.get("layout")))
    parts.info = info
    return parts, info


def probe_tensors(model, rec, k: int, user) -> dict[str, torch.Tensor]:
    """reference_probe on every DP replica leader's (every rank with micro-batches) first micro-batch
    of step k, at the model's current parameters: {"probe/RANK/" + the reference_probe names}."""
    objective = rec.meta["objective"]
    out: dict[str, torch.Tensor] = {}
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
        return out  # reduced precision: the probe's floors are float32's (the judge says it did not probe)
    if rec.meta.get("objective_scope") == "step":
        return out  # an objective over the whole step: no one micro-batch's gradient is the fleet's alone
    mbs = BS.forward_inputs(rec, k)
    aw = _aux_weight(objective, model, mbs)
    for r, m, batch in mbs:  # with the non-tensor arguments the forward got
        if m != 0 or rec.autocast(r, k, m) is not None or rec.compute_dtype(r, k, m) is not None:
            continue
        undo = _attrs(model, rec, r, k, m)  # the plain attributes this forward ran with
        try:
            torch.random.default_generator.manual_seed(0)
            got = probe.reference_probe(model, batch,
                                        lambda mm, b: objective_sum(objective, mm, b, user, aux_weight=aw)[0])
        finally:
            undo()
        out.update({f"probe/{r}/{n}": v for n, v in got.items()})
    return out


def _attrs(model, rec: A.RecordingSet, r: int, step: int, m: int):
    try:
        return BS.apply_attrs(model, BS.attr_changes_at(rec, r, step, m), rec.meta.get("attrs"))
    except DormouseError as e:
        raise ReferenceError(str(e)) from None


def _labels_source(batch: dict) -> str:
    """What the built-in objectives read as labels in this batch (see _labels)."""
    return next((k for k in (LOSS_LABELS, "labels", "input_ids", "arg0") if k in batch), "none")


def _global_forward(base, cast_models, rec: A.RecordingSet, step: int, user, mbs, add,
                    aux_weight: float | None = None) -> dict:
    """The declared objective's gradient over the step's rows merged into as
    few forwards as memory allows (batchscope.merge_plan), `add` called with
    the model holding each forward's gradient in p.grad: {"forwards", "rows", "words", "count"}, or
    {"error"} when a merged forward cannot be computed."""
    objective = rec.meta["objective"]
    extras = [json.dumps([rec.autocast(r, step, m), rec.compute_dtype(r, step, m),
                          BS.attr_changes_at(rec, r, step, m)], sort_keys=True, default=str) for r, m, _ in mbs]
    chunks, words = BS.merge_plan([b for _, _, b in mbs], extras)
    count = 0.0
    for c in chunks:
        r, m, _ = mbs[c[0]]
        ac, cast = rec.autocast(r, step, m), rec.compute_dtype(r, step, m)
        model = cast_models[cast] if cast is not None else base
        undo = _attrs(model, rec, r, step, m)
        torch.random.default_generator.manual_seed(0)
        try:
            _, n = _backward(model, objective, BS.merged([mbs[i][2] for i in c]), user, ac, aux_weight=aux_weight)
        except ReferenceError as e:
            model.zero_grad(set_to_none=True)
            return {"error": str(e), "words": words, "forwards": len(chunks)}
        finally:
            undo()
        add(model)  # the forward's gradient, in p.grad
        count += n
    model.zero_grad(set_to_none=True)
    return {"forwards": len(chunks), "words": words, "count": count,
            "rows": sum(next((v.shape[0] for v in b.values() if isinstance(v, torch.Tensor) and v.dim()), 0)
                        for _, _, b in mbs)}


def _step_scope_gradients(model, rec: A.RecordingSet, step: int, user, mbs, *, probe: bool,
                          lowp: list, alts: bool = True) -> tuple[dict, dict]:
    """objective_scope="step": fn(model, batches) over every rank's
    micro-batches of the step (rank then micro order), differentiated once
    (statistics over the global batch: load balancing over all-reduced
    routing statistics, in-batch negatives gathered from every rank)."""
    objective = rec.meta["objective"]
    names = [n for n, _ in model.named_parameters()]
    acs = {json.dumps(rec.autocast(r, step, m), sort_keys=True) for r, m, _ in mbs}
    if len(acs) > 1 or any(rec.compute_dtype(r, step, m) is not None for r, m, _ in mbs):
        raise ReferenceError(f"objective_scope='step': step {step}'s micro-batches ran under different autocasts or "
                             "on cast parameters, which one call of the objective over the whole step cannot "
                             "reproduce: record the run in one precision")
    changed = [(r, m) for r, m, _ in mbs if BS.attr_changes_at(rec, r, step, m)]
    if changed:
        raise ReferenceError(f"objective_scope='step': micro-batch {changed[0][1]} of rank {changed[0][0]} at step "
                             f"{step} ran with other model attributes ({BS.attr_changes_at(rec, step=step, r=changed[0][0], m=changed[0][1])})"
                             ", which one call of the objective over the whole step cannot set")
    ac = rec.autocast(mbs[0][0], step, mbs[0][1])
    batches = [b for _, _, b in mbs]

    def once(seed: int, scale: float = 1.0, part: list | None = None):
        model.zero_grad(set_to_none=True)
        torch.random.default_generator.manual_seed(seed)
        with _autocast(ac):
            try:
                ls, c = user(model, batches if part is None else part)
            except DormouseError:
                raise
            except Exception as e:
                raise ReferenceError(f"objective {objective!r} (objective_scope='step') failed on step {step}'s "
                                     f"micro-batches ({type(e).__name__}: {e})")
        if not isinstance(ls, torch.Tensor) or not ls.requires_grad:
            raise ReferenceError(f"objective {objective!r} gives a loss with no gradient: it must be computed from "
                                 "the model's outputs")
        (ls * scale if scale != 1.0 else ls).backward()
        return float(ls.detach()), float(c), {n: (p.grad.detach().clone() if p.grad is not None else None)
                                              for n, p in model.named_parameters()}

    ls, c, grads = once(0)
    if c <= 0:
        raise ReferenceError(f"step {step}: the declared objective {objective!r} counts no tokens/examples")
    g = {n: grads[n].double() / c for n in names if grads.get(n) is not None}
    rng_sensitive = None
    if probe:
        _, _, again = once(1)
        rng_sensitive = any((a is None) != (b is None) or (a is not None and not torch.equal(a, b))
                            for a, b in zip(grads.values(), again.values()))
    norm = float(torch.sqrt(sum((v * v).sum() for v in g.values())))
    floor, floors = None, None
    if lowp or ac is not None:  # the precision floor: the same gradient through the loss / 3
        _, _, g3 = once(0, 1 / 3)
        sq = {n: float(((g3[n].double() * 3 / c - v) ** 2).sum()) for n, v in g.items() if g3.get(n) is not None}
        floor = math.sqrt(sum(sq.values())) / norm if norm > 0 else 0.0
        floors = {n: math.sqrt(x) / max(float(g[n].norm()), 1e-300) for n, x in sq.items()}
    fwd = _per_forward_moe(model, mbs, ac)
    model.zero_grad(set_to_none=True)
    ranks = sorted({r for r, _, _ in mbs})
    # beside it, each rank's micro-batches alone, their objectives averaged ("rank_mean": statistics over each
    # rank's own rows, e.g. routing counts not reduced over the ranks), so that the judge can name that split
    rank_mean: dict[str, torch.Tensor] = {}
    try:
        for r in ranks if len(ranks) > 1 and alts else []:  # at judged steps
            _, cr, gr = once(0, part=[b for rr, _, b in mbs if rr == r])
            for n in names:
                if gr.get(n) is not None and cr > 0:
                    rank_mean[n] = rank_mean.get(n, 0) + gr[n].double() / (cr * len(ranks))
    except DormouseError:  # an objective that needs the whole step: no alternative to name, the check unchanged
        rank_mean = {}
    model.zero_grad(set_to_none=True)
    info = {"loss": ls / c, "loss_sum": ls, "count": c,
            "loss_alt": {"micro_mean": None, "rank_mean": None, "rank_local": []},
            "counts": [[None for rr, _, _ in mbs if rr == r] for r in ranks],
            "no_grad": [n for n in names if n not in g], "norm": norm, "rng_sensitive": rng_sensitive,
            "precision_floor": floor, "precision_floor_tensors": floors, "low_precision_params": lowp,
            "loss_floor": None, "ex_micro": [], "merged": None, "labels": None, "scope": "step"}
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    info["clip_coef"] = clip_coef(mgn, norm) if mgn > 0 else None
    return {"g": g, "micro_mean": {}, "rank_mean": rank_mean, **({"fwd": fwd} if fwd else {})}, info


def _per_forward_moe(model, mbs, ac) -> dict:
    """Beside a step-scoped objective, for a transformers MoE model that adds its
    own load-balancing term (routeraux): the causal LM loss with that term over
    each forward's own routing statistics, as the fleet split the step (what the
    model and HF's Trainer compute), the judge's name for a fleet that computes
    per forward what the declaration computes over the step. {} otherwise."""
    aw = _aux_weight("causal_lm", model, mbs)
    if aw is None or not aw:
        return {}
    acc: dict = {}
    try:
        for _, _, b in mbs:
            _, _, grads = _grads(model, "causal_lm", b, None, ac, aux_weight=aw)
            for n, v in grads.items():
                if v is not None:
                    acc[n] = acc.get(n, 0) + v.double()
    except ReferenceError:
        return {}
    return {n: v / aw for n, v in acc.items()}


# --------------------------------------------------------------------------- the reference as a whole


def _load_params(model, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> None:
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
    path = rec.meta.get("buffer_update")
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
        out = fn(model, batches, **rec.meta.get("build_kwargs", {}))
    except DormouseError:
        raise
    except Exception as e:
        raise ReferenceError(f"buffer_update {path!r} failed at step {k} ({type(e).__name__}: {e})")
    if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise ReferenceError(f"buffer_update {path!r} returned a {type(out).__name__}, not a dict of buffer name to "
                             "tensor")
    return {n: v.detach().cpu().clone() for n, v in out.items()}


def _sketched(tensors: dict[str, torch.Tensor], numel: dict[str, int], seed: int, sketcher: Sketcher):
    for n in tensors:
        if n not in sketcher.buckets:
            sketcher.buckets[n] = sketch_buckets(n, numel[n], sketcher.k, seed)
    return sketcher(tensors)


def _train_step(model, opt, sched, grads: dict, mgn: float, *, clipped: bool) -> None:
    """One optimizer step on the given gradients (None where absent), clipped
    by the global norm max_grad_norm unless they already were."""
    for n, p in model.named_parameters():  # each taken out of `grads` as it is copied (read lazily: one at a time)
        p.grad = grads.pop(n).to(p.dtype, copy=True) if n in grads else None
    if mgn > 0 and not clipped:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], mgn)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)


def _trim() -> None:
    """The heap's freed memory back to the system between steps (glibc's malloc_trim; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _write_params(path: Path, model, prefix: str) -> None:
    """The model's parameters as they stand, "prefix + name", written straight from them (no copy)."""
    from dormouse.gate.artifacts.tensorfile import write_streamed

    held = [(prefix + n, p.detach()) for n, p in model.named_parameters()]
    write_streamed(path, [(k, v.dtype, tuple(v.shape)) for k, v in held], iter(held))


def _make_replayed(out, rec: A.RecordingSet, model, user, log) -> Path:
    """The reference of a recording in full tensors at every step, in two
    passes over one model, so that its memory is one model, its gradient and
    the optimizer's state (never two models, never a step's alternatives in
    memory): first the replay (the user's optimizer on the recorded
    gradients, from the initial state; the parameters before each step
    written as they stand, "rp/", to their own file), then, the optimizer
    freed, the gradients at each step's recorded parameters
    (step_gradient_parts: spilled micro-batch by micro-batch, combined tensor
    by tensor into the step's file; the alternatives that only name causes in
    float32), the probe and the buffer rule beside them."""
    from dormouse.gate.artifacts.tensorfile import write_streamed

    opt, sched = build_optimizer(rec, model)
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    scan = _scan(model)
    tensor_steps = set(rec.tensor_steps())
    rule, rule_text = buffer_rule(rec)
    log(f"reference for {out}: {len(rec.steps)} steps, mode replay")
    lrs = {}
    for k in rec.steps:  # the replay
        lrs[k] = opt.param_groups[0]["lr"]
        _write_params(A.reference_replay_tensors_path(out, k), model, "rp/")
        _train_step(model, opt, sched, rec.tensors_at(k, "g/"), mgn, clipped=rec.step_meta(0, k).get("clipped", False))
    _write_params(A.reference_final_path(out), model, "rp/")
    scheduled = sched is not None
    del opt, sched  # the optimizer's state: not held through the gradients' pass
    _trim()
    done: list[int] = []  # the tensor steps so far (their count picks fact 1's sample)
    for i, k in enumerate(rec.steps):  # the gradients, at the recorded parameters
        _load_params(model, rec.tensors_at(k, "p/"), rec.tensors_at(k, "b/"))
        set_modes(model, rec.eval_modules(k))
        want = k in tensor_steps
        parts, info = step_gradient_parts(model, rec, k, user, examples=len(done) if want else None,
                                          probe=(i == 0), alt_dtype=torch.float32)
        extra: dict[str, torch.Tensor] = {}
        if probe.is_probe_step(rec, k):  # the probe's one-process side, at the recorded parameters
            extra.update(probe_tensors(model, rec, k, user))
        if rule is not None:  # after the gradients: the rule may move the buffers (reloaded each step)
            extra.update({f"bu/{n}": v for n, v in updated_buffers(rule, rec.meta["buffer_update"], model,
                                                                    rec, k).items()})
        done.extend([k] if want else [])
        info.update({"step": k, "replay_lr": lrs[k], "mode": "replay", **scan})
        path = A.reference_step_tensors_path(out, k)
        if not want:
            if isinstance(parts, _StepParts):
                parts.spill.close()
            parts = {}
        if isinstance(parts, _StepParts):
            parts.write(path, extra)
        else:
            held = [(f"{key}/{n}", v) for key, d in parts.items() for n, v in d.items()] + list(extra.items())
            write_streamed(path, [(key, v.dtype, tuple(v.shape)) for key, v in held], iter(held))
        atomic.write_text(A.reference_step_meta_path(out, k), json.dumps(info, indent=1))
        _trim()
    meta = {"schema": REFERENCE_SCHEMA, "kind": "reference", "key": staleness_key(rec), "run": rec.run,
            "mode": "replay", "steps": rec.steps, "scheduler": scheduled,
            "buffer_rule": rule_text if rule is not None else None, **scan}
    return atomic.write_text(A.reference_meta_path(out), json.dumps(meta, indent=1))


def make_reference(out, *, log=print, force: bool = False) -> Path:
    """Write <out>/reference/ for the recording in `out` (skipped when current)."""
    rec = A.RecordingSet(out)
    rec.validate()
    if not force and is_current(out):
        return A.reference_meta_path(out)
    check_provenance(rec)
    user = import_path(rec.meta["objective"], "objective") if rec.meta["objective"] not in OBJECTIVES else None
    for stale in A.reference_dir(out).glob("*.replay.safetensors"):  # another reference's replay: never read
        stale.unlink()
    model = rebuild(rec)
    set_modes(model, rec.eval_modules(rec.steps[0]) if rec.steps else [])
    replay = rec.sketch == 0 and rec.every == 1
    if replay:
        return _make_replayed(out, rec, model, user, log)
    probe_model = copy_module(model) if replay else model
    opt, sched = build_optimizer(rec, model)
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    numel = {n: p.numel() for n, p in model.named_parameters()}
    sketcher = Sketcher(rec.sketch)
    scan = _scan(model)
    tensor_steps = set(rec.tensor_steps())
    mode = "replay" if replay else "run"
    nudged = None
    if not replay:  # the run's own floor: the same run from an initial state one ulp away
        nudged = copy_module(model)
        with torch.no_grad():
            for p in nudged.parameters():
                if p.is_floating_point():
                    p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
        nopt, nsched = build_optimizer(rec, nudged)
    rule, rule_text = buffer_rule(rec)
    rule = rule if replay else None  # the recorded buffers before every step: full tensors at every step
    log(f"reference for {out}: {len(rec.steps)} steps, mode {mode}")
    done: list[int] = []  # the tensor steps so far (their count picks fact 1's sample)
    for i, k in enumerate(rec.steps):
        tensors: dict[str, torch.Tensor] = {}
        lr = opt.param_groups[0]["lr"]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if replay:
            _load_params(probe_model, rec.tensors_at(k, "p/"), rec.tensors_at(k, "b/"))
            gmodel = probe_model
        else:
            gmodel = model
        want = k in tensor_steps
        for m in (gmodel, nudged) if nudged is not None else (gmodel,):
            set_modes(m, rec.eval_modules(k))
        ref, info = step_gradients(gmodel, rec, k, user, examples=len(done) if want else None, probe=(i == 0))
        if probe.is_probe_step(rec, k) and (replay or i == 0):  # the probe's one-process side, at the
            # recorded parameters (a run's own reference parts from them after its first step): record/probe.py
            tensors.update(probe_tensors(gmodel, rec, k, user))
        if rule is not None:  # after the gradients: the rule may move the probe's buffers (reloaded each step)
            tensors.update({f"bu/{n}": v for n, v in updated_buffers(rule, rec.meta["buffer_update"], probe_model,
                                                                      rec, k).items()})
        done.extend([k] if want else [])
        if nudged is not None:
            nbefore = {n: p.detach().clone() for n, p in nudged.named_parameters()}
            nref, ninfo = step_gradients(nudged, rec, k, user, examples=None, probe=False)
            info["nudged_loss"] = ninfo["loss"]
            _train_step(nudged, nopt, nsched, {n: v.float() for n, v in nref["g"].items()}, mgn, clipped=False)
            if want:
                ref = {**ref, "ng": nref["g"], "np": nbefore}
        info.update({"step": k, "replay_lr": lr, "mode": mode, **scan})
        if want:
            if rec.sketch:
                for key, d in (("rp", before), *ref.items()):
                    tensors.update({f"{key}/{n}": v for n, v in _sketched(d, numel, rec.seed, sketcher).items()})
            else:
                tensors.update({f"rp/{n}": v for n, v in before.items()})
                for key, d in ref.items():
                    tensors.update({f"{key}/{n}": v for n, v in d.items()})
        # the step: recorded gradients (replay) or the declared objective's (run)
        if replay:
            grads = rec.tensors_at(k, "g/")
            clipped = rec.step_meta(0, k).get("clipped", False)
        else:
            grads = {n: v.float() for n, v in ref["g"].items()}
            clipped = False
        _train_step(model, opt, sched, grads, mgn, clipped=clipped)
        atomic.write_bytes(A.reference_step_tensors_path(out, k), st_save({k2: v.contiguous() for k2, v in
                                                                           tensors.items()}))
        atomic.write_text(A.reference_step_meta_path(out, k), json.dumps(info, indent=1))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rec.sketch:
        final = _sketched(final, numel, rec.seed, sketcher)
    atomic.write_bytes(A.reference_final_path(out), st_save({f"rp/{n}": v for n, v in final.items()}))
    meta = {"schema": REFERENCE_SCHEMA, "kind": "reference", "key": staleness_key(rec), "run": rec.run,
            "mode": mode, "steps": rec.steps, "scheduler": sched is not None,
            "buffer_rule": rule_text if rule is not None else None, **scan}
    return atomic.write_text(A.reference_meta_path(out), json.dumps(meta, indent=1))
