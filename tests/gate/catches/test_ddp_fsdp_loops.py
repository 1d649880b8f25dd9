"""The Recorder on a real client (issue 13): a plain DDP loop with gradient
accumulation over variable-length padded sequences (tests/support/ddp_loop.py),
2 gloo ranks under real torchrun, recorded, referenced in one process and
judged. Clean runs pass (several seeds, a resume, FSDP2, sketches); each
planted fault fails for its NAMED reason, under DDP and (local token counts,
clipping by the local shards' norm, the compensation twice) FSDP2. One torchrun launch records every
run's first leg, a second the resumed legs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import casecheck
import catalogue
import looprec
import pytest
import torch
from looprec import QUIET, ROOT, failing, launch

from dormouse.errors import DormouseError
from dormouse.gate import Recorder, RecordingSpec
from dormouse.gate import artifacts as A
from dormouse.gate.judge.entry import judge_recording
from dormouse.gate.record.reference import make_reference

@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recordings")
    plan = [{**cfg, "out": str(root / name)} for name, cfg in catalogue.runs("ddp").items()]
    launch(plan, root)  # every run's first leg; "leg": 1 runs are resumed in a second launch
    launch([{**p, "leg": 2} for p in plan if p.get("leg") == 1], root)
    return {name: root / name for name in catalogue.ids("ddp")}


@casecheck.rows("ddp")
def test_the_verdict_is_the_catalogues(recordings, case):
    """Clean runs pass (several seeds, a resume, FSDP2, sketches); each fault fails for its named reason
    (tests/support/catalogue.py, the "ddp" rows)."""
    casecheck.holds(recordings[case.id], case)


@pytest.mark.parametrize("name", ["bn_frozen", "dropout_off"])
def test_submodules_the_loop_runs_in_eval_mode_are_judged_in_eval_mode(recordings, name, tmp_path):
    """A frozen BatchNorm (running statistics) or a dropout module in eval mode
    is a function of each example alone: the Recorder records the modes, the
    reference sets them (not model.train()'s all-training), and the loop
    passes (its catalogue row); BatchNorm in training mode fails independence (row bn), dropout in training
    mode is judged at the masks each rank drew (row dropout, below)."""
    module = "bn" if name == "bn_frozen" else "drop"
    rec = A.RecordingSet(recordings[name])
    assert rec.eval_modules(1) == [module]
    if name == "bn_frozen":  # the same recording without the modes: the reference trains the BatchNorm, and fails
        dst = _copy(recordings, tmp_path, name)
        for k in rec.steps:
            for r in range(rec.world_at(k)):
                _edit(A.step_meta_path(dst, r, k), eval_modules=[])
        make_reference(dst, log=QUIET)
        assert not judge_recording(dst).check("independence").passed


def test_torch_dropout_is_judged_at_the_masks_each_rank_drew(recordings):
    """torch's own dropout, each rank its own RNG (row dropout: PASS). The Recorder keeps the RNG state
    each forward started from; this file's own arithmetic (drawn.py: plain autograd, the global token
    mean): every rank's micro-batches of step 1, the RNG put back to that state before each forward,
    give the fleet's gradient (unclipped); from one seed before every forward (the reference's draws
    before the states were kept) they do not, by far more than any bound."""
    import drawn

    rec = A.RecordingSet(recordings["dropout"])
    got = drawn.fleet(recordings["dropout"], rec)
    assert looprec.worst(got, drawn.one_process(rec, 1, drawn.recorded_state(rec, 1))) < 1e-6
    assert looprec.worst(got, drawn.one_process(rec, 1, lambda r, m: torch.manual_seed(0))) > 1e-3


def test_a_backpropagated_forward_of_the_model_in_eval_mode_is_a_micro_batch(recordings, tmp_path):
    """model.eval() before a forward whose loss is backpropagated (row eval_model, dropout 0.1 switched
    off): the Recorder keeps the forward (its output reached by the backward) with the model's own mode
    (""). The fleet's gradient is this file's own one-process gradient in eval mode, not the one in
    training mode at the recorded masks; and judged without its modes the recording fails."""
    import drawn

    rec = A.RecordingSet(recordings["eval_model"])
    assert rec.eval_modules(1)[0] == "" and "drop" in rec.eval_modules(1) and rec.step_meta(0, 1)["micro_batches"] == 3
    got = drawn.fleet(recordings["eval_model"], rec)
    assert looprec.worst(got, drawn.one_process(rec, 1, lambda r, m: None, train=False)) < 1e-6
    assert looprec.worst(got, drawn.one_process(rec, 1, drawn.recorded_state(rec, 1))) > 1e-3
    dst = _copy(recordings, tmp_path, "eval_model")
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            _edit(A.step_meta_path(dst, r, k), eval_modules=[])
    make_reference(dst, log=QUIET)
    assert not judge_recording(dst).check("gradient").passed


def test_a_parameter_the_script_froze_is_frozen_in_the_reference(recordings, tmp_path):
    """requires_grad is recorded with the initial state: the reference freezes
    what the loop froze, so the loop passes; without that record (a recording
    read as before) the reference trains pos.weight and the mask fails."""
    assert A.RecordingSet(recordings["frozen_script"]).meta["frozen"] == ["pos.weight"]
    dst = _copy(recordings, tmp_path, "frozen_script")
    meta = json.loads(A.recording_path(dst).read_text())
    del meta["frozen"]
    A.recording_path(dst).write_text(json.dumps(meta))
    make_reference(dst, log=QUIET)
    v = judge_recording(dst)
    assert not v.check("grad_mask").passed and "pos.weight" in v.check("grad_mask").reason


def test_a_forward_keyword_beyond_the_inputs_is_recorded_and_passed(recordings, tmp_path):
    """position_ids (packed sequences' positions) reach the forward as a
    keyword not named in RecordingSpec(inputs=...): the Recorder keeps every tensor
    keyword with the batch's rows, and the reference passes it, so the loop
    passes; with position_ids taken out of the recording the reference runs
    other positions and the gradient check fails."""
    from safetensors.torch import load_file, save_file

    rec = A.RecordingSet(recordings["position_ids"])
    assert all("position_ids" in b for _, _, b in rec.micro_batches(1))
    dst = _copy(recordings, tmp_path, "position_ids")
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            path = A.step_tensors_path(dst, r, k)
            t = load_file(path)
            save_file({n: x for n, x in t.items() if not n.endswith("/position_ids")}, path)
    make_reference(dst, log=QUIET)
    assert not judge_recording(dst).check("gradient").passed


# --------------------------------------------------------------------------- bad input: one line, exit 2


def _copy(recordings, tmp_path, name="clean1") -> Path:
    looprec.verdict(recordings[name])  # its reference made: copied without it
    dst = tmp_path / name
    shutil.copytree(recordings[name], dst)
    shutil.rmtree(dst / "reference")
    return dst


def _edit(path: Path, **fields):
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))


def test_bad_recordings_are_one_line(recordings, tmp_path):
    d = _copy(recordings, tmp_path)
    _edit(d / "recording.json", build_model="nosuch_pkg.mod:build")
    with pytest.raises(DormouseError, match="'nosuch_pkg.mod:build' does not load"):
        make_reference(d, log=QUIET)
    _edit(d / "recording.json", build_model="loopmodel:build_model", build_kwargs={"seed": 99})
    with pytest.raises(DormouseError, match="differ from the recorded initial ones"):
        make_reference(d, log=QUIET)
    _edit(d / "recording.json", build_kwargs={"seed": 1})
    (d / "rank1" / "step000002.json").unlink()
    with pytest.raises(DormouseError, match="rank 1 has no step 2"):
        make_reference(d, log=QUIET)
    shutil.copy(recordings["clean2"] / "rank1" / "step000002.json", d / "rank1" / "step000002.json")
    with pytest.raises(DormouseError, match="belongs to another run"):
        make_reference(d, log=QUIET)
    shutil.copy(recordings["clean1"] / "rank1" / "step000002.json", d / "rank1" / "step000002.json")
    shutil.rmtree(d / "rank1")
    with pytest.raises(DormouseError, match="has no rank1/"):
        make_reference(d, log=QUIET)
    shutil.copytree(recordings["clean1"] / "rank1", d / "rank1")
    meta = json.loads((d / "recording.json").read_text())
    meta["provenance"]["code"]["loopmodel"] = "0" * 64
    (d / "recording.json").write_text(json.dumps(meta))
    with pytest.raises(DormouseError, match="module 'loopmodel' changed since the recording"):
        make_reference(d, log=QUIET)


def test_objective_that_does_not_fit_the_outputs(tmp_path):
    """A one-process recording (no torchrun) of a classifier declared causal_lm."""
    from loopmodel import build_classifier, collate, dataset

    model = build_classifier(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(tmp_path / "r", model, RecordingSpec(build_model="loopmodel:build_classifier",
                                                        build_optimizer="loopmodel:build_optimizer",
                                                        objective="causal_lm", build_kwargs={}))
    batch = collate(dataset(4, 0))
    model(**batch).sum().backward()
    rec.step(loss=0.0, optimizer=opt)
    opt.step()
    rec.close()
    with pytest.raises(DormouseError, match="objective 'causal_lm' does not fit the model's outputs: logits of shape"):
        make_reference(tmp_path / "r", log=QUIET)


def test_recorder_bad_arguments_are_one_line(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(DormouseError, match="is not an import path"):
        Recorder(tmp_path, model, RecordingSpec(build_model="no_colon", build_optimizer="a:b"))
    with pytest.raises(DormouseError, match="objective 'mse' is none of"):
        Recorder(tmp_path, model, RecordingSpec(build_model="a:b", build_optimizer="a:b", objective="mse"))
    with pytest.raises(DormouseError, match="the number of steps done before this recording"):
        Recorder(tmp_path / "empty", model, RecordingSpec(build_model="a:b", build_optimizer="a:b", start=-1))


def test_user_objective_one_process(tmp_path):
    """objective="pkg.mod:fn" and world 1 without torch.distributed: a one-process loop passes its own gate."""
    looprec.one_process(tmp_path / "r", objective="loopmodel:token_sum")
    make_reference(tmp_path / "r", log=QUIET)
    v = judge_recording(tmp_path / "r")
    assert v.passed, failing(v)


def test_data_check_epochs_one_process(tmp_path):
    """The same 4 rows at steps 1 and 2: with dataset_len 8 that is a read
    twice within epoch 0 (FAIL); with dataset_len unknown only each step is
    checked (PASS, the epoch check said skipped); with dataset_len 4 the
    second step starts epoch 1 (PASS)."""
    same = [[0, 1, 2, 3], [0, 1, 2, 3]]
    for name, n, ok, words in (("n8", 8, False, "read twice within epoch 0 (steps 1 and 2, dataset_len 8)"),
                               ("n0", 0, True, "the once-per-epoch check was skipped"),
                               ("n4", 4, True, "epochs inferred from dataset_len")):
        d = looprec.one_process(tmp_path / name, n=8, dataset_len=n, order=same)
        c = looprec.verdict(d).check("data")
        assert c.passed == ok and words in c.reason, (name, c.reason)


def test_cli_exit_codes(recordings, tmp_path, capsys):
    from dormouse.__main__ import main

    assert main(["gate", "check", "--out", str(recordings["clean2"])]) == 0
    assert "PASS" in capsys.readouterr().out
    written = json.loads((recordings["clean2"] / "verdict.json").read_text())
    assert written["pass"] is True
    import jsonschema

    jsonschema.validate(written, json.loads((ROOT / "docs" / "verdict.schema.json").read_text()))
    assert main(["gate", "check", "--out", str(recordings["comp_none"])]) == 1
    assert "[FAIL] gradient" in capsys.readouterr().out
    assert main(["gate", "check", "--out", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "holds no recording" in err[-1]
