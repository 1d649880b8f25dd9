"""docs/your-loop.md's quick start followed as a user would: the plain DDP
example (examples/quickstart/ddp_train.py), copied as it stands into a folder
of its own, launched there with `torchrun --standalone --nproc_per_node=2
ddp_train.py`, then `dormouse gate check --out runs/ddp` from the same folder
through the installed console script (nothing added to PYTHONPATH): it
passes. The TRL, PEFT and DPO recipes of docs/clients/hf.md (sft_train.py,
peft_train.py, dpo_train.py) run the same way here, each its own fleet (marked
slow: `pytest -m slow`). Their
HF twin (hf_train.py) runs the same way (`RUN_HF_QUICKSTART=1` adds it here);
the suite's HF Trainer runs are tests/gate/catches/test_hf_trainer.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "quickstart"
CONSOLE = Path(sys.prefix) / "bin" / "dormouse"  # the installed console script (sys.executable may be a warm client)


def _user_env() -> dict:
    """The user's shell: no PYTHONPATH of the test suite's, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1"}


TRL = importlib.util.find_spec("trl") is not None and importlib.util.find_spec("peft") is not None
QUICKSTARTS = [("ddp_train.py", "runs/ddp")]
# The TRL scripts are slow (outside CI's time, which a slow hour of a 2-core machine pressed to 8 minutes):
# CI's trl rows hold SFT, LoRA and DPO with the real trainers and hand-computed gradients, and
# tests/test_docs.py holds the page's excerpts to these files; `pytest -m slow` runs them
QUICKSTARTS += [pytest.param(f"{name}_train.py", f"runs/{name}", marks=pytest.mark.slow)
                for name in ("sft", "peft", "dpo")] if TRL else []
QUICKSTARTS += [("hf_train.py", "runs/hf")] if os.environ.get("RUN_HF_QUICKSTART") else []
# the accelerate and Lightning recipes of docs/clients/ on two ranks (tests/test_docs.py runs accelerate's
# in one process and checks both pages' blocks against these files): RUN_ALL_QUICKSTARTS=1
if os.environ.get("RUN_ALL_QUICKSTARTS"):
    QUICKSTARTS += [("hf_train.py", "runs/hf")] * (not os.environ.get("RUN_HF_QUICKSTART")) + [
        ("accelerate_train.py", "runs/accelerate"), ("lightning_train.py", "runs/lightning")]


@pytest.mark.parametrize("script, out", QUICKSTARTS)
def test_the_quick_start_script_trains_on_two_ranks_and_its_recording_passes_the_check(tmp_path, script, out):
    pytest.importorskip("transformers") if script == "hf_train.py" else None
    for f in EXAMPLES.glob("*.py"):  # accelerate_train.py and lightning_train.py import ddp_train.py's builders
        shutil.copy(f, tmp_path / f.name)
    train = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            script], cwd=tmp_path, env=_user_env(), capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    check = subprocess.run([str(CONSOLE), "gate", "check", "--out", out], cwd=tmp_path, env=_user_env(),
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "PASS" in check.stdout, check.stdout[-3000:] + check.stderr[-2000:]
    if script == "ddp_train.py":  # recorded with the in-run checks (selfcheck=64): the reduction judged too
        assert "[ok] reduction: on 64 sampled elements per tensor" in check.stdout, check.stdout[-3000:]
