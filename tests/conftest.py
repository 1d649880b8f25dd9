"""Shared fixtures of the unit tests: one torch thread (the CI box has two
cores and runs two pytest workers), and the small corpora the loop tests train on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# tests/support/ (the gate kit, fault plants, rank scripts) is importable from every test folder.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    torch.set_num_threads(1)
    yield


@pytest.fixture
def cyclic_corpus(tmp_path: Path) -> Path:
    """bytes 0..15 repeated: perfectly predictable after one cycle (4800 bytes)."""
    path = tmp_path / "cyclic.bin"
    path.write_bytes(bytes(range(16)) * 300)
    return path
