"""dormouse.infer: the KV cache computes what the whole window computes,
generation is deterministic for a seed and slides the window, file_loss is the
mean next-byte loss, and checkpoints of every kind load."""

from __future__ import annotations

import math

import pytest
import torch

from dormouse.config import RunConfig, TrainConfig, preset
from dormouse.errors import CheckpointError, ConfigError
from dormouse.infer import file_loss, generate, generate_many, load_trained, sample_text
from dormouse.model import DormouseModel
from dormouse.train.data import _windows
from dormouse.train.loop import build_model, train


def _model(name: str = "tiny", **over) -> DormouseModel:
    # A larger init_std than training uses makes the logits peaked, so a greedy
    # comparison is not decided by rounding between near-equal bytes.
    cfg = preset(name)
    for k, v in {"max_seq_len": 16, "init_std": 0.2, **over}.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return DormouseModel(cfg).eval()


@pytest.mark.parametrize("chunks", [[7, 1, 1, 1, 1, 1], [1] * 12, [5, 3, 4], [16, 1, 1, 5, 1, 9, 1, 1],
                                    [3] * 14, [40, 1, 1], [1] * 40])  # the last four pass max_seq_len 16
def test_cached_forward_equals_the_uncached_sliding_forward_over_the_whole_text(chunks):
    model = _model()
    x = torch.randint(0, 256, (2, sum(chunks)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(x, sliding=True)[0]
        cache, parts, at = model.new_cache(), [], 0
        for n in chunks:
            parts.append(model(x[:, at:at + n], cache=cache)[0])
            at += n
    assert cache.length == x.shape[1]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=0, atol=2e-5)


def test_sliding_is_the_plain_forward_within_the_window_and_the_plain_forward_refuses_past_it():
    model = _model()
    x = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x[:, :16], sliding=True)[0], model(x[:, :16])[0])
        with pytest.raises(ValueError, match="max_seq_len"):
            model(x)
        # Past the window, position t is not a fresh window of the last 16 bytes:
        # its deeper iterations carry what the earlier windows saw.
        slid = model(x, sliding=True)[0][:, -1]
        fresh = model(x[:, -16:])[0][:, -1]
    assert (slid - fresh).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("prompt", [b"a", b"hello there", bytes(range(40, 70))])  # the last is longer than the window
def test_greedy_generation_with_the_cache_equals_the_uncached_recompute_and_slides_the_window(name, prompt):
    model = _model(name)
    cached = generate(model, prompt, tokens=40, temperature=0)  # 40 > max_seq_len 16: the window slides
    uncached = generate(model, prompt, tokens=40, temperature=0, use_cache=False)
    assert cached == uncached and len(cached) == 40
    assert len(set(cached)) > 3  # not a constant run, which would match trivially


def test_the_greedy_comparison_sees_a_fault_of_one_adapter_by_1e_2():
    # The byte-for-byte comparison above could fail: a network whose adapter
    # entries are 1e-2 away already gives other greedy bytes (the logits are
    # peaked on purpose; tests/model/test_decode.py catches a fault of 1e-3
    # in the decoder's logits).
    model = _model()
    want = generate(model, b"hello there", tokens=40, temperature=0, use_cache=False)
    with torch.no_grad():
        model.block.attn.lora_qkv_b[1].add_(1e-2)  # iteration 1's adapter (B starts at zero)
    assert generate(model, b"hello there", tokens=40, temperature=0) != want


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_batch_of_samples_is_generate_row_by_row_when_greedy_and_deterministic_when_sampled(use_cache):
    model = _model()  # 5 + 30 bytes: past the window of 16
    greedy = generate(model, b"hello", tokens=30, temperature=0)
    assert generate_many(model, b"hello", samples=3, tokens=30, temperature=0, use_cache=use_cache) == [greedy] * 3
    rows = generate_many(model, b"hello", samples=4, tokens=30, temperature=1.0, seed=7, use_cache=use_cache)
    assert rows == generate_many(model, b"hello", samples=4, tokens=30, temperature=1.0, seed=7)  # cached
    assert len(set(rows)) == 4 and all(len(r) == 30 for r in rows)
    assert generate_many(model, b"hello", samples=1, tokens=30, seed=7, use_cache=use_cache) == [
        generate(model, b"hello", tokens=30, seed=7)]


