"""The user's functions a recording names by import path (build_model,
build_optimizer, an objective, a buffer update): importing them with one
clear message, and hashing their code (the recording's provenance)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
from pathlib import Path

from dormouse.gate.record.options import RecorderError


def import_path(path: str, what: str):
    """The object an import path "pkg.mod:name" names, or one line saying why not."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise RecorderError(f"{what} {path!r} is not an import path: write it as 'package.module:function'")
    mod, name = path.split(":")
    try:
        module = importlib.import_module(mod)
    except Exception as e:
        raise RecorderError(f"{what} {path!r} does not load: importing {mod!r} failed ({type(e).__name__}: {e}); "
                            "put its package on PYTHONPATH") from None
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise RecorderError(f"{what} {path!r} does not load: {mod!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def objective_fn(path: str, build_kwargs: dict | None):
    """The user's objective at `path`, given the recording's build_kwargs that it names as keyword
    parameters (all of them where it takes **kwargs), as build_model is: a DPO objective's frozen reference
    is the initial model, built with the run's seed. Called as fn(model, batch) (or fn(model, batches))."""
    fn = import_path(path, "objective")
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]  # past (model, batch)
    except (TypeError, ValueError):  # a builtin or a callable without a signature: called as it is
        return fn
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    every = any(p.kind is p.VAR_KEYWORD for p in params)
    kw = {k: v for k, v in (build_kwargs or {}).items() if every or k in named}
    return functools.partial(fn, **kw) if kw else fn


def code_hashes(paths: list[str]) -> dict[str, str]:
    """sha256 of the source file of each import path's module (the user's code
    the references will run), without importing it."""
    out = {}
    for p in paths:
        if not isinstance(p, str) or ":" not in p:
            continue
        mod = p.split(":")[0]
        try:
            spec = importlib.util.find_spec(mod)
        except Exception:
            spec = None
        origin = getattr(spec, "origin", None)
        if origin and Path(origin).is_file():
            out[mod] = hashlib.sha256(Path(origin).read_bytes()).hexdigest()
        else:
            out[mod] = ""
    return out
