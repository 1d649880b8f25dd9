"""Pure functions of tensors every layer may use: their raw bytes and a
fingerprint of a set of them (what provenance and the ranks check compare)."""

from __future__ import annotations

import hashlib

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor of any dtype (bfloat16 included)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def window_digest(values: list[int]) -> str:
    """A token window's identity (gradref.json, and the judge's reading of the fleet's windows): the sha256
    of its T + 1 byte values."""
    return hashlib.sha256(bytes(values)).hexdigest()


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())  # tensor_bytes' bytes, hashed in place
    return h.hexdigest()
