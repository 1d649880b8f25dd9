"""Where the benchmarks write: artifacts/ at the repository root, found from the package's location."""

from __future__ import annotations

from pathlib import Path

import dormouse


def repo_root() -> Path:
    return Path(dormouse.__file__).resolve().parents[1]


def artifacts_dir() -> Path:
    return repo_root() / "artifacts"
