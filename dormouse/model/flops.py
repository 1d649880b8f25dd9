"""The model's FLOP count: matrix products of one training step (forward,
backward and the optimizer's Newton-Schulz), as a function of its
ModelConfig and TrainConfig. The benchmarks hold measured step times against
it (dormouse.bench); it knows nothing of ranks or timing."""

from __future__ import annotations

import math

import torch

from dormouse.config import ModelConfig, TrainConfig


def step_flops(m: ModelConfig, t: TrainConfig, batch: int, seq_len: int) -> dict[str, float]:
    """FLOPs of one training step (forward, backward, optimizer) at `batch`
    windows of `seq_len` tokens; a multiply-add is 2 FLOPs. Only matrix
    products are counted (elementwise work, norms, softmax and the optimizer's
    elementwise updates are not), and only the work the model actually does.

    Per token and per iteration of the shared block (d = d_model, i = n_heads *
    head_dim, r = rank, F = d_ffn, E = n_experts, k = moe_topk, s = shared_rank):

        qkv + out projections     2*d*3i + 2*i*d
        adapters (r > 0)          2*(d*r + r*3i) + 2*(i*r + r*d)
        attention (causal)        2*i*(T+1)       QK^T and AV over the (T+1)/2
                                                   keys a token sees on average
        router                    2*d*E
        routed experts (top-k)    k * 3 * 2*d*F   SwiGLU gate, up, down; only the
                                                   k chosen experts (dropless: every
                                                   token has exactly k assignments)
        shared expert             3 * 2*d*s

    once per token: Engram key and value projections 2 * 2*(K*e)*d (K =
    (engram_max_n - 1) * engram_heads tables of width e = engram_dim) and the
    head 2*d*vocab. Forward = N * (max_iter * per-iteration + once), N =
    batch * seq_len; backward = 2 x forward (input and weight gradients of
    every product; attention's backward likewise 2 x its forward: recomputation
    inside the fused kernel is not counted).

    Newton-Schulz, per Muon matrix slice of shape rows x cols (m = min, n =
    max; a 3D stack is its slices with muon_colrow_3d, else one flattened
    matrix): ns_steps * (4*m*m*n + 2*m**3) (X X^T, A A, B X).

    total = 3 * forward + newton_schulz.
    """
    N, T = batch * seq_len, seq_len
    d, inner = m.d_model, m.n_heads * m.head_dim
    per_iter = {
        "attn_proj": 2 * d * 3 * inner + 2 * inner * d,
        "adapters": (2 * (d * m.rank + m.rank * 3 * inner) + 2 * (inner * m.rank + m.rank * d)) if m.rank else 0,
        "attention": 2 * inner * (T + 1),
        "router": 2 * d * m.n_experts if m.moe_on else 0,
        "experts": m.moe_topk * 3 * 2 * d * m.d_ffn if m.moe_on else 0,
        "shared_expert": 3 * 2 * d * m.shared_rank,
    }
    k_tables = (m.engram_max_n - 1) * m.engram_heads
    once = {
        "engram_proj": 2 * 2 * k_tables * m.engram_dim * d if m.engram_on else 0,
        "head": 2 * d * m.vocab,
    }
    fwd = {name: N * m.max_iter * f for name, f in per_iter.items()}
    fwd.update({name: N * f for name, f in once.items()})
    out = {f"train_{name}": 3.0 * f for name, f in fwd.items()}
    out["newton_schulz"] = float(newton_schulz_flops(m, t))
    out["forward"] = float(sum(fwd.values()))
    out["total"] = 3.0 * out["forward"] + out["newton_schulz"]
    return out


def newton_schulz_flops(m: ModelConfig, t: TrainConfig) -> int:
    """Newton-Schulz FLOPs of one optimizer step over the model's Muon matrices."""
    if t.opt != "mix":
        return 0
    from dormouse.model.network import DormouseModel

    with torch.device("meta"):
        model = DormouseModel(m)
    shapes = dict((n, p.shape) for n, p in model.named_parameters())
    total = 0
    for name in model.hidden_matrices():
        shape = shapes[name]
        if len(shape) == 2:
            slices, rows, cols = 1, shape[0], shape[1]
        elif t.muon_colrow_3d:
            slices, rows, cols = math.prod(shape[:-2]), shape[-2], shape[-1]
        else:
            slices, rows, cols = 1, math.prod(shape[:-1]), shape[-1]
        a, b = min(rows, cols), max(rows, cols)
        total += slices * t.ns_steps * (4 * a * a * b + 2 * a ** 3)
    return total
