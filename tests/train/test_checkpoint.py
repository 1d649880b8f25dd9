"""dormouse.train.checkpoint and dormouse.atomic: what a checkpoint holds, that
it loads with weights_only, refuses another network, and is written atomically."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dormouse import atomic
from dormouse.config import RunConfig, TrainConfig, preset
from dormouse.errors import CheckpointError
from dormouse.train.checkpoint import checkpoint_path, find_checkpoint, load_checkpoint, save_checkpoint
from dormouse.train.loop import LocalSync, build_model, make_optimizer, train


def _run(out: Path, data: Path, **changes) -> RunConfig:
    model_changes = {k: changes.pop(k) for k in list(changes) if hasattr(preset("tiny"), k)}
    kw = dict(steps=4, batch=2, seq_len=32, log_every=100, ckpt_every=2, out_dir=str(out), data=str(data))
    kw.update(changes)
    return RunConfig(model=dataclasses.replace(preset("tiny"), **model_changes), train=TrainConfig(**kw))


def _trained(tmp_path: Path, data: Path, **changes):
    run = _run(tmp_path / "out", data, **changes)
    model = build_model(run)
    train(model, run, log=lambda _: None)
    return run, model


def test_checkpoint_loads_with_weights_only_and_holds_model_optimizer_step_and_config(tmp_path, cyclic_corpus):
    run, model = _trained(tmp_path, cyclic_corpus)
    path = tmp_path / "out" / "dormouse.pt"
    assert checkpoint_path(run, sharded=False) == path
    payload = torch.load(path, map_location="cpu", weights_only=True)
    assert set(payload) == {"meta", "model", "optim"}
    meta = json.loads(payload["meta"])
    assert meta["step"] == 4 and RunConfig.from_dict(meta["config"]) == run
    state = model.state_dict()
    assert list(payload["model"]) == list(state)
    for k, v in state.items():
        assert torch.equal(payload["model"][k], v), k
    # the routing bias (a buffer the balancer moved) travels with the model
    assert torch.count_nonzero(payload["model"]["block.moe.router_bias"]) > 0
    assert int(payload["optim"]["embed.weight"]["step"]) == 4
    assert set(payload["optim"]["block.attn.qkv"]) == {"momentum"}


def test_save_then_load_restores_model_and_optimizer_into_fresh_objects(tmp_path, cyclic_corpus):
    run, model = _trained(tmp_path, cyclic_corpus)
    path = tmp_path / "out" / "dormouse.pt"
    opt_state = torch.load(path, weights_only=True)["optim"]
    fresh = build_model(dataclasses.replace(run, train=dataclasses.replace(run.train, seed=5)))
    assert not torch.equal(fresh.embed.weight, model.embed.weight)
    opt = make_optimizer(fresh, run)
    step = load_checkpoint(path, model=fresh, opt=opt, run=run, peers=LocalSync(run))
    assert step == 4
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for name, s in opt_state.items():
        for key, t in s.items():
            assert torch.equal(opt.state[name][key], t), (name, key)


@pytest.mark.parametrize("change, field", [(dict(d_ffn=64), "model.d_ffn"), (dict(rank=4), "model.rank"),
                                           (dict(opt="adamw"), "train.opt"),
                                           (dict(muon_variant="normuon"), "train.muon_variant")])
def test_checkpoint_of_another_configuration_is_refused_by_name(tmp_path, cyclic_corpus, change, field):
    _trained(tmp_path, cyclic_corpus)
    other = _run(tmp_path / "out", cyclic_corpus, steps=6, resume=True, **change)
    with pytest.raises(CheckpointError) as info:
        train(build_model(other), other, log=lambda _: None)
    msg = str(info.value)
    assert field in msg and "dormouse.pt" in msg and "\n" not in msg


def test_a_torn_checkpoint_file_is_a_checkpoint_error(tmp_path, cyclic_corpus):
    run, model = _trained(tmp_path, cyclic_corpus)
    path = tmp_path / "out" / "dormouse.pt"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(path, model=model, opt=make_optimizer(model, run), run=run, peers=LocalSync(run))


def test_loading_a_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    run = RunConfig()
    model = build_model(run)
    with pytest.raises(CheckpointError, match="none.pt"):
        load_checkpoint(tmp_path / "none.pt", model=model, opt=make_optimizer(model, run), run=run,
                        peers=LocalSync(run))


def test_resume_from_a_missing_checkpoint_is_a_checkpoint_error(tmp_path, cyclic_corpus):
    run = _run(tmp_path / "out", cyclic_corpus, resume_from=str(tmp_path / "gone.pt"))
    with pytest.raises(CheckpointError, match="gone.pt"):
        train(build_model(run), run, log=lambda _: None)


def test_save_checkpoint_replaces_the_file_and_leaves_no_temporary(tmp_path):
    run = RunConfig(train=TrainConfig(out_dir=str(tmp_path)))
    model = build_model(run)
    opt = make_optimizer(model, run)
    path = checkpoint_path(run, sharded=False)
    for step in (1, 2):
        save_checkpoint(path, model=model, opt=opt, step=step, run=run, peers=LocalSync(run))
    assert json.loads(torch.load(path, weights_only=True)["meta"])["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["dormouse.pt"]


def test_atomic_write_that_fails_midway_keeps_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.bin"
    atomic.write_bytes(target, b"old")

    def half_then_crash(tmp: Path) -> None:
        tmp.write_bytes(b"ne")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic._atomic(target, half_then_crash)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    atomic.write_text(target, "new")
    assert target.read_text() == "new"


def test_check_writable_raises_os_error_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    atomic.check_writable(tmp_path / "ok" / "deep")
    assert (tmp_path / "ok" / "deep").is_dir() and list((tmp_path / "ok" / "deep").iterdir()) == []
    with pytest.raises(OSError):
        atomic.check_writable(tmp_path / "f" / "sub")


def test_a_sharded_checkpoint_caught_mid_swap_is_still_found(tmp_path):
    # A run killed between the two renames leaves only .<name>.dcp.old.
    run = RunConfig(train=TrainConfig(out_dir=str(tmp_path), ckpt_name="c", resume=True))
    (tmp_path / ".c.dcp.old").mkdir()
    assert find_checkpoint(run, sharded=True) == tmp_path / ".c.dcp.old"
    (tmp_path / "c.dcp").mkdir()
    assert find_checkpoint(run, sharded=True) == tmp_path / "c.dcp"


def test_sharded_checkpoints_are_directories_with_another_suffix():
    run = RunConfig(train=TrainConfig(out_dir="/x", ckpt_name="c"))
    assert checkpoint_path(run, sharded=True) == Path("/x/c.dcp")
    assert checkpoint_path(run, sharded=False) == Path("/x/c.pt")
