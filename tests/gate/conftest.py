"""The gate tests' session fixture: one run of the whole pipeline at the
defaults, shared by every test file that reads a default gate (the notebooks'
tests, tests/gate/catches/test_own_fleet_faults.py's default fleet)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dormouse import atomic
from dormouse.gate.record import produce
from dormouse.gate.settings import DEFAULT_OUT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def gate_run(tmp_path_factory):
    """The whole pipeline at the defaults from a directory that is not the
    repository: `cd elsewhere && python -m dormouse.gate.pipeline --out <tmp>`.
    Run once per session even under xdist: the workers share it through a
    flock. Read it, or work on gatekit.copy_of its out dir."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's directory, shared by its workers
    base = root / "notebook-pipeline"
    cwd, out, result = base / "elsewhere", base / "out", base / "result.json"
    with produce.locked(base, "fixture"):
        if not result.exists():
            cwd.mkdir(parents=True)
            r = subprocess.run([sys.executable, "-m", "dormouse.gate.pipeline", "--quiet", "--out", str(out)],
                               cwd=cwd, capture_output=True, text=True, env=ENV, timeout=500)
            atomic.write_text(result, json.dumps({"returncode": r.returncode, "stdout": r.stdout,
                                                  "stderr": r.stderr}))
    r = subprocess.CompletedProcess([], **json.loads(result.read_text()))
    if r.returncode != 0:
        pytest.fail(f"the pipeline failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    _offer_to_the_notebooks(out)
    return r, cwd, out


def _offer_to_the_notebooks(out: Path) -> None:
    """When the repository has no default gate yet (a fresh clone), this run
    becomes it: the same settings and code that nbmake's notebooks run at
    their defaults, so they find every set up to date and present it instead
    of producing it a second time (their producing is this pipeline's run,
    tested here). Moved in whole (a sibling copy renamed into place), and only
    where nothing is: a gate the notebooks or a user already started is left
    alone."""
    if DEFAULT_OUT.exists():
        return
    DEFAULT_OUT.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=".gate-", dir=DEFAULT_OUT.parent))
    try:
        shutil.copytree(out, part, dirs_exist_ok=True, ignore=shutil.ignore_patterns("notebooks", ".*.lock"))
        os.rename(part, DEFAULT_OUT)  # fails if the notebooks made it meanwhile: theirs stands
    except OSError:
        pass
    finally:
        shutil.rmtree(part, ignore_errors=True)
