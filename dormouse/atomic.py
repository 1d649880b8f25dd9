"""Atomic file writes: a reader sees the old file or the new one, never half.

Each write goes to a temporary file in the same directory (same filesystem),
is flushed to disk, and is then renamed over the target with os.replace, which
POSIX makes atomic. A process killed mid-write leaves at most a hidden
`.<name>.tmp-<pid>` file behind, never a truncated target.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def _atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return _atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode())


def torch_save(obj: Any, path: str | os.PathLike) -> Path:
    import torch

    return _atomic(path, lambda tmp: torch.save(obj, tmp))


def check_writable(directory: str | os.PathLike) -> Path:
    """Create `directory` if needed and prove a file can be written there;
    raises OSError (with its strerror) when it cannot."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    probe = d / f".write-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
    return d