def test_greedy_generation_within_the_window_is_what_the_plain_forward_picks():
    # Within max_seq_len the cached generator is the plain forward (no sliding):
    # each byte is the argmax of the plain forward over prompt + bytes so far.
    model = _model("small", max_seq_len=64)
    out = generate(model, b"def f(x):", tokens=40, temperature=0)
    text = list(b"def f(x):")
    with torch.no_grad():
        for b in out:
            assert b == int(model(torch.tensor([text]))[0][0, -1].argmax())
            text.append(b)


def test_sampling_is_deterministic_for_a_seed_and_top_k_1_is_greedy():
    model = _model()
    a = generate(model, b"xy", tokens=30, temperature=1.0, seed=3)
    assert a == generate(model, b"xy", tokens=30, temperature=1.0, seed=3)
    assert a == generate(model, b"xy", tokens=30, temperature=1.0, seed=3, use_cache=False)
    assert a != generate(model, b"xy", tokens=30, temperature=1.0, seed=4)
    assert generate(model, b"xy", tokens=20, top_k=1, seed=5) == generate(model, b"xy", tokens=20, temperature=0)


def test_a_capacity_dropping_moe_generates_without_a_cache():
    model = _model(moe_capacity=1.0)
    with pytest.raises(ValueError, match="capacity"):
        model.new_cache()
    assert generate(model, b"ab", tokens=5, temperature=0) == generate(model, b"ab", tokens=5, temperature=0,
                                                                       use_cache=False)


@pytest.mark.parametrize("kw, fragment", [
    (dict(prompt=b""), "prompt is empty"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(samples=0), "samples"),
])
def test_bad_generation_arguments_are_config_errors(kw, fragment):
    args = dict(prompt=b"a", tokens=3, temperature=1.0, top_k=0)
    args.update(kw)
    with pytest.raises(ConfigError, match=fragment):
        generate_many(_model(), args.pop("prompt"), samples=args.pop("samples", 1), **args)


def test_file_loss_is_the_token_mean_over_consecutive_windows(tmp_path):
    model = _model()
    data = bytes(torch.randint(0, 256, (16 * 17 + 5,), generator=torch.Generator().manual_seed(2)).tolist())
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    nats, count = file_loss(model, path, seq_len=16, batch=5)
    assert count == 16 * 16  # 16 windows of 17 bytes; the 5 left over are not scored
    x, y = _windows(data[:16 * 17], 16, 16)
    with torch.no_grad():
        want = float(model(x, y)[1])
    assert nats == pytest.approx(want, rel=1e-6)
    tail_nats, tail_count = file_loss(model, path, seq_len=16, tail_frac=0.5)
    assert tail_count == (len(data) - int(len(data) * 0.5)) // 17 * 16
    assert math.isfinite(tail_nats)
    with pytest.raises(ConfigError, match="fewer than one window"):
        file_loss(model, path, seq_len=16, tail_frac=0.01)


def test_load_trained_reads_a_run_checkpoint_and_refuses_others(tmp_path):
    data = tmp_path / "c.bin"
    data.write_bytes(bytes(range(16)) * 100)
    run = RunConfig(model=preset("tiny"), train=TrainConfig(steps=2, batch=2, seq_len=16, ckpt_every=2,
                                                            out_dir=str(tmp_path / "o"), data=str(data)))
    trained = build_model(run)
    train(trained, run, log=lambda _: None)
    model, loaded_run, step = load_trained(tmp_path / "o" / "dormouse.pt")
    ckpt = str(tmp_path / "o" / "dormouse.pt")  # `dormouse sample`: one text, or a batch under headers
    one = sample_text(ckpt, "ab", tokens=12, seed=1)
    three = sample_text(ckpt, "ab", tokens=12, seed=1, samples=3).split("\n")
    assert one == generate(model, b"ab", tokens=12, seed=1).decode("utf-8", errors="replace")
    assert three[0::2] == [f"--- sample {i} ---" for i in range(3)] and len(three) == 6
    assert step == 2 and loaded_run.model == run.model and not model.training
    for (name, a), b in zip(trained.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="does not exist"):
        load_trained(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_trained(tmp_path / "junk.pt")
