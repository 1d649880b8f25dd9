"""`torchrun --nproc_per_node N -m dormouse gate check --out DIR` (issue 38): the one-process reference
computed past one process, the model sharded by FSDP2 over N gloo ranks and every backward's full
gradient summed in float64 by dormouse (record/reference/sharded.py), never by FSDP2's
reduce-scatter. On recordings of a block LM (tests/support/blocklm.py: layers in a ModuleList, each
an FSDP2 unit, and a tied head), clean and with the mean of micro-batch means, the sharded check on
2 and on 4 ranks prints the one-process verdict (every check's outcome and sentence, the figures in
them too: PASS, and FAIL for the same named cause), rank 0 alone, and writes the one-process
reference's tensors bitwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import blocklm
import pytest
import torch
from looprec import ROOT, SUPPORT, agent_imports

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts.tensorfile import LazyTensors
from dormouse.gate.judge.entry import judge_recording
from dormouse.gate.record.launcher import torchrun
from dormouse.gate.record.reference import make_reference

# imported once by torchrun's agent, before it forks the ranks (FSDP2's import is most of a rank's start)
PRELOAD = ("torch.distributed.fsdp", "torch.distributed.tensor", "dormouse.gate.record.reference.sharded",
           "dormouse.gate.judge.entry")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """{name: (its recording, judged with the one-process reference in a copy of its own)}."""
    root = tmp_path_factory.mktemp("sharded")
    out = {}
    for name, fault in (("clean", False), ("micro_mean", True)):
        blocklm.record(root / name, micro_mean=fault)
        one = root / f"{name}-one"
        shutil.copytree(root / name, one)
        make_reference(one, log=lambda line: None)
        out[name] = (root / name, one, judge_recording(one))
    return out


def _sharded_check(rec, world: int, tmp_path):
    out = tmp_path / f"{rec.name}-{world}"
    shutil.copytree(rec, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(SUPPORT)])}
    cmd = agent_imports(torchrun(["-m", "dormouse", "gate", "check", "--out", str(out)], world=world), PRELOAD)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=SUPPORT)
    return out, done


def _same_reference(one, sharded) -> None:
    """Every reference file holds the same tensors, bitwise, and the same step infos."""
    files = sorted(p.name for p in A.reference_dir(one).glob("*.safetensors"))
    assert files and files == sorted(p.name for p in A.reference_dir(sharded).glob("*.safetensors"))
    for name in files:
        a = LazyTensors([A.reference_dir(one) / name], "one process's")
        b = LazyTensors([A.reference_dir(sharded) / name], "the sharded")
        assert sorted(a) == sorted(b), name
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, (name, unequal[:5])
    for k in json.loads(A.reference_meta_path(one).read_text())["steps"]:
        assert (json.loads(A.reference_step_meta_path(one, k).read_text())
                == json.loads(A.reference_step_meta_path(sharded, k).read_text()))


def _checks(v) -> list[tuple]:
    return [(n, c["pass"], c["reason"]) for n, c in v["checks"].items() if n != "sharded"]


@pytest.mark.parametrize("name, world", [("clean", 2), ("micro_mean", 4)])
def test_the_sharded_check_gives_the_one_process_verdict_and_reference(recorded, name, world, tmp_path):
    rec, one, verdict = recorded[name]
    out, done = _sharded_check(rec, world, tmp_path)
    assert done.returncode == (0 if verdict.passed else 1), done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("gate verdict for") == 1, done.stdout  # rank 0 alone
    assert f": {'PASS' if verdict.passed else 'FAIL'}" in done.stdout.splitlines()[0]
    assert f"sharded: the one-process reference was computed by {world} ranks" in done.stdout
    sharded = json.loads((out / "verdict.json").read_text())
    assert _checks(sharded) == _checks(verdict.to_dict())
    if not verdict.passed:  # the fault, named
        assert "mean of per-micro-batch token means" in verdict.check("gradient").reason
    _same_reference(one, out)
