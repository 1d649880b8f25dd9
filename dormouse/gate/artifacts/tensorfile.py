"""Tensor files read one tensor at a time and written as a stream: what keeps
the check's memory set by the model, not by the recording (issue 38).

LazyTensors is a mapping over one or more safetensors files that reads a
tensor only when asked for it (safetensors maps it from the file: nothing is
read until used, and nothing is kept once the caller drops it), so a reader
that walks a step's tensors holds one at a time. write_streamed writes a
safetensors file from a list of (key, dtype, shape) and the tensors (or
row-ranges of them) produced in that order, without ever holding the file
in memory: the header first, then each tensor's bytes as they come.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable, Iterator

import torch

from dormouse import atomic
from dormouse.errors import DormouseError

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


_NAMES = {name: dtype for dtype, name in _DTYPES.items()}


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (JSON) and where its data starts."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


class LazyTensors(Mapping):
    """The tensors of safetensors files by key, each read when asked (a later
    file's key replaces an earlier one's). Raises DormouseError (one line)
    when a file is missing or unreadable."""

    def __init__(self, paths: Iterable[Path], what: str):
        self.what = what
        self._where: dict[str, tuple[str, torch.dtype, list[int], int, int]] = {}  # path, dtype, shape, bytes
        self.metadata: dict = {}
        for path in paths:
            path = Path(path)
            if not path.exists():
                raise DormouseError(f"{what} {str(path)!r} is missing: the recording is incomplete (a rank crashed?)")
            try:
                header, base = _header(path)
            except Exception as e:
                raise DormouseError(f"{what} {str(path)!r} cannot be read ({e}): re-record") from e
            self.metadata.update(header.pop("__metadata__", None) or {})
            for key, h in header.items():
                a, b = h["data_offsets"]
                self._where[key] = (str(path), _NAMES[h["dtype"]], list(h["shape"]), base + a, base + b)

    def _read(self, key: str, start: int, stop: int, shape: list[int]) -> torch.Tensor:
        """Bytes start:stop of the file that holds `key`, as a tensor of its dtype and `shape` (one copy,
        read with plain file I/O: nothing of the file stays mapped once the caller drops the tensor)."""
        path, dtype = self._where[key][:2]
        out = torch.empty(stop - start, dtype=torch.uint8)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                got = f.readinto(out.numpy()) if stop > start else 0
        except OSError as e:
            raise DormouseError(f"{self.what} {path!r} cannot be read ({e}): re-record") from e
        if got != stop - start:
            raise DormouseError(f"{self.what} {path!r} cannot be read (it ends inside {key!r}): re-record")
        return out.view(dtype).reshape(shape)

    def __getitem__(self, key: str) -> torch.Tensor:
        path, dtype, shape, a, b = self._where[key]
        return self._read(key, a, b, shape)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor (its first dimension), read alone."""
        path, dtype, shape, a, b = self._where[key]
        start, stop = max(0, min(start, shape[0])), max(0, min(stop, shape[0]))
        stop = max(start, stop)
        row = (b - a) // shape[0] if shape[0] else 0
        return self._read(key, a + start * row, a + stop * row, [stop - start, *shape[1:]])

    def shape(self, key: str) -> list[int]:
        return list(self._where[key][2])

    def __contains__(self, key) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def prefixed(self, prefix: str) -> dict[str, torch.Tensor]:
        """{name: tensor} of the keys "prefix + name" (read now: the caller holds them)."""
        return {k[len(prefix):]: self[k] for k in self._where if k.startswith(prefix)}


def write_streamed(path, spec: list[tuple[str, torch.dtype, tuple]], pieces: Iterable[tuple[str, torch.Tensor]],
                   metadata: dict | None = None, *, durable: bool = True, sync: bool = True) -> Path:
    """A safetensors file at `path` (atomically) holding spec's tensors, in
    spec's order, from `pieces`: (key, tensor) in the same order, a tensor
    given whole or as consecutive row ranges (of its first dimension) that
    together make it. Only one piece is in memory at a time. durable=False
    (scratch) writes in place without the fsync; sync=False renames without
    the fsync (atomic.write's sync)."""
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}} if metadata else {}
    offset, sizes = 0, {}
    for key, dtype, shape in spec:
        n = 1
        for s in shape:
            n *= int(s)
        size = n * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [offset, offset + size]}
        sizes[key] = (dtype, size)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            order = iter(spec)
            want, left = None, 0
            for key, t in pieces:
                if left == 0:
                    want = next(order)[0]
                    while sizes[want][1] == 0 and want != key:  # an empty tensor needs no piece
                        want = next(order)[0]
                    left = sizes[want][1]
                if key != want:
                    raise RuntimeError(f"write_streamed: piece {key!r} where {want!r} was due")
                t = t.detach().to(sizes[key][0]).contiguous().cpu()
                data = t.reshape(-1).view(torch.uint8).numpy()
                if data.size > left:
                    raise RuntimeError(f"write_streamed: {key!r} is larger than its shape")
                f.write(data)
                left -= data.size
            if left or any(sizes[k][1] for k, _, _ in order):
                raise RuntimeError("write_streamed: pieces ended before the spec did")
            f.flush()

    if not durable:  # a scratch file: no rename, no fsync
        write(Path(path))
        return Path(path)
    return atomic._atomic(path, write, sync=sync)


def remove(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
