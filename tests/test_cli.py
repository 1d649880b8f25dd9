"""`python -m dormouse train`: help, a short run on the built-in corpus, and
bad input reported in one line with exit status 2 and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dormouse.__main__ import main


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "dormouse", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_train_help_explains_the_options(tmp_path):
    proc = _cli("train", "--help", cwd=tmp_path)
    assert proc.returncode == 0
    for option in ("--preset", "--data", "--steps", "--batch", "--seq-len", "--lr", "--out-dir",
                   "--ckpt-every", "--resume", "--set"):
        assert option in proc.stdout, option
    assert "tiny" in proc.stdout and "small" in proc.stdout  # the preset choices
    assert "built-in corpus" in proc.stdout


def test_train_tiny_for_three_steps_on_the_builtin_corpus(tmp_path):
    out = tmp_path / "run"
    proc = _cli("train", "--preset", "tiny", "--steps", "3", "--out-dir", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("dormouse: preset=tiny") and "data=built-in" in lines[0]
    assert any(line.startswith("step=3/3 ") and "loss=" in line for line in lines)
    assert lines[-1].startswith("done: final loss")
    assert (out / "dormouse.pt").is_file() and (out / "builtin_corpus.bin").is_file()
    assert len((out / "dormouse.metrics.jsonl").read_text().splitlines()) == 1


# The three bad inputs run as real processes (a traceback would only show
# there), started together so their interpreter start-ups overlap.
BAD_INPUTS = {
    "missing_data": lambda d: ["--data", str(d / "nope.txt")],
    "unknown_opt": lambda d: ["--set", "opt=sgd"],
    "empty_corpus": lambda d: ["--data", str(d / "empty.txt")],
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_bytes(b"")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {}
    for name, extra in BAD_INPUTS.items():
        args = [sys.executable, "-m", "dormouse", "train", "--steps", "1", "--out-dir", str(d / name), *extra(d)]
        procs[name] = (args, subprocess.Popen(args, cwd=d, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
    done = {}
    for name, (args, proc) in procs.items():
        out, err = proc.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(args, proc.returncode, out, err)
    return done


def test_missing_data_file_is_one_error_line_and_status_2(bad_runs):
    _assert_one_line_error(bad_runs["missing_data"], "nope.txt", "does not exist")


def test_unknown_optimizer_is_one_error_line_and_status_2(bad_runs):
    _assert_one_line_error(bad_runs["unknown_opt"], "opt", "'sgd'", "'mix'", "'adamw'")


def test_empty_corpus_file_is_one_error_line_and_status_2(bad_runs):
    _assert_one_line_error(bad_runs["empty_corpus"], "empty.txt", "empty")


@pytest.mark.parametrize("args, fragment", [
    (["--set", "steps=two"], "steps"),
    (["--set", "no_such_field=1"], "no_such_field"),
    (["--set", "opt"], "field=value"),
    (["--seq-len", "65"], "max_seq_len"),
    (["--set", "eval_every=5"], "eval_frac"),
])
def test_other_bad_input_returns_2_with_one_error_line(tmp_path, capsys, args, fragment):
    code = main(["train", "--steps", "1", "--out-dir", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--steps", "abc"], "--steps"),
    (["train", "--preset", "huge"], "huge"),
    (["train", "--threads", "0"], "--threads"),
    ([], "command"),
])
def test_usage_errors_are_one_error_line_and_status_2(capsys, argv, fragment):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err


def test_set_parses_typed_values(tmp_path, capsys):
    code = main(["train", "--steps", "2", "--batch", "2", "--seq-len", "16", "--out-dir", str(tmp_path / "o"),
                 "--set", "opt=adamw", "--set", "muon_nesterov=false", "--set", "wd=0.01", "--set", "log_every=1"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("loss=") == 2
    meta = json.loads(torch.load(tmp_path / "o" / "dormouse.pt", weights_only=True)["meta"])
    train = meta["config"]["train"]
    assert train["opt"] == "adamw" and train["muon_nesterov"] is False and train["wd"] == 0.01
    assert meta["config"]["source"] == "cli:tiny"


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path, capsys):
    args = ["train", "--steps", "2", "--batch", "2", "--seq-len", "16", "--ckpt-every", "1",
            "--out-dir", str(tmp_path / "o")]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train, the checkpoint is already at step 2" in out and "loss=" not in out
