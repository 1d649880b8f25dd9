"""`dormouse gate check` as a new user meets it (issue 27): the training
script's folder is the working directory and its builders live in the script.
The check imports them as `python -m` would (the working directory on
sys.path, which the console script does not put there: `python -P` runs it
the same way), says an import failure is one, ends quietly when its reader
closes the pipe, and refuses a recording that the import rewrote (a script
that trains at its top level)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from looprec import ROOT, SUPPORT

SCRIPT = '''import sys
sys.path.insert(0, {support!r})
import torch
import torch.nn.functional as F
from loopmodel import build_model, build_optimizer, collate, dataset  # this script's builders

from dormouse.gate import Recorder, RecordingSpec


def train():
    model = build_model(seed=0)
    opt, sched = build_optimizer(model)
    rec = Recorder({out!r}, model, RecordingSpec(build_model="{name}:build_model",
                                                 build_optimizer="{name}:build_optimizer", objective="causal_lm",
                                                 build_kwargs={{"seed": 0}}, dataset_len=8))
    data = dataset(8, 0)
    for s in range(2):
        batch = collate(data[4 * s:4 * s + 4])
        logits = model(**batch)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100)
        loss.backward()
        rec.step(loss=loss, optimizer=opt)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    rec.close()


{call}
'''


def _script(where: Path, name: str, guarded: bool) -> Path:
    """A training script in `where` recording into where/<name>-rec; guarded: `if __name__ == "__main__":`."""
    path = where / f"{name}.py"
    call = 'if __name__ == "__main__":\n    train()' if guarded else "train()  # at the top level"
    path.write_text(SCRIPT.format(support=str(SUPPORT), out=str(where / f"{name}-rec"), name=name, call=call))
    sys.path.insert(0, str(where))  # the user's `python name.py`: its folder first on sys.path
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.path.remove(str(where))
        sys.modules.pop(name, None)
    return where / f"{name}-rec"


def _check_cli(cwd: Path, out: Path) -> subprocess.Popen:
    """`dormouse gate check --out OUT` from `cwd`, its sys.path as the console script's (python -P: no cwd)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-P", "-m", "dormouse", "gate", "check", "--out", str(out)], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("userdir")
    _script(where, "guarded", True)
    return where


def test_check_imports_the_builders_from_the_working_directory_and_a_closed_pipe_is_quiet(scripts):
    p = _check_cli(scripts, scripts / "guarded-rec")
    first = p.stdout.readline()  # `| head -1`
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 0, err
    assert first.startswith("gate verdict for") and first.rstrip().endswith("PASS"), (first, err)
    assert "crash" not in err and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_module_that_does_not_import_says_so(scripts, tmp_path, monkeypatch, capsys):
    from dormouse.__main__ import main

    monkeypatch.chdir(tmp_path)  # not the script's folder: nothing there to import
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(scripts))])
    assert main(["gate", "check", "--out", str(scripts / "guarded-rec"), "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "module 'guarded' does not import from here (ModuleNotFoundError" in err[0], err
    assert "changed" not in err[0]


def test_a_recording_rewritten_by_importing_the_builders_is_refused(scripts):
    out = _script(scripts, "unguarded", False)
    p = _check_cli(scripts, out)
    got, err = p.communicate(timeout=300)
    assert p.returncode == 2, (got, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "was rewritten while it was judged" in line, err
    assert 'if __name__ == "__main__":' in line


def test_a_check_past_its_memory_budget_is_not_judged_and_says_what_it_needs(scripts, monkeypatch, capsys):
    from loopmodel import build_model

    from dormouse.__main__ import main

    monkeypatch.chdir(scripts)
    monkeypatch.syspath_prepend(str(scripts))
    assert main(["gate", "check", "--out", str(scripts / "guarded-rec"), "--force", "--memory", "0.01"]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "not judged: needs" in ln)
    need = float(line.split("not judged: needs ", 1)[1].split(" GB", 1)[0])
    # the test's own count: the model's float32 parameters, six times (model, gradient, two moments, a read step)
    params = sum(p.numel() for p in build_model(seed=0).parameters()) * 4
    assert need >= 6 * params / (1 << 30) * 0.99 and "the budget is 0.01 GB" in line, line
    assert out.splitlines()[0].rstrip().endswith("FAIL"), out


def test_the_check_asks_torch_for_huge_pages_unless_the_user_chose(monkeypatch):
    """`gate check` sets torch's THP_MEM_ALLOC_ENABLE before its first allocation (its time at size went
    to page faults), never once torch is imported (it would not take, and the heap's rule reads it as
    taken); a value the user set stands."""
    from dormouse.gate.__main__ import huge_pages

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    huge_pages()  # torch is imported in this process: too late to take
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ
    monkeypatch.delitem(sys.modules, "torch")
    huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
