"""The rebuild: the user's model (checked bitwise against the recorded initial state), as the loop
ran it, its optimizer and scheduler, and the code that rebuilds them checked against the recorded."""

from __future__ import annotations

import importlib

import torch

from dormouse.errors import DormouseError
from dormouse.numerics import same_value
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record.layouts import equal_shards
from dormouse.gate.record.userfns import code_hashes, import_path
from dormouse.gate.record.reference.error import ReferenceError


def _wrapped_hint(built: set[str], recorded: set[str]) -> str:
    """Why the names differ, where at least half the names of one side are the other's under one
    prefix: the loop's model was wrapped after build_model (PEFT's `peft_config=` does it inside TRL's
    trainers, as `get_peft_model` does: names under "base_model.model.", the adapted layers renamed)."""
    for inner, outer, who in ((built, recorded, "the loop"), (recorded, built, "build_model")):
        under: dict[str, int] = {}
        for o in outer:
            for at in (i + 1 for i, c in enumerate(o) if c == "."):
                if o[at:] in inner:
                    under[o[:at]] = under.get(o[:at], 0) + 1
        pre = max(under, key=under.get, default=None)
        if pre and 2 * under[pre] >= len(inner):
            peft = (" (PEFT: a trainer's peft_config= wraps the model; wrap it in build_model with "
                    "get_peft_model and give the trainer the wrapped model)") if pre == "base_model.model." else ""
            return f"; {who} wrapped the model (its names are the other's under {pre!r}){peft}"
    return ""


def rebuild(rec: A.RecordingSet):
    """The user's model (checked against the recorded initial state), optimizer and scheduler."""
    spec = rec.spec
    kw = spec.build_kwargs
    fn = import_path(spec.build_model, "build_model")
    try:
        model = fn(**kw)
    except Exception as e:
        raise ReferenceError(f"build_model {spec.build_model!r}(**{kw}) failed ({type(e).__name__}: {e})")
    if not isinstance(model, torch.nn.Module):
        raise ReferenceError(f"build_model {spec.build_model!r} returned a {type(model).__name__}, not a module")
    init = rec.init()
    state = model.state_dict()
    if set(state) != set(init):
        extra, missing = sorted(set(state) - set(init)), sorted(set(init) - set(state))
        raise ReferenceError(f"build_model {spec.build_model!r} builds other tensors than the recording's "
                             f"(not recorded: {extra[:3]}, not built: {missing[:3]}): it must build the loop's model"
                             + _wrapped_hint(set(state), set(init)))
    for n in sorted(init):
        a, b = state[n].detach().cpu(), init[n]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            apart = A.ranks_apart_from(rec, state)
            if apart:
                raise ReferenceError(apart)
            pattern = (((rec.recorded.layout or {}).get("params") or {}).get(n) or {}).get("pattern")
            if pattern and a.shape == b.shape and a.dtype == b.dtype:  # assembled by a declared sharding (declared.py)
                raise ReferenceError(f"build_model {spec.build_model!r} builds {n} other than the recorded initial "
                                     f"one, which the declared sharding {pattern!r} assembled from its ranks' pieces: "
                                     "if every rank built build_model's model, the group's ranks are declared in "
                                     "another order than the pieces concatenate in (or along another dim)")
            # the first differing tensor may have no layout entry (a state_dict key split from a fused
            # parameter, as torchtitan's wqkv into wq, wk, wv): any differing parameter's equal shards tell
            why = next((w for m in sorted(init) if m in state and not torch.equal(state[m].detach().cpu(), init[m])
                        and (w := equal_shards(rec.recorded.layout, m, init[m]))), None)
            raise ReferenceError(f"build_model {spec.build_model!r} builds parameters that differ from the "
                                 f"recorded initial ones (first: {n}): " + (why or "seed it as the loop does"))
    _as_recorded(model, rec.recorded, _start_attrs(rec))
    return model


def _start_attrs(rec: A.RecordingSet) -> dict | None:
    """The plain attributes the rebuilt model starts with: rank 0's where the ranks run one model; a
    pipeline's stages are other modules of it, so there each stage's, less those two stages hold with
    other values (a stage's own role: the whole model is neither stage)."""
    if not (rec.recorded.layout or {}).get("pipeline"):
        return rec.recorded.attrs
    k = rec.steps[0]
    starts = [rec.step_meta(r, k).get("attrs_start") or {} for r in range(rec.world_at(k))]
    merged: dict = {}
    apart: set = set()
    for got in starts:
        for path, d in got.items():
            for name, v in d.items():
                mine = merged.setdefault(path, {})
                if name in mine and not same_value(mine[name], v):
                    apart.add((path, name))
                mine.setdefault(name, v)
    return {path: {n: v for n, v in d.items() if (path, n) not in apart} for path, d in merged.items()}


def _as_recorded(model, recorded: A.RecordedRun, attrs: dict | None) -> None:
    """The rebuilt model as the loop ran it, beyond its tensors: the
    parameters the loop froze (requires_grad False) and, for a transformers
    model, the scalar config fields the loop's model had (the Trainer sets
    use_cache = False at its start, and GPT-2 masks packed sequences only
    then), and the modules' plain attributes the loop had set when the
    Recorder started (batchscope.start_attrs); build_model need not repeat
    what the training script did."""
    try:
        BS.start_attrs(model, attrs)
    except DormouseError as e:
        raise ReferenceError(str(e)) from None
    frozen = set(recorded.frozen)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    config, cfg = recorded.hf_config, getattr(model, "config", None)
    if config and cfg is not None and hasattr(cfg, "to_dict"):
        now = cfg.to_dict()
        for k, v in config.items():
            if k in now and now[k] != v:
                try:
                    setattr(cfg, k, v)
                except (AttributeError, TypeError, ValueError):  # a derived field: not the loop's to set
                    pass


def is_optimizer(opt) -> bool:
    """What the replay steps: step(), zero_grad(), param_groups[0]["lr"] read (a
    torch.optim.Optimizer has them all; an optimizer of one's own may, without torch's base class)."""
    return callable(getattr(opt, "step", None)) and callable(getattr(opt, "zero_grad", None)) and \
        isinstance(getattr(opt, "param_groups", None), list) and bool(opt.param_groups) and \
        isinstance(opt.param_groups[0], dict) and "lr" in opt.param_groups[0]


def build_optimizer(rec: A.RecordingSet, model):
    spec = rec.spec
    fn = import_path(spec.build_optimizer, "build_optimizer")
    try:
        built = fn(model, **spec.build_kwargs)
    except Exception as e:
        raise ReferenceError(f"build_optimizer {spec.build_optimizer!r} failed ({type(e).__name__}: {e})")
    opt, sched = built if isinstance(built, (tuple, list)) else (built, None)
    if not is_optimizer(opt):
        raise ReferenceError(f"build_optimizer {spec.build_optimizer!r} returned no optimizer (an object with "
                             f"step(), zero_grad() and a param_groups list, as torch.optim.Optimizer has; it "
                             f"returned a {type(opt).__name__})")
    return opt, sched


def check_provenance(rec: A.RecordingSet) -> None:
    """The code that would rebuild the run is the code that recorded it."""
    prov = rec.recorded.provenance
    if prov.get("torch") != torch.__version__:
        raise ReferenceError(f"the recording was made with torch {prov.get('torch')}, this is {torch.__version__}:"
                             " judge it where it was recorded")
    s = rec.spec
    now = code_hashes([s.build_model, s.build_optimizer, s.objective])
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
