"""Engram memory: hashed n-grams of the bytes so far index learned tables, and a
context-aware gate decides how much of what they return enters the residual.

After DeepSeek's Engram ("Conditional Memory via Scalable Lookup", Cheng et al.
2026, arXiv:2601.07372), reduced to its core. For every order n in
2..max_n and hash head j, the n-gram ending at position t,
(x_{t-n+1}, ..., x_t), is hashed to a row of table (n, j):

    h_{n,j}(t) = ((XOR_{i<n} (x_{t-i} + 1) * M_{n,j,i}) mod (2^31 - 1)) mod rows

(multiplicative-XOR hashing; the Mersenne-prime reduction folds the high bits
into the low ones so any row count mixes well; positions before the window's
start read a sentinel byte 256). The K = (max_n - 1) * heads rows are
concatenated into e_t, projected to a key k_t and a value v_t, and

    h_t <- h_t + sigmoid(<rms(h_t), rms(k_t)> / sqrt(d)) * v_t

at the start of every iteration of the shared block. The lookup depends only on
the input bytes (computed once per forward); the gate depends on the hidden
state, so each iteration reads memory differently.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_PRIME = 2**31 - 1
_SENTINEL = 256  # the byte value "before the start of the window"


def hash_multipliers(max_n: int, heads: int) -> torch.Tensor:
    """Fixed odd multipliers M (orders, heads, max_n) from splitmix64 of their
    index: the same on every machine and independent of torch's RNG."""
    def splitmix64(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    orders = max_n - 1
    m = [
        (splitmix64(((o * heads + j) * max_n + i) + 1) & 0x7FFFFFFF) | 1
        for o in range(orders) for j in range(heads) for i in range(max_n)
    ]
    return torch.tensor(m, dtype=torch.int64).view(orders, heads, max_n)


def ngram_rows(x: torch.Tensor, multipliers: torch.Tensor, rows: int) -> torch.Tensor:
    """Row index of every (order, head) lookup: x (B, T) bytes -> (B, T, K),
    K ordered order by order, head by head."""
    orders, heads, max_n = multipliers.shape
    B, T = x.shape
    padded = F.pad(x.long() + 1, (max_n - 1, 0), value=_SENTINEL + 1)  # (B, T + max_n - 1)
    back = padded.unfold(1, max_n, 1).flip(-1)  # (B, T, max_n): back[..., i] = x_{t-i} + 1
    # Order n uses terms i < n: a zeroed multiplier gives a zero term, and x ^ 0 = x.
    used = torch.arange(max_n, device=x.device) < torch.arange(2, orders + 2, device=x.device)[:, None]
    terms = back[:, :, None, None, :] * (multipliers * used[:, None, :])  # (B, T, orders, heads, max_n)
    h = terms[..., 0]
    for i in range(1, max_n):
        h = h ^ terms[..., i]
    return (h % _PRIME % rows).reshape(B, T, orders * heads)


class Engram(nn.Module):
    def __init__(self, d_model: int, rows: int, dim: int, max_n: int, heads: int,
                 init_std: float, out_std: float):
        super().__init__()
        self.rows, self.d_model = rows, d_model
        self.register_buffer("multipliers", hash_multipliers(max_n, heads), persistent=False)
        k = (max_n - 1) * heads
        self.table = nn.Parameter(torch.randn(k, rows, dim) * init_std)  # (K, rows, dim)
        self.key = nn.Parameter(torch.randn(d_model, k * dim) * init_std)
        self.value = nn.Parameter(torch.randn(d_model, k * dim) * out_std)

    def lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value of every position, from its n-grams: (B, T, D) each."""
        idx = ngram_rows(x, self.multipliers, self.rows)  # (B, T, K)
        K = idx.shape[-1]
        e = self.table[torch.arange(K, device=x.device), idx]  # (B, T, K, dim)
        e = e.flatten(-2)  # (B, T, K*dim)
        return e @ self.key.T, e @ self.value.T

    def gate(self, h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """sigmoid(<rms(h), rms(k)> / sqrt(d)): (B, T, 1)."""
        score = (F.rms_norm(h, (self.d_model,)) * F.rms_norm(key, (self.d_model,))).sum(-1, keepdim=True)
        return torch.sigmoid(score / math.sqrt(self.d_model))
