"""Atomic file writes: a reader sees the old file or the new one, never half.

Each write goes to a temporary file in the same directory (same filesystem),
is flushed to disk, and is then renamed over the target with os.replace, which
POSIX makes atomic. A process killed mid-write leaves at most a hidden
`.<name>.tmp-*` file behind, never a truncated target.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable


_UMASK = os.umask(0)
os.umask(_UMASK)


def _atomic(path: str | os.PathLike, write: Callable[[Path], None], sync: bool = True) -> Path:
    """write(tmp), then tmp renamed over `path`; sync=False skips the fsync (the
    rename still never shows a half-written file to a reader or after a killed
    process; only an operating-system crash can lose what the page cache held)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name in the same directory: two writers (two ranks, or two
    # hosts on a shared filesystem) never share a temporary file.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual mode
    try:
        write(tmp)
        if sync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_if_changed(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` atomically unless the file already holds exactly it (so
    concurrent writers of the same bytes never disturb a reader)."""
    path = Path(path)
    if not (path.exists() and path.read_bytes() == data):
        write_bytes(path, data)
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
