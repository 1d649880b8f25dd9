"""dormouse.model: the looped block, its arms (adapters, MoE, shared expert,
Engram), aux diagnostics, causality, gradients, bf16 and the Engram hash."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dormouse.config import RunConfig, TrainConfig, preset
from dormouse.model import DormouseModel
from dormouse.model.engram import hash_multipliers, ngram_rows
from dormouse.model.moe import MoE
from dormouse.train.loop import build_model, train
from dormouse.train.optim import MixOptimizer


def _model(seed: int = 0, **changes) -> DormouseModel:
    torch.manual_seed(seed)
    return DormouseModel(dataclasses.replace(preset("tiny"), **changes))


def _bytes(B: int, T: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (B, T + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _names(model) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def test_initial_loss_is_close_to_ln_256():
    x, y = _bytes(4, 64)
    _, loss, _ = _model()(x, y)
    assert abs(loss.item() - math.log(256)) < 0.05


def test_forward_returns_logits_of_shape_batch_time_vocab_and_no_loss_without_targets():
    x, _ = _bytes(2, 10)
    logits, loss, _ = _model()(x)
    assert logits.shape == (2, 10, 256)
    assert loss is None


def test_window_longer_than_max_seq_len_is_refused():
    x, _ = _bytes(1, 65)
    with pytest.raises(ValueError, match="max_seq_len"):
        _model()(x)


def test_parameter_names_show_every_arm():
    names = _names(_model())
    for arm in ("engram", "router", "expert", "shared", "lora"):
        assert any(arm in n for n in names), (arm, names)


# (changes that switch an arm off, substrings no parameter may then contain)
ARMS_OFF = {
    "adapters": (dict(rank=0), ["lora"]),
    "moe": (dict(n_experts=0), ["router", "expert_", "block.moe."]),
    "shared_expert": (dict(shared_rank=0), ["shared"]),
    "engram": (dict(engram_rows=0, engram_dim=0), ["engram"]),
    "all": (dict(rank=0, n_experts=0, shared_rank=0, engram_rows=0, engram_dim=0),
            ["lora", "router", "expert", "shared", "engram"]),
}


@pytest.mark.parametrize("arm", sorted(ARMS_OFF))
def test_an_arm_of_size_zero_owns_no_parameters_and_the_model_still_runs(arm):
    changes, forbidden = ARMS_OFF[arm]
    full, off = _model(), _model(**changes)
    names = _names(off)
    for bad in forbidden:
        assert not [n for n in names if bad in n], (bad, names)
    # it really lost parameters, and kept the trunk
    assert sum(p.numel() for p in off.parameters()) < sum(p.numel() for p in full.parameters())
    assert {"embed.weight", "head.weight", "block.attn.qkv"} <= set(names)
    x, y = _bytes(2, 16)
    logits, loss, aux = off(x, y)
    assert logits.shape == (2, 16, 256) and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in off.parameters())
    if "n_experts" in changes:
        assert aux["topk"] == [] and aux["loads"].shape == (off.cfg.max_iter, 0) and aux["dropped"] == 0


def test_aux_holds_per_iteration_topk_ids_and_loads_summing_to_tokens_times_k():
    cfg = preset("tiny")
    B, T = 3, 20
    x, y = _bytes(B, T)
    _, _, aux = _model()(x, y)
    assert len(aux["topk"]) == cfg.max_iter
    for it, ids in enumerate(aux["topk"]):
        assert ids.shape == (B, T, cfg.moe_topk)
        assert ids.min() >= 0 and ids.max() < cfg.n_experts
        # a token picks k DISTINCT experts
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
        # the loads are the counts of those choices
        assert torch.equal(aux["loads"][it], torch.bincount(ids.flatten(), minlength=cfg.n_experts).float())
    assert aux["loads"].shape == (cfg.max_iter, cfg.n_experts)
    assert aux["loads"].sum(-1).tolist() == [B * T * cfg.moe_topk] * cfg.max_iter


def test_dropless_moe_drops_nothing_and_equals_a_capacity_too_large_to_bind():
    x, y = _bytes(4, 32)
    logits, loss, aux = _model(moe_capacity=0.0)(x, y)
    assert aux["dropped"] == 0
    # A capacity factor of E / k keeps every assignment an expert could get:
    # the capacity path then drops nothing and computes the same network.
    cfg = preset("tiny")
    roomy_logits, roomy_loss, roomy_aux = _model(moe_capacity=cfg.n_experts / cfg.moe_topk)(x, y)
    assert roomy_aux["dropped"] == 0
    assert torch.equal(logits, roomy_logits) and torch.equal(loss, roomy_loss)


def test_capacity_factor_drops_the_overflow_of_each_expert():
    cfg = dataclasses.replace(preset("tiny"), moe_capacity=0.5)
    B, T = 3, 21  # c * N * k / E = 15.75: the rounding up shows
    _, _, aux = _model(moe_capacity=0.5)(*_bytes(B, T))
    # each expert keeps ceil(c * N * k / E) assignments and drops the rest
    keep = math.ceil(0.5 * B * T * cfg.moe_topk / cfg.n_experts)
    expected = int((aux["loads"] - keep).clamp(min=0).sum())
    assert aux["dropped"] == expected
    # with c = 0.5 at least half of all assignments cannot fit
    assert aux["dropped"] >= cfg.max_iter * (B * T * cfg.moe_topk - cfg.n_experts * keep) > 0


def _naive_moe(moe: MoE, x: torch.Tensor, it: int, keep: int | None = None) -> torch.Tensor:
    """The MoE formula token by token: sum over chosen e of w_e * SwiGLU_e(x).
    With `keep`, each expert serves only its first `keep` assignments in token
    order (the capacity rule); later ones contribute nothing."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(moe.router(flat), dim=-1)
    chosen = torch.topk(probs + moe.router_bias[it], moe.topk, dim=-1).indices
    out = torch.zeros_like(flat)
    served = [0] * moe.n_experts
    for n in range(flat.shape[0]):
        w = probs[n, chosen[n]] / probs[n, chosen[n]].sum()
        for slot, e in enumerate(chosen[n].tolist()):
            served[e] += 1
            if keep is not None and served[e] > keep:
                continue
            h = F.silu(moe.expert_w_gate[e] @ flat[n]) * (moe.expert_w_up[e] @ flat[n])
            out[n] += w[slot] * (moe.expert_w_down[e] @ h)
    return out.view_as(x)


