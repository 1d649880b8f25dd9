"""The gate's cost and sensitivity, measured.

`pipeline_timing`: the tiny pipeline as a user runs it, timed from outside
(seconds to the printed verdict, and to the end), and each of its parts alone.

`sensitivity`:  the smallest gradient perturbation on ONE
rank at ONE step that the verdict catches.

A ladder of fleets (one torchrun launch, a plan) each multiplies rank 1's local
gradient at step `STEP` by (1 + eps * xi), xi ~ N(0, 1) per element (seeded),
before the reduce; every other step and rank is clean. Each fleet is judged
with the full set of references (single, gradref, the recording's own); the figure is the
smallest eps whose verdict fails, with the check that failed.

    python -m dormouse.bench.gate            # prints the ladder, writes nothing
    (python -m dormouse.bench runs it and records it in bench.json)

The perturbation lives here, in the benchmark's own rank entry point, not in
the library's training path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

EPS = (1e-2, 1e-3, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 1e-7)
STEP = 3  # the perturbed step (1-based)
ENV = "DORMOUSE_BENCH_PERTURB"  # JSON {out dir: eps} for the rank entry point


def _install_perturbation() -> None:
    """Inside a rank: perturb rank 1's local gradient at STEP, through the
    loop's explicit hook after the local gradient (dormouse.train.hooks), by
    the eps of the fleet run the rank trains (told by the modes' run seam,
    modes.install_run_hook)."""
    from dormouse.train.hooks import Hooks, install

    table = json.loads(os.environ[ENV])
    state = {"eps": None}

    def perturbed(piece):  # one bucket's views, in bucket order: one seeded draw per bucket, as flattened
        eps = state["eps"]
        if eps and piece.rank == 1 and piece.step == STEP:
            n = sum(g.numel() for g in piece.grads.values())
            noise = torch.randn(n, generator=torch.Generator().manual_seed(STEP))
            at = 0
            for g in piece.grads.values():
                g.mul_(1 + eps * noise[at:at + g.numel()].view(g.shape).to(g))
                at += g.numel()

    install(Hooks(on_local_grads=[perturbed]))
    from dormouse.gate.record.modes import install_run_hook

    def this_fleet(s, run):  # which fleet run of the plan this rank now trains: its eps
        if run.train.dist:
            state["eps"] = table.get(str(s.out_dir))

    install_run_hook(this_fleet)


def sensitivity(log=print, eps=EPS, steps: int = 6) -> dict:
    """The ladder: per eps, pass or fail and the first failing check. The
    fleets run every step at their 2 ranks (resume_world 0): a fleet that
    stopped and resumed at one rank would have no rank 1 at STEP when the
    stop falls before it (4 steps stop after step 2), and nothing would be
    perturbed."""
    if steps < STEP:
        raise ValueError(f"the sensitivity perturbs step {STEP}: give steps >= {STEP}, not {steps}")
    from dormouse.gate.artifacts import FLOOR, SINGLE, gate_reference_path, reference_dir
    from dormouse.gate.judge.entry import judge
    from dormouse.gate.record import modes
    from dormouse.gate.record.launcher import launch_plan
    from dormouse.gate.record.reference import make_reference
    from dormouse.gate.settings import GateSettings

    rows = []
    with tempfile.TemporaryDirectory(prefix="dormouse-sensitivity-") as tmp:
        plan = [GateSettings(out=str(Path(tmp) / f"e{i}"), steps=steps, resume_world=0).validate()
                for i in range(len(eps))]
        table = {str(s.out_dir): e for s, e in zip(plan, eps)}
        log(f"sensitivity: {len(plan)} fleets of profile {plan[0].profile!r}, eps {eps[0]:g} .. {eps[-1]:g}")
        launch_plan(plan, timeout_s=900, stream=lambda line: None, entry=["-m", "dormouse.bench.gate"],
                    env={ENV: json.dumps(table)})
        modes.run_single(plan[0], log=lambda line: None)
        for s, e in zip(plan, eps):
            if s is not plan[0]:  # the same one-process references: single, its floor (same settings)
                mine, theirs = reference_dir(plan[0].out_dir), reference_dir(s.out_dir)
                theirs.mkdir(parents=True, exist_ok=True)
                shutil.copytree(mine / SINGLE, theirs / SINGLE)
                shutil.copy(gate_reference_path(plan[0].out_dir, FLOOR), gate_reference_path(s.out_dir, FLOOR))
            modes.run_gradref(s, log=lambda line: None)
            make_reference(s.out_dir, log=lambda line: None)
            v = judge(s.out_dir, s)
            failed = [c.name for c in v.checks if not c.passed]
            gradient = v.check("gradient")
            rows.append({"eps": e, "caught": not v.passed, "failed": failed,
                         "gradient_worst": getattr(gradient, "worst", None)})
            log(f"  eps {e:8.1e}: {'CAUGHT by ' + ', '.join(failed) if failed else 'passed'}"
                f" (gradient worst {rows[-1]['gradient_worst']})")
    caught = [r["eps"] for r in rows if r["caught"]]
    return {"step": STEP, "rank": 1, "profile": plan[0].profile, "ladder": rows,
            "smallest_caught": min(caught) if caught else None,
            "largest_passed": max((r["eps"] for r in rows if not r["caught"]), default=None)}


def pipeline_timing(log=print) -> dict:
    """`python -m dormouse.gate.pipeline --quiet` on the tiny fixture in a fresh
    out dir, timed from outside: seconds until the verdict is printed and until
    the process ends (the four notebooks presented). Then each part alone, in
    this process, in another fresh out dir: the single run with its floors, the
    fleet (its torchrun launches), gradref, the replay, the judge, and one
    notebook's kernel on fresh artifacts (04: start-up, imports, tables, figures).
    The fleet's parts: gradref, and the recording's one-process reference."""
    import subprocess
    import time

    from dormouse.gate.judge.entry import judge
    from dormouse.gate.record import modes, produce
    from dormouse.gate.record.reference import make_reference
    from dormouse.gate.settings import GateSettings

    res: dict = {}
    quiet = lambda line: None  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="dormouse-pipeline-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "dormouse.gate.pipeline", "--quiet", "--out",
                                 str(Path(tmp) / "whole")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=tmp)
        verdict_at, tail = None, []
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-5:]
            if verdict_at is None and line.startswith("gate verdict for"):
                verdict_at = time.perf_counter() - t0
        rc = proc.wait()
        res["pipeline_verdict_s"], res["pipeline_wall_s"], res["pipeline_exit"] = verdict_at, \
            time.perf_counter() - t0, rc
        if rc not in (0, 1):
            res["pipeline_tail"] = tail
        log(f"  pipeline: verdict after {verdict_at or float('nan'):.1f} s, done after {res['pipeline_wall_s']:.1f} s")
        s = GateSettings(out=str(Path(tmp) / "parts")).validate()
        parts = {}

        def timed(name, fn):
            t = time.perf_counter()
            fn()
            parts[name] = time.perf_counter() - t

        timed("single_and_floors", lambda: produce.run_single(s, log=quiet))
        timed("fleet", lambda: produce.run_fleet(s, stream=quiet))
        timed("gradref", lambda: modes.run_gradref(s, log=quiet))
        timed("reference", lambda: make_reference(s.out_dir, log=quiet, force=True))
        timed("judge", lambda: judge(s.out_dir, s))
        try:
            import papermill as pm

            from dormouse.gate.pipeline import NOTEBOOK_DIR

            timed("notebook_04_on_fresh_artifacts", lambda: pm.execute_notebook(
                str(NOTEBOOK_DIR / "04_compare_plots.ipynb"), str(Path(tmp) / "04.ipynb"),
                parameters={"out": str(s.out_dir)}, kernel_name="python3", progress_bar=False))
        except ImportError:
            parts["notebook_04_on_fresh_artifacts"] = None
        res["parts_s"] = parts
        log("  parts: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items() if v is not None))
    return res


if __name__ == "__main__":
    if os.environ.get(ENV) and "RANK" in os.environ:
        _install_perturbation()
        from dormouse.gate.__main__ import main

        sys.exit(main())
    torch.set_num_threads(1)
    res = sensitivity()
    print(json.dumps({k: v for k, v in res.items() if k != "ladder"}))
