"""dormouse.config: fields, JSON round trip, validation messages, presets."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dormouse.config import (
    DATA_ORDERS, DIST_REDUCES, DIST_SHARDS, MUON_VARIANTS, NS_KINDS, OPTIMIZERS, PRESETS,
    ModelConfig, RunConfig, TrainConfig, preset,
)
from dormouse.errors import ConfigError, DormouseError

# The distributed gate's TINY dict, as its driver (the user's specification)
# writes it: every key must be a ModelConfig field.
GATE_TINY = dict(
    d_model=64, n_heads=4, head_dim=16, d_ffn=128, vocab=256, max_seq_len=64,
    max_iter=2, rank=8, n_experts=4, moe_topk=2, engram_rows=64, engram_dim=8,
    bf16=False, shared_rank=16, moe_capacity=0.0,
)


def test_every_field_of_the_gate_tiny_dict_is_a_model_config_field():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(GATE_TINY) <= names, set(GATE_TINY) - names
    cfg = ModelConfig(**GATE_TINY).validate()
    for key, value in GATE_TINY.items():
        assert getattr(cfg, key) == value


def test_gate_tiny_dict_equals_the_tiny_preset():
    # The gate and the `tiny` preset describe the same network.
    assert ModelConfig(**GATE_TINY) == preset("tiny")


def _non_default_run() -> RunConfig:
    """A RunConfig with every field moved off its default (and floats that are
    not exactly representable in binary), so a dropped or retyped field shows."""
    model = ModelConfig(
        vocab=300, d_model=60, n_heads=3, head_dim=20, max_seq_len=40, max_iter=3, rank=5,
        d_ffn=72, n_experts=6, moe_topk=3, moe_capacity=1.25, moe_bias_rate=0.1,
        shared_rank=7, engram_rows=33, engram_dim=5, engram_max_n=4, engram_heads=3,
        rope_base=500.5, init_std=0.015, bf16=True,
    )
    train = TrainConfig(
        seed=7, steps=123, batch=3, micro_batch=1, seq_len=33, lr=1.1e-3, schedule="cosine", warmup=9,
        min_lr_frac=0.3, wd=0.01, grad_clip=0.7, opt="adamw", ns_steps=6,
        ns_kind="polar_express", ns_dtype="float32", ns_kernel="fp32", muon_momentum=0.9, muon_nesterov=False,
        muon_variant="normuon", muon_sf="original", muon_colrow_3d=False,
        muon_state_dtype="bfloat16", adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-7,
        log_every=3, eval_every=5, eval_frac=0.2, ckpt_every=4, ckpt_name="x1",
        out_dir="/tmp/somewhere", data="corpus.txt", data_order="shuffle", resume=True, resume_from="/tmp/ck.pt", stop_at=50, dist=True,
        dist_profile="4,2", dist_reduce="bf16", dist_shard="fsdp", dist_bucket_mb=12.5,
    )
    return RunConfig(source="unit-test", model=model, train=train)


def test_non_default_run_really_moves_every_field_off_its_default():
    # Guards the round-trip test below against silently testing defaults.
    run = _non_default_run()
    for cfg, cls in ((run.model, ModelConfig), (run.train, TrainConfig)):
        default = cls()
        same = [f.name for f in dataclasses.fields(cls) if getattr(cfg, f.name) == getattr(default, f.name)]
        assert same == []


def test_run_config_json_round_trip_is_exact():
    run = _non_default_run().validate()
    back = RunConfig.from_json(run.to_json())
    assert back == run
    assert back.to_dict() == run.to_dict()
    # types survive too (an int must not come back as a float or a str)
    for cfg, orig in ((back.model, run.model), (back.train, run.train)):
        for f in dataclasses.fields(cfg):
            assert type(getattr(cfg, f.name)) is type(getattr(orig, f.name)), f.name


def test_run_config_json_is_plain_json_with_sections():
    d = json.loads(RunConfig().to_json())
    assert set(d) == {"source", "model", "train"}
    assert d["model"]["d_model"] == ModelConfig().d_model


def test_from_dict_rejects_an_unknown_field_by_name():
    with pytest.raises(ConfigError, match="d_modle"):
        RunConfig.from_dict({"model": {"d_modle": 64}})


def _raises(cfg, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    assert "\n" not in msg  # one message, one line
    return msg


def test_heads_times_head_dim_must_equal_d_model():
    _raises(ModelConfig(d_model=64, n_heads=4, head_dim=8), "n_heads", "head_dim", "d_model", "32", "64")


def test_moe_topk_above_n_experts_is_refused():
    _raises(ModelConfig(n_experts=4, moe_topk=5), "moe_topk", "n_experts", "5", "4")


def test_seq_len_above_max_seq_len_is_refused_by_run_config():
    run = RunConfig(model=ModelConfig(max_seq_len=64), train=TrainConfig(seq_len=65))
    run.train.validate()  # each part alone is fine ...
    run.model.validate()
    _raises(run, "seq_len", "max_seq_len", "65", "64")  # ... together they are not


@pytest.mark.parametrize(
    "field, allowed",
    [("opt", OPTIMIZERS), ("ns_kind", NS_KINDS), ("muon_variant", MUON_VARIANTS),
     ("dist_reduce", DIST_REDUCES), ("dist_shard", DIST_SHARDS), ("data_order", DATA_ORDERS)],
)
def test_unknown_choice_is_refused_naming_the_field_and_the_allowed_values(field, allowed):
    cfg = TrainConfig(**{field: "bogus"})
    _raises(cfg, f"train.{field}", "'bogus'", *(repr(a) for a in allowed))
    for a in allowed:  # and every allowed value passes
        TrainConfig(**{field: a}).validate()


@pytest.mark.parametrize(
    "cls, field, value",
    [(ModelConfig, "d_model", -64), (ModelConfig, "max_iter", 0), (ModelConfig, "rank", -1),
     (ModelConfig, "n_experts", -2), (ModelConfig, "shared_rank", -1),
     (ModelConfig, "engram_rows", -1), (TrainConfig, "steps", -5), (TrainConfig, "batch", 0),
     (TrainConfig, "seq_len", -1), (TrainConfig, "ckpt_every", -1), (TrainConfig, "lr", -1e-3)],
)
def test_negative_or_zero_sizes_are_refused_by_name(cls, field, value):
    section = "model" if cls is ModelConfig else "train"
    msg = _raises(cls(**{field: value}), f"{section}.{field}", str(value))
    assert "must be" in msg


@pytest.mark.parametrize(
    "cls, field, value, want",
    [(ModelConfig, "n_heads", "two", "int"), (ModelConfig, "d_model", 64.0, "int"),
     (ModelConfig, "bf16", 1, "bool"), (ModelConfig, "moe_capacity", "0", "float"),
     (TrainConfig, "steps", "two", "int"), (TrainConfig, "batch", True, "int"),
     (TrainConfig, "lr", "3e-3", "float"), (TrainConfig, "opt", 3, "str")],
)
def test_wrong_types_are_refused_by_name(cls, field, value, want):
    section = "model" if cls is ModelConfig else "train"
    _raises(cls(**{field: value}), f"{section}.{field}", repr(value), want)


def test_an_int_for_a_float_field_is_accepted():
    TrainConfig(lr=1, wd=0).validate()
    ModelConfig(moe_capacity=1).validate()


def test_engram_rows_and_dim_must_be_switched_on_and_off_together():
    _raises(ModelConfig(engram_rows=64, engram_dim=0), "engram_rows", "engram_dim")
    ModelConfig(engram_rows=0, engram_dim=0).validate()


def test_vocab_below_256_is_refused_because_tokens_are_bytes():
    _raises(ModelConfig(vocab=255), "model.vocab", "255", "256")


def test_rope_base_must_be_positive():
    _raises(ModelConfig(rope_base=0.0), "model.rope_base")


def test_micro_batch_must_not_be_negative_and_its_divisibility_is_the_plans():
    with pytest.raises(ConfigError, match=r"train.micro_batch = -1 must be >= 0"):
        TrainConfig(micro_batch=-1).validate()
    # Whether it divides each rank's batch is FleetPlan's rule (tests/train/test_data.py), stated once.
    TrainConfig(batch=4, micro_batch=3).validate()
    TrainConfig(batch=4, micro_batch=3, dist_profile="3,6").validate()


def test_dist_capacity_is_the_old_name_of_dist_profile_in_python_and_in_json():
    assert TrainConfig(dist_capacity="4,2").dist_profile == "4,2"
    t = TrainConfig(dist_profile="3,1")
    assert t.dist_capacity == "3,1" and dataclasses.replace(t, dist_capacity="2,2").dist_profile == "2,2"
    assert dataclasses.replace(t, dist_profile="2,1").dist_profile == "2,1"  # the new name is not undone
    assert dataclasses.replace(t, batch=9).dist_profile == "3,1"
    old = RunConfig.from_json('{"train": {"dist_capacity": "2,1"}}')
    assert old.train.dist_profile == "2,1" and "dist_capacity" not in old.to_json()
    assert "exact" in DIST_REDUCES


def test_eval_every_without_a_held_out_tail_is_refused():
    _raises(TrainConfig(eval_every=10, eval_frac=0.0), "eval_every", "eval_frac")


def test_config_error_is_a_dormouse_error_and_a_value_error():
    with pytest.raises(DormouseError):
        TrainConfig(opt="sgd").validate()
    with pytest.raises(ValueError):
        TrainConfig(opt="sgd").validate()


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_presets_exist_and_validate(name):
    assert name in PRESETS
    cfg = preset(name).validate()
    assert isinstance(cfg, ModelConfig)
    RunConfig(model=cfg, train=TrainConfig(seq_len=cfg.max_seq_len)).validate()


def test_small_preset_is_larger_than_tiny():
    tiny, small = preset("tiny"), preset("small")
    assert small.d_model > tiny.d_model and small.max_iter >= tiny.max_iter


def test_preset_returns_a_fresh_copy():
    cfg = preset("tiny")
    cfg.d_model = 999
    assert PRESETS["tiny"].d_model == 64
    assert preset("tiny").d_model == 64


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="tiny.*small|small.*tiny"):
        preset("huge")


def test_defaults_validate():
    RunConfig().validate()
