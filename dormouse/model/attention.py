"""Causal multi-head self-attention with RoPE and per-iteration low-rank adapters.

The block is shared by every iteration of the loop, so without help all
iterations would compute the same function of their input. Each iteration i
therefore owns a low-rank correction (LoRA, Hu et al. 2021, arXiv:2106.09685)
on the attention's two projections:

    qkv_i(x) = W_qkv x + B_i (A_i x),   out_i(z) = W_out z + D_i (C_i z)

with A_i, C_i of `rank` rows and B_i, D_i zero at init (so iteration i starts as
the shared block and learns its own deviation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(max_seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles (Su et al. 2021, arXiv:2104.09864): channel
    pair j of position t rotates by t * base^(-2j / head_dim)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (T, hd/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x[..., :hd/2], x[..., hd/2:]) of x (B, H, T, hd)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, head_dim: int, max_seq_len: int,
                 rope_base: float, rank: int, max_iter: int, init_std: float, out_std: float):
        super().__init__()
        self.n_heads, self.head_dim, self.rank = n_heads, head_dim, rank
        inner = n_heads * head_dim
        self.qkv = nn.Parameter(torch.randn(3 * inner, d_model) * init_std)
        self.out = nn.Parameter(torch.randn(d_model, inner) * out_std)
        if rank > 0:
            # Stacked per iteration: (max_iter, rows, cols). B and D start at zero.
            self.lora_qkv_a = nn.Parameter(torch.randn(max_iter, rank, d_model) * init_std)
            self.lora_qkv_b = nn.Parameter(torch.zeros(max_iter, 3 * inner, rank))
            self.lora_out_a = nn.Parameter(torch.randn(max_iter, rank, inner) * init_std)
            self.lora_out_b = nn.Parameter(torch.zeros(max_iter, d_model, rank))
        cos, sin = rope_tables(max_seq_len, head_dim, rope_base)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, it: int, cache: "KVCache | None" = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model). With a cache, x holds the
        positions after the cache.length already seen: their keys and values
        are appended to iteration `it`'s entry and they attend to all of them."""
        B, T, _ = x.shape
        pos = 0 if cache is None else cache.length
        qkv = x @ self.qkv.T
        if self.rank > 0:
            qkv = qkv + (x @ self.lora_qkv_a[it].T) @ self.lora_qkv_b[it].T
        qkv = qkv.view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k, v = qkv.unbind(0)
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(it, k, v)  # (B, H, pos + T, hd)
        if pos == 0:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        else:  # query i sits at position pos + i: it sees keys 0..pos + i
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(pos)
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        z = z.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*hd)
        y = z @ self.out.T
        if self.rank > 0:
            y = y + (z @ self.lora_out_a[it].T) @ self.lora_out_b[it].T
        return y


class KVCache:
    """Keys and values of the positions a model has already seen, one entry per
    iteration of the shared block (each iteration attends with its own), for
    generating one token at a time without recomputing the window. Positions
    count from the window's start (RoPE), so a cache holds at most max_seq_len."""

    def __init__(self, max_iter: int):
        self.length = 0  # positions seen so far (advanced by the model after each forward)
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_iter
        self.tail: torch.Tensor | None = None  # the last input bytes (Engram's n-gram context)

    def extend(self, it: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append iteration `it`'s new keys and values (B, H, T, hd); return all of them."""
        if self.kv[it] is not None:
            k, v = torch.cat([self.kv[it][0], k], dim=2), torch.cat([self.kv[it][1], v], dim=2)
        self.kv[it] = (k, v)
        return k, v
