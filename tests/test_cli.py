"""The `dormouse` command: help, a short run on the built-in corpus, a real
2-rank torchrun fleet with sample and eval on its checkpoint, a fleet that
loses a rank and restarts from its checkpoint, and bad input of every
subcommand reported in one line with exit status 2 and no traceback."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dormouse.__main__ import main
from dormouse.config import RunConfig
from dormouse.gate.record.launcher import FORKED_STANDALONE, torchrun
from inproc import run_main

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    """The environment of a child: one thread, and this checkout's package first."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dormouse", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)


def _main(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`dormouse ARGS` through the same main() in this process (inproc.run_main)."""
    return run_main(main, list(args), cwd=cwd)


def _torchrun(*args: str, cwd: Path, nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    """`torchrun --standalone --nproc_per_node=N ARGS` as a user types it (a fresh interpreter per rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return _popen(cmd, cwd=cwd, env=env)


def _torchrun_forked(*entry: str, cwd: Path, env: dict | None = None, launch: tuple[str, ...] = ()) -> subprocess.Popen:
    """The same fleet of 2, its ranks forked from torchrun's agent (launcher.torchrun, as the gate
    launches): where what is tested is the fleet, not the command line."""
    return _popen(torchrun(list(entry), launch=["--standalone", "--nproc_per_node=2", *FORKED_STANDALONE, *launch]),
                  cwd=cwd, env=env)


def _popen(cmd: list[str], *, cwd: Path, env: dict | None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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
    for option in ("--config", "--preset", "--data", "--steps", "--batch", "--seq-len", "--lr", "--out",
                   "--ckpt-every", "--resume", "--resume-from", "--set", "--dist", "--profile", "--shard", "--reduce",
                   "--micro-batch", "--data-order", "--log-dir", "--tensorboard"):
        assert option in proc.stdout, option
    assert "tiny" in proc.stdout and "small" in proc.stdout  # the preset choices
    assert "built-in corpus" in proc.stdout
    assert "(default: 200; with --config, the file's)" in proc.stdout  # defaults are shown
    assert "fp32" in proc.stdout and "fsdp" in proc.stdout and "shuffle" in proc.stdout


def test_the_command_lists_its_subcommands_and_version(tmp_path):
    proc = _cli("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for name in ("train", "sample", "eval", "gate", "pipeline", "bench", "soak"):
        assert f"    {name} " in proc.stdout, name
    version = _cli("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("dormouse 0.")


def test_train_tiny_for_three_steps_on_the_builtin_corpus(tmp_path):
    out = tmp_path / "run"
    proc = _cli("train", "--preset", "tiny", "--steps", "3", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("dormouse: preset=tiny") and "data=built-in" in lines[0]
    assert any(line.startswith("step=3/3 ") and "loss=" in line for line in lines)
    assert lines[-1].startswith("done: final loss")
    assert (out / "dormouse.pt").is_file() and (out / "builtin_corpus.bin").is_file()
    assert len((out / "dormouse.metrics.jsonl").read_text().splitlines()) == 1
    run = RunConfig.from_json((out / "run.json").read_text())  # the resolved configuration
    assert run.train.steps == 3 and run.train.out_dir == str(out) and run.source == "cli:tiny"


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
    env = _env()
    procs = {}
    for name, extra in BAD_INPUTS.items():
        args = [sys.executable, "-m", "dormouse", "train", "--steps", "1", "--out", str(d / name), *extra(d)]
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
    code = main(["train", "--steps", "1", "--out", str(tmp_path / "o"), *args])
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
    code = main(["train", "--steps", "2", "--batch", "2", "--seq-len", "16", "--out", str(tmp_path / "o"),
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
            "--out-dir", str(tmp_path / "o")]  # the old name of --out still works
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train, the checkpoint is already at step 2" in out and "loss=" not in out


def _status(argv: list[str]) -> int:
    """main's exit status, whether it returns it or argparse raises it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A checkpoint of a 2-step single-process run, trained in this process."""
    d = tmp_path_factory.mktemp("tiny")
    assert main(["train", "--steps", "2", "--batch", "2", "--seq-len", "16", "--out", str(d / "run")]) == 0
    return d / "run" / "dormouse.pt"


# argv (with {ckpt}, {data}, {junk}, {cfg}, {badjson} filled in) and a fragment of the error line
BAD_SUBCOMMAND_INPUT = [
    (["train", "--config", "{dir}/nope.json"], "nope.json"),
    (["train", "--config", "{badjson}"], "JSON"),
    (["train", "--config", "{cfg}", "--preset", "small"], "--config and --preset"),
    (["train", "--set", "model.nope=1"], "nope"),
    (["train", "--set", "model.max_iter=three"], "max_iter"),
    (["train", "--set", "model.d_model=65"], "d_model"),
    (["train", "--set", "nothing.steps=1"], "model.field=value"),
    (["train", "--dist"], "torchrun"),
    (["train", "--set", "train.dist=true"], "torchrun"),
    (["train", "--reduce", "fp16"], "fp16"),
    (["train", "--data-order", "random"], "random"),
    (["train", "--shard", "zero3"], "zero3"),
    (["sample", "--ckpt", "{dir}/nope.pt", "--prompt", "a"], "does not exist"),
    (["sample", "--ckpt", "{junk}", "--prompt", "a"], "cannot be read"),
    (["sample", "--ckpt", "{ckpt}", "--prompt", ""], "prompt is empty"),
    (["sample", "--ckpt", "{ckpt}", "--prompt", "a", "--temperature", "-1"], "temperature"),
    (["sample", "--ckpt", "{ckpt}", "--prompt", "a", "--tokens", "0"], "--tokens"),
    (["sample", "--ckpt", "{ckpt}", "--prompt", "a", "--samples", "0"], "--samples"),
    (["sample", "--prompt", "a"], "--ckpt"),
    (["eval", "--ckpt", "{ckpt}", "--data", "{dir}/nope.txt"], "does not exist"),
    (["eval", "--ckpt", "{ckpt}", "--data", "{data}", "--part", "tail"], "eval_frac"),
    (["eval", "--ckpt", "{ckpt}", "--data", "{data}", "--seq-len", "999"], "max_seq_len"),
    (["eval", "--ckpt", "{ckpt}"], "--data"),
    (["gate", "--bogus"], ""),  # the gate words its own errors
    (["pipeline", "--bogus"], "--bogus"),
    (["bench", "--bogus"], "--bogus"),
    (["soak", "--bogus"], "--bogus"),
    (["nosuch"], "nosuch"),
]


@pytest.mark.parametrize("argv, fragment", BAD_SUBCOMMAND_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_of_every_subcommand_is_one_error_line_status_2_and_writes_nothing(
        tmp_path, tiny_ckpt, capsys, monkeypatch, argv, fragment):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "data.bin").write_bytes(bytes(range(256)) * 4)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(RunConfig().to_json())
    names = dict(dir=tmp_path, ckpt=tiny_ckpt, junk=tmp_path / "junk.pt", badjson=tmp_path / "bad.json",
                 data=tmp_path / "data.bin", cfg=cfg)
    argv = [a.format(**{k: str(v) for k, v in names.items()}) for a in argv]
    out = tmp_path / "out"
    if argv[0] == "train":
        argv += ["--out", str(out)]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _status(argv) == 2
    _one_error_line(capsys.readouterr().err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing half-written


def test_set_reaches_model_and_train_fields_and_run_json_replays_the_run(tmp_path, capsys):
    first = tmp_path / "a"
    assert main(["train", "--steps", "3", "--batch", "2", "--seq-len", "16", "--out", str(first),
                 "--set", "model.max_iter=3", "--set", "model.engram_rows=0", "--set", "model.engram_dim=0",
                 "--set", "train.opt=adamw", "--set", "wd=0.01", "--data-order", "sequential"]) == 0
    run = RunConfig.from_json((first / "run.json").read_text())
    assert run.model.max_iter == 3 and not run.model.engram_on and run.train.data_order == "sequential"
    assert run.train.opt == "adamw" and run.train.wd == 0.01 and run.train.seq_len == 16
    # the same run again from its run.json, elsewhere: the same parameters, bit for bit
    again = tmp_path / "b"
    assert main(["train", "--config", str(first / "run.json"), "--out", str(again)]) == 0
    capsys.readouterr()
    a = torch.load(first / "dormouse.pt", weights_only=True)["model"]
    b = torch.load(again / "dormouse.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- a real fleet

FLEET_ARGS = ["--profile", "2,1", "--seq-len", "32", "--steps", "6", "--ckpt-every", "3", "--log-every", "3",
              "--set", "eval_frac=0.1", "--set", "eval_every=3"]


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 2-rank `torchrun -m dormouse train` fleet (gloo), 6 steps: no --dist,
    torchrun alone makes it a fleet; it records itself (--record) for the gate."""
    d = tmp_path_factory.mktemp("fleet")
    proc = _finish(_torchrun("-m", "dormouse", "train", *FLEET_ARGS, "--out", str(d / "run"),
                             "--log-dir", str(d / "logs"), "--record", cwd=d))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return d, proc


def test_torchrun_trains_a_fleet_with_rank_0_logging_and_per_rank_logs(fleet_run):
    d, proc = fleet_run
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
    assert proc.stdout.count("done: final loss") == 1  # rank 0 alone prints
    # started by torchrun without --dist: a fleet, and the log says why
    assert proc.stdout.count("started by torchrun (WORLD_SIZE=2): training as a fleet") == 1
    assert "fleet: world_size=2 backend=gloo" in proc.stdout and "rank1 batch=1 seq_len=32" in proc.stdout
    assert proc.stdout.count("eval step=") == 2
    for r in (0, 1):
        log = (d / "logs" / f"rank{r}.log").read_text()
        assert "step=6/6" in log and "done: final loss" in log
    run = RunConfig.from_json((d / "run" / "run.json").read_text())
    assert run.train.dist and run.train.dist_profile == "2,1" and run.train.data_order == "shuffle"
    assert (d / "run" / "dormouse.pt").is_file()


def test_the_fleets_recording_passes_the_recording_judge(fleet_run):
    # (the command `dormouse gate check` itself: tests/gate/catches/test_own_trainer_recording.py, one process)
    from dormouse.gate.judge.entry import judge_recording
    from dormouse.gate.record.reference import make_reference

    d, proc = fleet_run
    assert proc.stdout.count(f"judge it with `dormouse gate check --out {d / 'run'}`") == 1
    make_reference(d / "run", log=lambda line: None)
    v = judge_recording(d / "run")
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    assert v.check("complete").reason.startswith("recording of 6 steps, 2 ranks")
    assert v.check("gradient").worst < 1e-6 and "bitwise at all 6 steps" in v.check("replay").reason
    assert "block.moe.router_bias follows the declared update" in v.check("buffers").reason  # the routing bias


def test_sample_and_eval_read_the_fleets_checkpoint(fleet_run):
    d, _ = fleet_run
    ckpt = str(d / "run" / "dormouse.pt")
    a = _main("sample", "--ckpt", ckpt, "--prompt", "def ", "--tokens", "50", "--seed", "1", cwd=d)
    b = _main("sample", "--ckpt", ckpt, "--prompt", "def ", "--tokens", "50", "--seed", "1", cwd=d)
    assert a.returncode == 0 and a.stderr == "", a.stderr
    assert a.stdout == b.stdout and len(a.stdout.encode()) >= 50  # deterministic; replacement chars may widen
    ev = _main("eval", "--ckpt", ckpt, "--data", str(d / "run" / "builtin_corpus.bin"), "--part", "tail", cwd=d)
    assert ev.returncode == 0, ev.stderr
    words = ev.stdout.split()
    nats, bits = float(words[1]), float(words[3])
    assert words[2] == "nats/byte," and words[4] == "bits/byte"
    assert bits == pytest.approx(nats / math.log(2), rel=1e-5) and 0 < nats < math.log(256) + 0.5
    # the loop logged the same held-out loss at its last step (the loop scores at most 64 windows)
    assert "last 0.1 of the file" in ev.stdout


def test_a_fleets_run_resumes_in_one_process_from_its_run_json(fleet_run, tmp_path):
    d, _ = fleet_run
    proc = _main("train", "--config", str(d / "run" / "run.json"), "--set", "train.dist=false",
                "--capacity", "", "--batch", "3", "--steps", "8", "--resume", cwd=d)  # --capacity: --profile's old name
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {d / 'run' / 'dormouse.pt'} at step 6" in proc.stdout and "step=8/8" in proc.stdout


def test_a_fleet_that_loses_a_rank_restarts_from_its_checkpoint_and_ends_bitwise_equal(tmp_path):
    args = ["train", "--dist", "--resume", "--seq-len", "16", "--batch", "2", "--steps", "8",
            "--ckpt-every", "3", "--log-every", "1"]
    plain = _torchrun_forked("-m", "dormouse", *args, "--out", str(tmp_path / "plain"), cwd=tmp_path)
    killed = _torchrun_forked(str(ROOT / "tests" / "support" / "kill_rank_train.py"), *args,
                              "--out", str(tmp_path / "killed"), cwd=tmp_path, launch=("--max-restarts", "1"),
                              env=_env(DORMOUSE_TEST_KILL_RANK="1", DORMOUSE_TEST_KILL_AT_STEP="5"))
    plain, killed = _finish(plain), _finish(killed)
    assert plain.returncode == 0, plain.stderr
    assert killed.returncode == 0, killed.stderr
    # the first launch died at step 6 (0-based 5) and the second resumed from step 3's checkpoint
    assert "step=5/8" in killed.stdout and f"resumed from {tmp_path / 'killed' / 'dormouse.pt'} at step 3" in killed.stdout
    assert "step=8/8" in killed.stdout and "done: final loss" in killed.stdout
    a = torch.load(tmp_path / "plain" / "dormouse.pt", weights_only=True)
    b = torch.load(tmp_path / "killed" / "dormouse.pt", weights_only=True)
    assert json.loads(a["meta"])["step"] == json.loads(b["meta"])["step"] == 8
    for part in ("model", "optim"):
        flat_a, flat_b = _flatten(a[part]), _flatten(b[part])
        assert flat_a.keys() == flat_b.keys()
        for k in flat_a:
            assert torch.equal(flat_a[k], flat_b[k]), (part, k)


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix: tree if isinstance(tree, torch.Tensor) else torch.tensor(tree)}


def test_a_sharded_fleets_dcp_checkpoint_samples_evaluates_and_resumes_alone(tmp_path):
    proc = _finish(_torchrun_forked("-m", "dormouse", "train", "--dist", "--shard", "fsdp", "--seq-len", "16",
                             "--batch", "2", "--steps", "2", "--ckpt-every", "2", "--out", str(tmp_path / "run"),
                             cwd=tmp_path))
    assert proc.returncode == 0, proc.stderr
    dcp = tmp_path / "run" / "dormouse.dcp"
    assert dcp.is_dir()
    a = _main("sample", "--ckpt", str(dcp), "--prompt", "x", "--tokens", "10", "--temperature", "0", cwd=tmp_path)
    assert a.returncode == 0 and a.stderr == "", a.stderr
    head = tmp_path / "head.bin"  # the corpus's first 8 KB: a whole-file eval in seconds, not the 0.5 MB corpus
    head.write_bytes((tmp_path / "run" / "builtin_corpus.bin").read_bytes()[:8192])
    ev = _main("eval", "--ckpt", str(dcp), "--data", str(head), cwd=tmp_path)
    assert ev.returncode == 0 and "bits/byte" in ev.stdout and "whole file" in ev.stdout, ev.stderr
    # --resume-from CKPT: a different out dir continues from the fleet's checkpoint, in one process
    res = _main("train", "--config", str(tmp_path / "run" / "run.json"), "--set", "train.dist=false",
               "--steps", "3", "--resume-from", str(dcp), "--out", str(tmp_path / "alone"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"resumed from {dcp} at step 2" in res.stdout and "step=3/3" in res.stdout
    # ... and a replicated fleet of 2 continues what that one process wrote
    alone = tmp_path / "alone"
    assert not RunConfig.from_json((alone / "run.json").read_text()).train.resume_from  # one launch's, not the run's
    fleet = _finish(_torchrun_forked("-m", "dormouse", "train", "--config", str(alone / "run.json"), "--dist",
                                     "--steps", "4", "--resume", cwd=tmp_path))
    assert fleet.returncode == 0, fleet.stderr
    assert f"resumed from {alone / 'dormouse.pt'} at step 3" in fleet.stdout and "step=4/4" in fleet.stdout


@pytest.mark.parametrize("micro", [1, 0])  # 0: the whole batch in one slice (the field's own default)
def test_micro_batch_sets_train_micro_batch(tmp_path, capsys, micro):
    code = main(["train", "--steps", "1", "--batch", "2", "--seq-len", "16", "--micro-batch", str(micro),
                 "--out", str(tmp_path / "o")])
    assert code == 0, capsys.readouterr().err
    assert RunConfig.from_json((tmp_path / "o" / "run.json").read_text()).train.micro_batch == micro


def test_micro_batch_0_is_the_whole_batch_and_one_that_does_not_divide_it_is_one_line(tmp_path, capsys):
    assert main(["train", "--steps", "1", "--batch", "2", "--seq-len", "16", "--micro-batch", "0",
                 "--out", str(tmp_path / "o")]) == 0
    assert RunConfig.from_json((tmp_path / "o" / "run.json").read_text()).train.micro_batch == 0
    capsys.readouterr()
    assert main(["train", "--steps", "1", "--batch", "2", "--seq-len", "16", "--micro-batch", "3",
                 "--out", str(tmp_path / "p")]) == 2
    _one_error_line(capsys.readouterr().err, "micro_batch = 3", "does not divide every rank's batch (2)")


def test_a_run_that_crashes_is_one_line_naming_the_exception_and_status_3(tmp_path, capsys):
    from dormouse.train.hooks import Hooks, install

    def broken(batch):
        raise RuntimeError("boom at the start of a step\nsecond line of detail")

    remove = install(Hooks(on_batch=[broken]))  # every train() of this process, the command's included
    try:
        assert main(["train", "--steps", "2", "--batch", "2", "--seq-len", "16", "--out", str(tmp_path / "o")]) == 3
    finally:
        remove()
    _one_error_line(capsys.readouterr().err, "the run crashed", "RuntimeError", "boom at the start of a step")


def test_a_process_torchrun_started_is_a_fleet_and_a_fleet_needs_torchrun(monkeypatch):
    from dormouse.errors import FleetError
    from dormouse.train.runner import as_launched

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run, note = as_launched(RunConfig())
    assert run.train.dist and "training as a fleet" in note and "WORLD_SIZE=2" in note
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert as_launched(RunConfig()) == (RunConfig(), "")
    with pytest.raises(FleetError, match="runs under torchrun"):
        as_launched(RunConfig.from_dict({"train": {"dist": True}}))
