"""Writing and hashing: the gate's JSON references, atomically; the package's source hash and the one file hasher every
provenance uses."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path


from dormouse import atomic
from dormouse.gate.artifacts.layout import GATE_SCHEMA


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the dormouse package's Python source, file by file in path order."""
    import dormouse

    root = Path(dormouse.__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def file_hash(path) -> str:
    """sha256 of a file (a corpus): the whole file up to 256 MiB; beyond, its
    size and its first and last MiB. The one file hasher of every provenance
    and of a recording's example corpus."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        if size <= 256 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()


def write_gate_json(path: Path, meta: dict) -> Path:
    """One of the gate's JSON references (gradref.json, floor.json), atomically, with its schema."""
    return atomic.write_text(Path(path), json.dumps({"schema": GATE_SCHEMA, **meta}, indent=1))


def file_digest(paths: list[Path]) -> str:
    """sha256 over the bytes of files, in the order given (each its folder's
    and its own name, then its bytes, read in blocks)."""
    h = hashlib.sha256()
    for p in map(Path, paths):
        h.update(f"{p.parent.name}/{p.name}".encode())
        if not p.exists():
            h.update(b"-")
            continue
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
