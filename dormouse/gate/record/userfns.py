"""The user's functions a recording names by import path (build_model,
build_optimizer, an objective, a buffer update): importing them with one
clear message, and hashing their code (the recording's provenance)."""

from __future__ import annotations

import hashlib
import importlib.util
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
