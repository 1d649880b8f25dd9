"""dormouse.model.decode: the one-position Decoder computes what the model's
forward computes (through the window and past it, one sequence or a batch, every
arm on or off), and a decoder that computes anything else is caught."""

from __future__ import annotations

import pytest
import torch

from dormouse.config import preset
from dormouse.model import DormouseModel
from dormouse.model.decode import Decoder

ARMS = {
    "all": {},
    "no adapters": {"rank": 0},
    "no engram": {"engram_rows": 0, "engram_dim": 0},
    "no moe": {"n_experts": 0},
    "moe only": {"shared_rank": 0},
    "attention only": {"n_experts": 0, "shared_rank": 0, "engram_rows": 0, "engram_dim": 0},
}


def _model(name: str = "tiny", **over) -> DormouseModel:
    cfg = preset(name)
    for k, v in {"max_seq_len": 16, "init_std": 0.2, **over}.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = DormouseModel(cfg).eval()
    with torch.no_grad():
        if model.block.moe is not None:  # a trained routing bias: it moves the choice
            model.block.moe.router_bias.normal_(0, 0.1)
        if model.cfg.rank:  # trained adapters (B and D start at zero)
            att = model.block.attn
            att.lora_qkv_b.normal_(0, 0.2)
            att.lora_out_b.normal_(0, 0.2)
        for norm in (model.block.attn_norm, model.block.ffn_norm, model.final_norm):  # trained gains (start at 1):
            if norm is not None:  # the decoder folds each into the matrices that read its output
                norm.gain.normal_(1, 0.3)
    return model


def assert_decodes(decoded: torch.Tensor, whole: torch.Tensor) -> None:
    """The decoder's logits against the whole-text forward's, within 1e-5 of
    the logits' scale (their largest magnitude; ~80 float32 ulps of it): the
    decoder groups the same products differently (merged adapters, folded
    norm gains, another gemm layout), and round-off grows with the logits. The
    forward's own cached path is within ~4e-6 of the scale here, the decoder
    within ~6e-6; a missing norm gain, a wrong eps or a stale adapter is
    1e-4 or more."""
    torch.testing.assert_close(decoded, whole, rtol=0, atol=1e-5 * float(whole.abs().max()))


def _decoded(model, x, prompt: int, decoder=None):
    """Logits of every position of x (B, T): the prompt through the forward
    with a cache, then one position a step through the decoder."""
    decoder = decoder or Decoder(model)
    with torch.no_grad():
        cache = model.new_cache()
        parts = [model(x[:, :prompt], cache=cache)[0]]
        for t in range(prompt, x.shape[1]):
            parts.append(decoder.step(x[:, t], cache)[:, None])
    assert cache.length == x.shape[1]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("arms", list(ARMS))
@pytest.mark.parametrize("batch", [1, 3])  # one sequence: its k experts directly; several: every expert
def test_the_decoder_computes_the_sliding_forward_through_and_past_the_window(arms, batch):
    model = _model(**ARMS[arms])
    x = torch.randint(0, 256, (batch, 40), generator=torch.Generator().manual_seed(1))  # 40 > window 16
    with torch.no_grad():
        whole = model(x, sliding=True)[0]
    assert_decodes(_decoded(model, x, prompt=5), whole)


def test_the_decoder_follows_the_small_preset_past_its_rope_table():
    # Four iterations of d=256 at init_std 0.2 amplify round-off: the forward's
    # own cached path is 2e-4 of the logits' scale from the whole-text forward,
    # so the bound is stated against that scale.
    model = _model("small", max_seq_len=32)
    x = torch.randint(0, 256, (2, 75), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(x, sliding=True)[0]
    scale = float(whole.abs().max())
    torch.testing.assert_close(_decoded(model, x, prompt=1), whole, rtol=0, atol=4e-4 * scale)


def test_a_decoder_that_computes_another_function_is_caught():
    # The decoder copies the weights it concatenates: one built before an
    # adapter moved computes the old network, and the comparison above sees it.
    model = _model()
    stale = Decoder(model)
    with torch.no_grad():
        model.block.attn.lora_qkv_a[1].add_(1e-3)
        x = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
        whole = model(x, sliding=True)[0]
    with pytest.raises(AssertionError):
        assert_decodes(_decoded(model, x, prompt=4, decoder=stale), whole)
    assert_decodes(_decoded(model, x, prompt=4), whole)


def test_a_capacity_dropping_moe_has_no_decoder():
    with pytest.raises(ValueError, match="capacity"):
        Decoder(_model(moe_capacity=1.0))


def test_one_sequence_hashes_its_ngrams_exactly_as_ngram_rows():
    # The one-sequence step hashes in Python integers; every context length,
    # the sentinel-padded ones shorter than max_n included, gives ngram_rows'
    # rows of the last position, bitwise.
    from dormouse.model.engram import ngram_rows

    model = _model("small")
    eg, dec = model.engram, Decoder(model)
    K, rows = eg.table.shape[:2]
    gen = torch.Generator().manual_seed(4)
    for length in range(1, model.cfg.engram_max_n + 3):
        for _ in range(20):
            ctx = torch.randint(0, 256, (1, length), generator=gen)
            want = ngram_rows(ctx, eg.multipliers, eg.rows)[0, -1] + torch.arange(K) * rows
            got = dec._ngram_rows_one(ctx[0, -model.cfg.engram_max_n:].tolist())
            assert got == want.tolist()
