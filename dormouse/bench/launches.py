"""The sections that launch processes: the 2-rank fleet against torch DDP and
the 4-rank exact reduce (one torchrun launch of dormouse.bench.fleet each),
and the fixed costs of a launch."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dormouse.bench.stepper import SHAPES
from dormouse.gate.record.launcher import torchrun

# (is 4 ranks, quick) -> (rounds, timed steps per train() call); each call adds one untimed step.
FLEET_ROUNDS = {(False, True): (3, 1), (False, False): (5, 2), (True, True): (2, 1), (True, False): (4, 1)}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(args: list[str], world: int = 2, *, forked: bool = True) -> list[str]:
    """bench_fleet under torchrun: its ranks forked from the agent
    (launcher.torchrun; what is timed is inside the ranks), or (forked=False)
    a fresh interpreter per rank, as the gate and a plain `torchrun -m` start them."""
    return torchrun(["-m", "dormouse.bench.fleet", *args], world=world, forked=forked)


def _run(cmd: list[str], timeout: float, cwd: Path | None = None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                          cwd=str(cwd) if cwd else None)
    return time.perf_counter() - t0, proc


def bench_fleet(quick: bool, tmp: Path, log, *, world: int = 2, kinds: str = "ours,ddp,both,solo",
                micro_batch: int = 0, name: str = "fleet") -> dict:
    """One torchrun launch of bench_fleet: `kinds` alternating for some
    rounds, each kind's train() call one untimed and `steps` timed steps (see
    FLEET_ROUNDS)."""
    rounds, steps = FLEET_ROUNDS[(world > 2, quick)]
    out = tmp / f"{name}.json"
    b, t = SHAPES["small"]
    cmd = _torchrun(["--mode", "compare", "--out", str(out), "--preset", "small", "--batch", str(b),
                     "--seq-len", str(t), "--rounds", str(rounds), "--steps", str(steps), "--warmup", "1",
                     "--kinds", kinds, "--micro-batch", str(micro_batch)], world)
    wall, proc = _run(cmd, timeout=1200)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{name} bench failed (exit {proc.returncode}): {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    res = json.loads(out.read_text())
    res["launch_wall_s"] = wall
    res["command"] = " ".join(cmd[1:]).replace(str(out), "<out>")
    return res


def bench_launch(quick: bool, tmp: Path) -> dict:
    reps = 1 if quick else 3
    bare = [_run([sys.executable, "-c", "pass"], 60)[0] for _ in range(reps)]
    imp = [_run([sys.executable, "-c", "import torch"], 120)[0] for _ in range(reps)]
    rdzv, rdzv_exec, inner = [], [], []
    for i in range(1 if quick else 2):  # the two ways of starting ranks, alternating
        for forked, walls in ((True, rdzv), (False, rdzv_exec)):
            out = tmp / f"rdzv{i}_{forked}.json"
            wall, proc = _run(_torchrun(["--mode", "rendezvous", "--out", str(out)], forked=forked), 120)
            if proc.returncode != 0:
                raise RuntimeError(f"rendezvous launch failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
            walls.append(wall)
            inner.append(json.loads(out.read_text()))
    return {
        "python_bare_s": statistics.median(bare),
        "import_torch_s": statistics.median(imp),
        "torchrun_rendezvous_s": statistics.median(rdzv),
        "torchrun_rendezvous_exec_s": statistics.median(rdzv_exec),
        "rank_init_and_barrier_s": statistics.median(x["init_and_barrier_s"] for x in inner),
        "reps": {"import_torch": len(imp), "torchrun_rendezvous": len(rdzv)},
    }
