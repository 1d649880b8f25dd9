"""GateSettings: validation in one sentence naming the parameter, every field a
command-line flag and a notebook parameter, to_argv round-tripping through the
parser, and the bad inputs of issue 8 (finding 8) through the real CLI: exit
status 2, one line "error: ..." naming the setting, no traceback, nothing
written. Also: `single` runs at the fleet's global batch (--world/--profile)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


from dormouse.errors import ConfigError, DormouseError
from dormouse.gate.artifacts import FLOOR, SINGLE, GateReferences, RecordingSet, gate_reference_dir
from dormouse.gate.__main__ import parser
from dormouse.gate.cli import add_arguments, by_hand, from_args
from dormouse.gate.settings import _NOT_FLAGS, FIELDS, VALIDATED_FLAG, GateSettings, ParameterError, check


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------- validation

BAD = [
    ("steps", 0), ("steps", -3), ("steps", 1.5), ("steps", "x"), ("steps", True),
    ("batch", 0), ("world", 0), ("seed", -1), ("threads", 0), ("micro_batch", -1),
    ("opt", "sgd"), ("shard", "zero3"), ("reduce", "fp16"), ("device", "tpu"), ("data_order", "random"),
    ("lr", math.nan), ("lr", -1.0), ("lr", math.inf), ("lr", "0.1"), ("lr", True),
    ("bucket_mb", 0.0), ("bucket_mb", math.nan), ("timeout_s", -1.0), ("produce", "yes"),
    ("profile", "-1,2"), ("profile", "\u0664,2"), ("profile", "4,2,1"), ("profile", "4x0,2"),
    ("profile", "4;2"), ("profile", 42),
    ("config", "no-such-preset"), ("data", "/no/such/corpus.bin"), ("resume_from", 3),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_setting_is_one_sentence_naming_it_and_what_to_do(tmp_path, name, value):
    out = tmp_path / "out"
    with pytest.raises(ParameterError) as e:
        GateSettings(out=str(out), **{name: value}).validate()
    msg = str(e.value)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, DormouseError)
    assert "\n" not in msg and msg.rstrip().endswith(".")
    assert msg.startswith(f"{name} = "), msg  # names the parameter (and its value) first
    assert any(w in msg for w in ("must be", "choose", "pass ")), msg  # what to do
    assert not out.exists()  # validation writes nothing


def test_micro_batch_that_does_not_divide_a_rank_batch_is_refused(tmp_path):
    with pytest.raises(ParameterError, match=r"^micro_batch = 3 is not allowed: it does not divide every rank's batch \(4, 2\)"):
        GateSettings(out=str(tmp_path / "o"), micro_batch=3, profile="4,2").validate()
    assert GateSettings(out=str(tmp_path / "o"), micro_batch=2, profile="4,2").validate().micro_batch == 2


def test_profile_must_match_the_world(tmp_path):
    with pytest.raises(ParameterError, match=r"profile = '4,2' is not allowed: it has 2 entries but world = 3"):
        GateSettings(out=str(tmp_path / "o"), world=3).validate()


def test_an_unwritable_out_is_refused_naming_out(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ParameterError, match=r"^out = .* cannot be written .*: out must be a writable directory"):
        GateSettings(out=str(blocker / "sub")).validate()
    assert blocker.read_text() == "x"


def test_cuda_without_a_gpu_names_the_device(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ParameterError, match=r"^device = 'cuda' is not allowed here"):
        GateSettings(out=str(tmp_path / "o"), device="cuda").validate()


def test_validate_normalises(tmp_path):
    s = GateSettings(out=str(tmp_path / "o"), profile=" 4 , 2 ", lr=1, steps="3").validate()
    assert (s.profile, s.lr, s.steps) == ("4,2", 1.0, 3) and isinstance(s.lr, float)
    assert s == s.validate()  # idempotent
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps = 4


def test_the_help_names_exactly_the_reduces_that_validate_accepts(tmp_path):
    """The --reduce help (the field's comment) promises 'exact'; a value the help
    names must validate."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    help_text = next(a.help for a in p._actions if a.dest == "reduce")
    for value in ("fp32", "bf16", "exact"):
        if value in help_text:
            GateSettings(out=str(tmp_path / "o"), reduce=value, micro_batch=1).validate()


# --------------------------------------------------------------------------- every field everywhere


def test_every_field_is_a_flag_of_the_cli_except_the_notebook_ones():
    p = parser()
    by_dest = {a.dest: a for a in p._actions}
    assert set(_NOT_FLAGS) == {"timeout_s", "produce"}  # a launcher timeout and the notebooks' switch
    for f in dataclasses.fields(GateSettings):
        if f.name in _NOT_FLAGS:
            assert f.name not in by_dest
            continue
        a = by_dest[f.name]
        assert _flag(f.name) in a.option_strings
        # only the flags given reach the settings (a default never overrides one): the help says the default
        assert a.default == argparse.SUPPRESS
        assert a.help and "(default:" in a.help and a.help.split(" (default:")[0].strip(), f.name
        if f.name not in ("world", "profile", "resume_world"):  # by hand these follow other flags
            assert f"(default: {f.default!r})" in a.help, (f.name, a.help)


NON_DEFAULT = {
    # (profile "3,3": under FSDP2 every rank runs as many slices, here 3 of one window)
    "steps": 3, "batch": 3, "world": 2, "profile": "3,3", "seed": 8, "lr": 0.01, "opt": "adamw",
    "shard": "fsdp", "reduce": "bf16", "micro_batch": 1, "data_order": "sequential", "preset": "tiny",
    "resume_world": 2, "resume_from": "ckpt.pt", "device": "cpu", "threads": 2, "bucket_mb": 8.0,
    "timeout_s": 60.0, "produce": False,
}
NO_STOP = {"resume_world": 0}  # a fleet that starts from resume_from, or mixes window lengths, never stops


def _values(tmp_path: Path) -> dict:
    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(bytes(range(256)) * 40)
    # a field added later still has to be accepted (at its default) by the notebooks' check
    defaults = {f.name: f.default for f in dataclasses.fields(GateSettings)}
    return {**defaults, **NON_DEFAULT, "data": str(corpus), "out": str(tmp_path / "nb")}


def test_every_field_is_a_notebook_parameter(tmp_path):
    values = _values(tmp_path)
    assert set(values) == set(FIELDS)
    for name in FIELDS:
        given = {"out": str(tmp_path / "nb"), **(NO_STOP if name == "resume_from" else {}), name: values[name]}
        s = check(**given)
        assert getattr(s, name) == values[name], name
        assert isinstance(s, GateSettings)
    # all at once, too
    values.update(NO_STOP)
    s = check(**values)
    assert {k: getattr(s, k) for k in FIELDS} == values
    with pytest.raises(ParameterError, match=r"^unknown parameter 'step'"):
        check(step=3)


def test_the_notebook_check_undoes_papermills_conversions(tmp_path):
    s = check(out=tmp_path / "p", profile=4, world=1, config=None)
    assert (s.profile, s.world, s.config, s.out) == ("4", 1, "", str(tmp_path / "p"))
    # a world without a profile runs the batch on every rank, not the default 2-rank profile
    assert check(out=str(tmp_path / "p"), world=3).profile == ""


@pytest.mark.parametrize("over", [
    {},
    {**NON_DEFAULT, **NO_STOP},
    {**NON_DEFAULT, "resume_from": ""},
    {"profile": "4x32,2x64", "lr": 1e-7, "bucket_mb": 0.25, **NO_STOP},
    {"world": 3, "profile": "", "batch": 1, "reduce": "bf16"},
], ids=["defaults", "non-default-resumed", "non-default-stopping", "mixed-lengths", "no-profile"])
def test_to_argv_round_trips_through_the_parser(tmp_path, over):
    over = {k: v for k, v in over.items() if k not in _NOT_FLAGS}
    s = GateSettings(out=str(tmp_path / "rt"), **over).validate()
    argv = s.to_argv()
    assert argv[-1] == VALIDATED_FLAG  # validated settings carry the mark
    argv = argv[:-1]
    assert all(a.startswith("--") and "=" in a for a in argv)
    assert len(argv) == len(FIELDS) - len(_NOT_FLAGS)
    for marked in ([], [VALIDATED_FLAG]):  # checked again, or relied on: the same settings
        back = from_args(parser().parse_args(["rank", *argv, *marked]))
        assert back == s and back.validated
        assert back.record() == s.record()


def test_settings_are_validated_once_and_a_rank_relies_on_the_launchers_mark(tmp_path):
    """validate() of validated settings is the object itself; a changed copy
    is checked again; a rank given to_argv's mark builds the settings without
    checking them (a corpus removed after the check does not stop it), and
    the same flags without the mark are checked, with the one-line error."""
    from dormouse.gate.__main__ import settings_for
    from dormouse.gate.record.launcher import rank_command

    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(bytes(range(256)) * 40)
    s = GateSettings(out=str(tmp_path / "o"), data=str(corpus), steps=3, resume_world=0).validate()
    assert s.validated and s.validate() is s
    assert not GateSettings().validated and not dataclasses.replace(s, steps=4).validated
    with pytest.raises(ParameterError, match=r"^steps = 0 is not allowed"):
        dataclasses.replace(s, steps=0).validate()
    cmd = rank_command(s)
    assert cmd[-1] == VALIDATED_FLAG and cmd[:3] == ["-m", "dormouse.gate", "rank"]
    corpus.unlink()  # validate() would now refuse data
    args = parser().parse_args(cmd[2:])
    assert args.validated and settings_for("rank", args) == s and settings_for("rank", args).validated
    with pytest.raises(ParameterError, match=r"^data = .* is not a file"):
        settings_for("rank", parser().parse_args(cmd[2:-1]))
    with pytest.raises(ParameterError, match=r"^data = .* is not a file"):  # the mark is the rank's only
        settings_for("single", parser().parse_args(["single", *cmd[3:]]))


# --------------------------------------------------------------------------- the real CLI


def _popen(*args: str, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "dormouse.gate", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# name: (mode and flags, the setting the one line must name)
CLI_BAD = {
    "gradref_batch_0": (["gradref", "--batch", "0", "--profile", ""], "batch"),
    "gradref_lr_nan": (["gradref", "--lr", "nan"], "lr"),
    "single_lr_minus_1": (["single", "--lr", "-1"], "lr"),
    "gradref_lr_minus_1": (["gradref", "--lr=-1"], "lr"),
    "profile_negative": (["single", "--profile", "-1,2"], "profile"),
    "profile_arabic_indic_digit": (["single", "--profile", "\u0664,2"], "profile"),
    "world_0": (["single", "--world", "0"], "world"),
    "world_3_with_a_2_rank_profile_by_its_old_name": (["single", "--world", "3", "--capacity", "4,2"], "profile"),
    "micro_batch_3": (["gradref", "--micro-batch", "3", "--profile", "4,2"], "micro_batch"),
    "steps_not_a_number": (["single", "--steps", "abc"], "--steps"),
    "reduce_unknown": (["reference", "--reduce", "fp16"], "reduce"),
    "rank_outside_torchrun_with_bad_lr": (["rank", "--lr", "inf"], "lr"),
}
UNWRITABLE = {"single_unwritable_out": "single", "gradref_unwritable_out": "gradref"}


# the cases run as real processes (`python -m dormouse.gate ...`); the others through the same
# main() in this process (one interpreter start-up each saved: the parsing, the checks and the
# exit-code map are the same code)
IN_A_PROCESS = {"gradref_batch_0", "rank_outside_torchrun_with_bad_lr", "steps_not_a_number", "single_unwritable_out"}


def _in_process(args: list[str], cwd: Path) -> tuple[int, str]:
    import contextlib
    import io

    from dormouse.gate.__main__ import main

    err, here = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(args)
            except SystemExit as e:  # argparse's own exit (status 2 for a bad flag value)
                code = e.code
    finally:
        os.chdir(here)
    return code, err.getvalue()


def test_bad_inputs_through_the_cli_exit_2_with_one_line_and_write_nothing(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cases, outs = {}, {}
    for case, (args, _) in CLI_BAD.items():
        out = tmp_path / case / "out"
        out.mkdir(parents=True)  # exists and empty: nothing may appear in it
        outs[case] = out
        cases[case] = ([*args, "--out", str(out)], tmp_path / case)
    fresh = tmp_path / "fresh" / "out"  # does not exist: it must not be created either
    cases["gradref_batch_0_fresh"] = (["gradref", "--batch", "0", "--profile", "", "--out", str(fresh)], tmp_path)
    for case, mode in UNWRITABLE.items():
        cases[case] = ([mode, "--out", str(blocker / "sub")], tmp_path)
    expect = {**{c: s for c, (_, s) in CLI_BAD.items()}, "gradref_batch_0_fresh": "batch",
              **{c: "out" for c in UNWRITABLE}}
    procs = {case: _popen(*args, cwd=cwd) for case, (args, cwd) in cases.items() if case in IN_A_PROCESS}
    results = {case: _in_process(args, cwd) for case, (args, cwd) in cases.items() if case not in IN_A_PROCESS}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        results[case] = (proc.returncode, stderr)
    assert set(results) == set(cases)
    failures = []
    for case, (returncode, stderr) in results.items():
        lines = stderr.strip().splitlines()
        problems = []
        if returncode != 2:
            problems.append(f"exit {returncode}")
        if "Traceback" in stderr:
            problems.append("traceback")
        if len(lines) != 1 or not lines[0].startswith("error:"):
            problems.append(f"stderr is not one 'error:' line: {stderr[-600:]!r}")
        elif expect[case] not in lines[0]:
            problems.append(f"does not name {expect[case]!r}: {lines[0]!r}")
        if case in outs and list(outs[case].iterdir()):
            problems.append(f"wrote {sorted(p.name for p in outs[case].iterdir())}")
        if problems:
            failures.append(f"{case}: {'; '.join(problems)}")
    assert not fresh.exists(), "gradref --batch 0 created its out dir"
    assert blocker.read_text() == "not a directory"
    assert not failures, "\n".join(failures)


def test_single_runs_at_the_fleets_global_batch(tmp_path):
    """single honours --world/--profile: its batch is the fleet's global batch."""
    runs = {"4,2": (["--profile", "4,2"], 6), "world3": (["--world", "3", "--capacity", "", "--batch", "1"], 3)}
    procs = {k: _popen("single", "--steps", "1", "--out", str(tmp_path / k), *args, cwd=tmp_path)
             for k, (args, _) in runs.items()}
    for k, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        meta = GateReferences(tmp_path / k).meta(FLOOR)
        assert meta["global_batch"] == runs[k][1], (k, meta["global_batch"])
        assert meta["settings"]["profile"] == ("4,2" if k == "4,2" else "")
        single = RecordingSet(gate_reference_dir(tmp_path / k, SINGLE))
        assert len(single.losses()) == 1 and math.isfinite(single.losses()[0])
        # the single process's tokens: one row per window of the global batch
        assert single.step_extra(0, 1, "topk").shape[0] == runs[k][1]
        # its floor: one-ulp nudges of the same run only, never a run that splits the batch
        assert meta["runs"] and all(name.startswith("ulp") for name in meta["runs"]), list(meta["runs"])


def test_capacity_is_the_old_name_of_profile_for_notebooks_and_plan_files(tmp_path):
    out = str(tmp_path / "o")
    # a notebook passes its profile cell (the default) and papermill's injected old name
    assert check(out=out, world=3, profile=GateSettings().profile, capacity="2,1,1").profile == "2,1,1"
    assert check(out=out, world=3, profile="2,1,1", capacity=None).profile == "2,1,1"
    with pytest.raises(ParameterError, match="both set the fleet's profile"):
        check(out=out, world=3, profile="1,1,1", capacity="2,1,1")
    from dormouse.gate.settings import from_dict
    assert from_dict({"out": out, "world": 2, "capacity": "3,1"}).profile == "3,1"


# --------------------------------------------------------------------------- by hand, and defaults that follow


def test_by_hand_batch_is_the_batch_of_the_process_launched(tmp_path):
    """single --batch 4 is one process at the global batch 4; a 2-rank rank --batch 2
    is 2 x 2 (the default capacity never overrides a given batch); both one launch."""
    out = {"out": str(tmp_path / "g")}
    single = by_hand("single", {**out, "batch": 4})
    assert (single.world, single.batch, single.profile, single.plan.global_batch) == (1, 4, "", 4)
    rank = by_hand("rank", {**out, "batch": 2}, world_size=2)
    assert (rank.world, rank.batch, rank.profile, rank.plan.global_batch, rank.resume_world) == (2, 2, "", 4, 0)
    assert len(rank.legs()) == 1  # by hand: no --leg
    assert by_hand("rank", {**out, "batch": 2}, world_size=3).world == 3  # torchrun's world
    assert by_hand("single", {**out, "world": 2, "batch": 4}).plan.global_batch == 4  # split over the ranks
    # nothing given: the default fleet (4,2) and its global batch, as the pipeline's
    assert by_hand("single", dict(out)).plan.global_batch == by_hand("rank", dict(out), world_size=2).plan.global_batch == 6
    # a flag given is never overridden
    assert by_hand("rank", {**out, "resume_world": 1}, world_size=2).resume_world == 1
    assert by_hand("rank", {**out, "profile": "3,1", "batch": 2}, world_size=2).profile == "3,1"
    with pytest.raises(ParameterError, match=r"^batch = 5 is not allowed with world = 2"):
        by_hand("single", {**out, "world": 2, "batch": 5})


def test_the_references_by_hand_take_the_fleets_recorded_settings(tmp_path):
    fleet = by_hand("rank", {"out": str(tmp_path / "g"), "batch": 2, "steps": 3, "lr": 0.01}, world_size=2)
    recorded = fleet.record()
    assert by_hand("gradref", {"out": fleet.out}, recorded=recorded) == fleet
    assert by_hand("reference", {"out": fleet.out, "steps": 2}, recorded=recorded).steps == 2  # a flag given wins


def test_a_profile_that_mixes_window_lengths_runs_in_one_launch_by_default(tmp_path):
    s = check(out=str(tmp_path / "o"), profile="5x16,1x64")
    assert s.resume_world == 0 and len(s.legs()) == 1 and s.plan.global_batch is None
    assert check(out=str(tmp_path / "o"), profile="5x16,1x64", resume_world=1).resume_world == 0  # a notebook's default
    with pytest.raises(ParameterError, match=r"^resume_world = 2 is not allowed: the profile mixes window lengths"):
        check(out=str(tmp_path / "o"), profile="5x16,1x64", resume_world=2)
    # on the command line an explicit --resume-world 1 is the user's word, and refused with its reason
    with pytest.raises(ParameterError, match=r"^resume_world = 1 is not allowed: the profile mixes window lengths"):
        from_args(argparse.Namespace(out=str(tmp_path / "o"), profile="5x16,1x64", resume_world=1),
                  {"profile", "resume_world"})
    assert check(out=str(tmp_path / "o"), profile="4,2").resume_world == 1  # one length: the richer default stays