def test_dropless_moe_equals_the_token_by_token_formula():
    torch.manual_seed(0)
    moe = MoE(d_model=16, d_ffn=24, n_experts=4, topk=2, capacity=0.0, max_iter=2, init_std=0.3, out_std=0.3)
    with torch.no_grad():
        moe.router_bias[1] = torch.tensor([0.0, 0.5, -0.5, 0.1])  # the bias steers selection
    x = torch.randn(2, 7, 16)
    for it in (0, 1):
        y, stats = moe(x, it)
        assert stats["dropped"] == 0
        torch.testing.assert_close(y, _naive_moe(moe, x, it), rtol=1e-5, atol=1e-6)


def test_capacity_moe_drops_the_later_assignments_in_token_order_and_they_output_nothing():
    torch.manual_seed(0)
    moe = MoE(d_model=16, d_ffn=24, n_experts=4, topk=2, capacity=0.5, max_iter=1, init_std=0.3, out_std=0.3)
    x = torch.randn(2, 7, 16)
    y, stats = moe(x, 0)
    keep = math.ceil(0.5 * 14 * 2 / 4)  # 7 per expert
    assert stats["dropped"] > 0
    torch.testing.assert_close(y, _naive_moe(moe, x, 0, keep=keep), rtol=1e-5, atol=1e-6)
    # and it is not the dropless network
    assert (y - _naive_moe(moe, x, 0)).abs().max() > 1e-3


