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


def rope_tables(max_seq_len: int, head_dim: int, base: float, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles (Su et al. 2021, arXiv:2104.09864): channel
    pair j of position t rotates by t * base^(-2j / head_dim), for positions
    start .. start + max_seq_len - 1 (each row the same numbers whatever start)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    positions = torch.arange(start, start + max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # (T, hd/2)
    return angles.cos().float(), angles.sin().float()


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Sliding-window causal attention: query at position i sees the keys at
    positions j with i - window < j <= i. (Tq,) and (Tk,) positions -> (Tq, Tk) bool."""
    d = q_pos[:, None] - k_pos[None, :]
    return (d >= 0) & (d < window)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x[..., :hd/2], x[..., hd/2:]) of x (B, H, T, hd)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, head_dim: int, max_seq_len: int,
                 rope_base: float, rank: int, max_iter: int, init_std: float, out_std: float):
        super().__init__()
        self.n_heads, self.head_dim, self.rank, self.rope_base = n_heads, head_dim, rank, rope_base
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

    def rope(self, pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of positions pos .. pos + T - 1 (past the table: computed, same formula)."""
        if pos + T <= self.rope_cos.shape[0]:
            return self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        cos, sin = rope_tables(T, self.head_dim, self.rope_base, start=pos)
        return cos.to(self.rope_cos.device), sin.to(self.rope_cos.device)

    def forward(self, x: torch.Tensor, it: int, cache: "KVCache | None" = None,
                window: int = 0) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model). With a cache, x holds the
        positions after the cache.length already seen: their keys and values
        are added to iteration `it`'s entry and each attends to the `window`
        positions ending at it (the cache's window). Without a cache: causal
        attention, or, with window > 0 and T > window, the same sliding window."""
        B, T, _ = x.shape
        pos = 0 if cache is None else cache.length
        qkv = x @ self.qkv.T
        if self.rank > 0:
            qkv = qkv + (x @ self.lora_qkv_a[it].T) @ self.lora_qkv_b[it].T
        qkv = qkv.view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k, v = qkv.unbind(0)
        cos, sin = self.rope(pos, T)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v, mask = cache.extend(it, k, v)  # mask None: every key returned is visible to every query
        elif window and T > window:
            at = torch.arange(T, device=x.device)
            mask = band_mask(at, at, window)
        else:
            mask = "causal"
        if isinstance(mask, str):
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        else:
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        z = z.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*hd)
        y = z @ self.out.T
        if self.rank > 0:
            y = y + (z @ self.lora_out_a[it].T) @ self.lora_out_b[it].T
        return y


class KVCache:
    """Keys and values of the positions a model has already seen, one entry per
    iteration of the shared block (each iteration attends with its own), for
    generating one token at a time without recomputing anything.

    Each entry is a ring of `window` (= max_seq_len) slots: position t lives in
    slot t mod window, so once the text is longer than the window a new
    position overwrites the one that just left it, and every position attends
    to the window of positions ending at it, at every iteration (sliding-window
    attention). Keys are stored rotated at their own absolute positions: RoPE
    makes a score depend on the offset between query and key only, and the
    offsets inside a window are those training saw. Within the first window
    this is exactly the causal forward; past it, see DormouseModel.forward
    (sliding=True) for the uncached forward that computes the same."""

    def __init__(self, max_iter: int, window: int):
        self.window = window
        self.length = 0  # positions seen so far (advanced by the model after each forward)
        # rings[it]: (B, 2, H, window, hd), keys then values; kv[it] = (its keys, its values),
        # views of it (so one copy writes a position's key and value).
        self.rings: list[torch.Tensor | None] = [None] * max_iter
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_iter
        self.tail: torch.Tensor | None = None  # the last input bytes (Engram's n-gram context)

    def ring(self, it: int, B: int, H: int, hd: int, like: torch.Tensor) -> torch.Tensor:
        """Iteration `it`'s ring (B, 2, H, window, hd), made (zeros of like's
        dtype and device) at the first use."""
        if self.rings[it] is None:
            self._hold(it, like.new_zeros(B, 2, H, self.window, hd))
        return self.rings[it]

    def _hold(self, it: int, ring: torch.Tensor) -> None:
        self.rings[it], self.kv[it] = ring, (ring[:, 0], ring[:, 1])

    def expand(self, batch: int) -> "KVCache":
        """This cache of one sequence repeated for `batch` sequences (each then
        continues on its own): the same keys, values and Engram tail per row."""
        for it, ring in enumerate(self.rings):
            if ring is not None:
                self._hold(it, ring.expand(batch, *ring.shape[1:]).clone())
        if self.tail is not None:
            self.tail = self.tail.expand(batch, -1).clone()
        return self

    def extend(self, it: int, k: torch.Tensor, v: torch.Tensor):
        """Add iteration `it`'s keys and values (B, H, T, hd) of positions
        length .. length + T - 1; return the keys and values those positions
        attend to, and the mask (None: all of them, in order for every query)."""
        B, H, T, hd = k.shape
        W, pos = self.window, self.length
        self.ring(it, B, H, hd, k)
        kb, vb = self.kv[it]
        if T == 1:  # one new position: it sees every slot that holds one of the last W positions
            kb[:, :, pos % W] = k[:, :, 0]
            vb[:, :, pos % W] = v[:, :, 0]
            n = min(pos + 1, W)
            return kb[:, :, :n], vb[:, :, :n], None
        # A chunk: the slots held before it and the chunk itself, masked by position.
        held = torch.arange(max(0, pos - W), pos, device=k.device)  # positions in the slots
        q_pos = torch.arange(pos, pos + T, device=k.device)
        slots = held % W
        k_all = torch.cat([kb[:, :, slots], k], dim=2)
        v_all = torch.cat([vb[:, :, slots], v], dim=2)
        mask = band_mask(q_pos, torch.cat([held, q_pos]), W)
        keep = q_pos[-W:]  # the chunk's last W positions stay in the ring
        kb[:, :, keep % W] = k[:, :, -keep.numel():]
        vb[:, :, keep % W] = v[:, :, -keep.numel():]
        if pos == 0 and T <= W:
            mask = "causal"  # exactly the uncached forward's attention
        return k_all, v_all, mask
