"""Running whole gates in tests: real torchrun fleets and the in-process
references, optionally with a fault from fleet_faults.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dormouse.gate.record import modes
from dormouse.gate.record.reference import make_reference
from dormouse.gate.judge.entry import judge
from dormouse.gate.judge.verdict import Verdict
from dormouse.gate.record.launcher import launch_plan
from dormouse.gate.settings import GateSettings

SUPPORT = Path(__file__).resolve().parent  # tests/support: rank scripts and fault plants
FAULTS = str(SUPPORT / "fleet_faults.py")
QUIET = lambda line: None  # noqa: E731


# The tests' fleets fork their ranks from torchrun's agent (launcher.FORKED_RANKS):
# torch imported once a launch, not once a rank. Their subject is the judge and
# the fleet's mathematics, not per-interpreter state; the gate's default (an
# interpreter per rank) runs in the pipeline, the notebooks, the seed's recipe
# and tests/gate/record/test_launcher.py, which shows what only it sees.
FORK_RANKS = True


def fleets(plan: list[GateSettings]) -> None:
    """The clean fleet runs of `plan` (dormouse.gate's own entry point), in as
    few torchrun launches as their world sizes allow (launcher.launches)."""
    launch_plan(plan, timeout_s=400, stream=QUIET, fork_ranks=FORK_RANKS)


def faulty_fleets(runs: list[tuple[GateSettings, str | None]], *, fork_ranks: bool = FORK_RANKS,
                  cold: bool = False) -> None:
    """Fleets each with its own fault (None: clean), in as few torchrun
    launches as their world sizes allow: each fault acts on its run only
    (fleet_faults.scoped), as if the run had a launch of its own. cold: the
    agent and its ranks fresh interpreters even in the suite (warm.py)."""
    table = {str(s.out_dir): fault for s, fault in runs}
    assert len(table) == len(runs), "two runs of the plan share an out dir"
    launch_plan([s for s, _ in runs], timeout_s=600, stream=QUIET, entry=[FAULTS],
                env={"DORMOUSE_TEST_FAULTS": json.dumps(table), **({"DORMOUSE_TEST_WARM": "0"} if cold else {})},
                fork_ranks=fork_ranks)


def references(s: GateSettings, fault: str | None = None, *, single: bool = True) -> None:
    """single (when the profile has one global batch), then gradref and the
    recording's one-process reference of the fleet already in s.out; with a
    fault, all in a process of their own with the fault injected (for faults
    in the network itself)."""
    names = (["single"] if single and s.plan.global_batch is not None else []) + ["gradref", "reference"]
    if fault:  # all of them in one process of their own (one start-up), the fault injected
        env = {**os.environ, "DORMOUSE_TEST_FAULT": fault, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, FAULTS, ",".join(names), *s.to_argv()], env=env, capture_output=True,
                              text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return
    for mode in names:
        if mode == "reference":
            make_reference(s.out_dir, log=QUIET)
        else:
            modes.MODES[mode](s, log=QUIET)


def judged(s: GateSettings, fault: str | None = None) -> Verdict:
    """The references of the fleet already in s.out (with `fault` injected:
    for faults in the network itself), then the verdict on it against s."""
    references(s, fault)
    return judge(s.out_dir, s)


def copy_of(clean: Path, to: Path) -> Path:
    """A clean run's artifacts (not its notebooks, checkpoints, figures or
    verdict), hard-linked: every writer replaces files atomically (a new
    inode), so the run copied is never touched."""
    shutil.copytree(clean, to, copy_function=os.link,
                    ignore=shutil.ignore_patterns("notebooks", "ckpts", ".*.lock", "*.png", "verdict.json"))
    return to


def edit_tensors(path: Path, fn) -> None:
    """Rewrite one safetensors file (atomically: a copy_of's hard links are never written through) after
    fn(tensors) changed it in place (its metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save

    from dormouse import atomic

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fn(tensors)
    atomic.write_bytes(path, save(tensors, metadata=meta))


def edit_json(path: Path, fn) -> None:
    """Rewrite a JSON file (atomically) after fn(d) changed it in place."""
    from dormouse import atomic

    d = json.loads(path.read_text())
    fn(d)
    atomic.write_text(path, json.dumps(d))