def test_moe_balance_moves_the_bias_towards_underloaded_experts():
    moe = MoE(d_model=8, d_ffn=8, n_experts=4, topk=1, capacity=0.0, max_iter=2, init_std=0.1, out_std=0.1)
    moe.balance(torch.tensor([[10.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]]), rate=0.1)
    assert moe.router_bias[0].tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert moe.router_bias[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_model_is_causal_changing_a_later_byte_leaves_earlier_logits():
    model = _model()  # every arm on, dropless
    x, _ = _bytes(2, 32)
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % 256
    with torch.no_grad():
        a, _, _ = model(x)
        b, _, _ = model(x2)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert (a[:, 20] - b[:, 20]).abs().max() > 1e-4  # the changed position does see it


def test_lora_a_matrices_get_zero_gradient_at_init_because_b_starts_at_zero():
    model = _model()
    _, loss, _ = model(*_bytes(2, 16))
    loss.backward()
    attn = model.block.attn
    assert torch.count_nonzero(attn.lora_qkv_b) == 0
    assert torch.count_nonzero(attn.lora_qkv_a.grad) == 0 and torch.count_nonzero(attn.lora_out_a.grad) == 0
    assert torch.count_nonzero(attn.lora_qkv_b.grad) > 0 and torch.count_nonzero(attn.lora_out_b.grad) > 0


def test_every_parameter_gets_a_nonzero_gradient_after_one_optimizer_step():
    model = _model()
    opt = MixOptimizer(model, lr=3e-3)
    x, y = _bytes(4, 32)
    for _ in range(2):
        opt.zero_grad()
        _, loss, aux = model(x, y)
        loss.backward()
        opt.step()
        model.balance_experts(aux["loads"])
    opt.zero_grad()
    _, loss, _ = model(x, y)
    loss.backward()
    zero = [n for n, p in model.named_parameters() if p.grad is None or torch.count_nonzero(p.grad) == 0]
    assert zero == []
    # every stacked slice (each iteration's adapter, each expert) is reached
    for n, p in model.named_parameters():
        if p.ndim == 3 and "table" not in n:
            per_slice = p.grad.flatten(1).abs().sum(1)
            assert (per_slice > 0).all(), n


def test_bf16_config_trains_with_finite_loss(tmp_path, cyclic_corpus):
    run = RunConfig(
        model=dataclasses.replace(preset("tiny"), bf16=True),
        train=TrainConfig(steps=4, batch=2, seq_len=32, data=str(cyclic_corpus),
                          out_dir=str(tmp_path / "out"), log_every=100),
    )
    model = build_model(run)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # The routing bias stays float32: it moves by 1e-3 steps that bf16 rounds away past 0.5.
    assert model.block.moe.router_bias.dtype == torch.float32
    before = [p.detach().clone() for p in model.parameters()]
    report = train(model, run, log=lambda _: None)
    assert len(report["losses"]) == 4 and all(math.isfinite(v) for v in report["losses"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_build_model_is_seeded_by_train_seed():
    run = RunConfig()
    a, b = build_model(run), build_model(run)
    run2 = RunConfig(train=TrainConfig(seed=1))
    c = build_model(run2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)


# ---- the Engram hash ------------------------------------------------------------

def _order_columns(n: int, heads: int) -> list[int]:
    """Columns of ngram_rows' K axis that belong to n-grams of order n."""
    return [(n - 2) * heads + j for j in range(heads)]


def test_engram_same_ngram_at_two_positions_reads_the_same_rows():
    max_n, heads, rows = 3, 2, 64
    m = hash_multipliers(max_n, heads)
    x, _ = _bytes(1, 40)
    x = x.clone()
    x[0, 25:28] = x[0, 5:8]  # the 3-gram ending at 7 reappears ending at 27
    idx = ngram_rows(x, m, rows)
    assert idx.shape == (1, 40, (max_n - 1) * heads)
    for n in (2, 3):
        cols = _order_columns(n, heads)
        assert torch.equal(idx[0, 7, cols], idx[0, 27, cols])
    assert idx.min() >= 0 and idx.max() < rows


@pytest.mark.parametrize("rows", [7, 64, 1000])
def test_engram_rows_depend_only_on_the_preceding_n_bytes(rows):
    max_n, heads = 4, 2
    m = hash_multipliers(max_n, heads)
    x, _ = _bytes(2, 30, seed=3)
    idx = ngram_rows(x, m, rows)
    assert idx.min() >= 0 and idx.max() < rows
    t = 20
    g = torch.Generator().manual_seed(9)
    for n in range(2, max_n + 1):
        cols = _order_columns(n, heads)
        # everything outside x[t-n+1 .. t] replaced: the order-n rows at t stay
        x2 = torch.randint(0, 256, x.shape, generator=g)
        x2[:, t - n + 1: t + 1] = x[:, t - n + 1: t + 1]
        assert torch.equal(ngram_rows(x2, m, rows)[:, t, cols], idx[:, t, cols])
    if rows >= 64:
        # ... while a byte inside the n-gram does move them (order 2 at t reads x[t-1])
        x3 = x.clone()
        x3[:, t - 1] = (x3[:, t - 1] + 1) % 256
        assert not torch.equal(ngram_rows(x3, m, rows)[:, t, _order_columns(2, heads)],
                               idx[:, t, _order_columns(2, heads)])


def test_engram_positions_before_the_window_read_a_sentinel_not_byte_zero():
    m = hash_multipliers(3, 2)
    # order 2: position 0 reads (sentinel, 0), positions 1 and 2 read (0, 0)
    x = torch.tensor([[0, 0, 0]])
    idx = ngram_rows(x, m, 1 << 20)
    assert not torch.equal(idx[0, 0], idx[0, 2])
    assert torch.equal(idx[0, 2, _order_columns(2, 2)], idx[0, 1, _order_columns(2, 2)])


def test_engram_multipliers_are_odd_and_fixed():
    m1, m2 = hash_multipliers(3, 2), hash_multipliers(3, 2)
    assert m1.shape == (2, 2, 3)
    assert torch.equal(m1, m2)
    assert (m1 % 2 == 1).all() and (m1 > 0).all()
    assert len(set(m1.flatten().tolist())) == m1.numel()


def test_hidden_matrices_are_only_two_and_three_dimensional_weights():
    model = _model()
    params = dict(model.named_parameters())
    hidden = model.hidden_matrices()
    assert all(params[n].ndim >= 2 for n in hidden)
    for n in ("embed.weight", "head.weight", "block.moe.router.weight", "engram.table"):
        assert n in params and n not in hidden
