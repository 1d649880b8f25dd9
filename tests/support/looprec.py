"""Recording tests' kit: ddp_loop.py's runs under one real torchrun launch
(2 gloo ranks), and the verdict of a recording (reference made in this process,
then judged), cached per directory: the tests of tests/gate/catches share it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from dormouse.gate.record.launcher import torchrun

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
QUIET = lambda line: None  # noqa: E731


def launch(plan: list[dict], where: Path, script: str = "ddp_loop.py", world: int = 2) -> None:
    """Every run of `plan` (ddp_loop.RUN dicts), one after another, in ONE torchrun launch."""
    path = where / f"plan{len(list(where.glob('plan*.json')))}.json"
    path.write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(torchrun([str(SUPPORT / script), "--plan", str(path)], world=world), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def launched(root: Path, runs: dict[str, dict], script: str, world: int) -> dict[str, Path]:
    """`runs` ({name: the client's run dict}) in ONE torchrun launch of `script`, each recorded into
    root/<name>; returns each run's directory."""
    launch([{**cfg, "out": str(root / n)} for n, cfg in runs.items()], root, script=script, world=world)
    return {n: root / n for n in runs}



def launched_fixture(name: str, runs: dict[str, dict], script: str, world: int):
    """A module-scoped pytest fixture `name`: `launched(...)` of `runs` once for the test file."""
    import pytest

    def fixture(tmp_path_factory) -> dict[str, Path]:
        return launched(tmp_path_factory.mktemp(name), runs, script, world)

    return pytest.fixture(scope="module", name=name)(fixture)

def agent_imports(cmd: list[str], modules: tuple[str, ...]) -> list[str]:
    """torchrun's command `cmd` (launcher.torchrun, its ranks forked from the agent) with `modules`
    imported by the agent before it starts: every rank is forked with them imported, as if its script
    had imported them first, and the fleet pays a framework's import once instead of once per rank."""
    i = cmd.index("torch.distributed.run")
    assert cmd[i - 1] == "-m" and "--run-path" in cmd, cmd
    # gc.freeze: the collector of a forked rank never walks (and so never copies) the imported modules' objects
    code = (f"import {', '.join(modules)}; import gc, runpy; gc.freeze(); "
            "runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)")
    return [*cmd[:i - 1], "-c", code, *cmd[i + 1:]]


def launch_client(script: str, runs: list[str], out: Path, world: int = 2, preload: tuple[str, ...] = (),
                  **env: str) -> Path:
    """A framework client (hf_client.py, lightning_client.py, trl_client.py): its runs `runs` ("name:k=v...")
    in ONE torchrun launch, each recorded into out/<name>; `preload`: the framework's modules, imported
    once by torchrun's agent before it forks the ranks (agent_imports); `env`: more variables for it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env,
           "PYTHONPATH": os.pathsep.join(p for p in (str(SUPPORT), os.environ.get("PYTHONPATH")) if p)}
    cmd = torchrun([str(SUPPORT / script), "--out", str(out), *runs], world=world)
    done = subprocess.run(agent_imports(cmd, preload) if preload else cmd, env=env,
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


_VERDICTS: dict = {}


def verdict(out: Path):
    """The verdict on the recording in `out` (its reference made first)."""
    from dormouse.gate.judge.entry import judge_recording
    from dormouse.gate.record.reference import make_reference

    key = str(out)
    if key not in _VERDICTS:
        make_reference(out, log=QUIET)
        _VERDICTS[key] = judge_recording(out)
    return _VERDICTS[key]


def recorded_gradients(out: Path, rank: int, step: int = 1) -> dict:
    """Rank `rank`'s recorded (full, assembled) gradients at `step`, read straight from its file."""
    from dormouse.gate import artifacts as A

    t, _ = A.read_tensors(A.step_tensors_path(out, rank, step), "step tensors")
    return {n[2:]: v for n, v in t.items() if n.startswith("g/")}


def rel(a, b) -> float:
    """L2 relative difference of tensor `a` from `b`, in float64 (the tests' own arithmetic, not the judge's)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def worst(got: dict, want: dict, factor: float = 1.0) -> float:
    """The largest `rel` over `want`'s tensors of `got` from `factor` times `want`."""
    return max(rel(got[n], factor * want[n]) for n in want)


def fails_for(v, check: str, words: str) -> None:
    """The verdict fails, its `check` fails, and that check's reason says `words`."""
    c = v.check(check)
    assert not v.passed and not c.passed, c.reason
    assert words in c.reason, c.reason


def checks(v) -> dict:
    """The verdict's checks by name."""
    return {c.name: c for c in v.checks}


def failed(v) -> set[str]:
    """The names of the failing checks."""
    return {c.name for c in v.checks if not c.passed}


def failing(v) -> str:
    """The failing checks' reasons, one a line."""
    return "\n".join(f"{c.name}: {c.reason}" for c in v.checks if not c.passed)


def one_process(out: Path, *, objective: str = "causal_lm", seed: int = 7, steps: int = 2, n: int = 8,
                dataset_len: int | None = None, order: list[list[int]] | None = None) -> Path:
    """A one-process recording (world 1, no torch.distributed) of loopmodel's
    TinyLM: `steps` steps of 4 rows each (step s reads rows order[s], by
    default 4s..4s+3 of n), AdamW + LambdaLR, the global token mean
    backpropagated (the loop right: its gate passes). dataset_len: what the
    Recorder is told (default n)."""
    import torch

    from dormouse.gate import Recorder, RecordingSpec
    from loopmodel import build_model, build_optimizer, collate, dataset

    model = build_model(seed=seed)
    opt, sched = build_optimizer(model)
    rec = Recorder(out, model, RecordingSpec(build_model="loopmodel:build_model",
                                             build_optimizer="loopmodel:build_optimizer", objective=objective,
                                             build_kwargs={"seed": seed},
                                             dataset_len=n if dataset_len is None else dataset_len))
    data = dataset(n, 0)
    order = order or [list(range(4 * s, 4 * s + 4)) for s in range(steps)]
    for s in range(steps):
        batch = collate([data[i] for i in order[s]])
        logits = model(**batch)
        y = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        rec.step(loss=loss, optimizer=opt)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    rec.close()
    return Path(out)
