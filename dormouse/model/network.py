"""DormouseModel: a byte-level language model with one shared block applied
`max_iter` times.

    h = embed(x)
    for it in range(max_iter):                     # the same block every time ...
        h += gate_it(h) * engram_value(x)          # Engram memory (if on)
        h += attn(rms(h), adapters[it])            # ... but per-iteration adapters
        h += moe(rms(h), it) + shared_expert(rms(h))
    logits = head(rms(h))
    loss = mean cross-entropy of logits against y  # no auxiliary term: see moe.py

The model knows nothing of ranks, devices or optimizers. Two small hooks serve
the trainer: `hidden_matrices()` names the weights Muon should orthogonalise,
and `balance_experts(loads)` moves the routing bias after a step, from loads the
trainer may have summed over a fleet.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.config import ModelConfig
from dormouse.model.attention import Attention, KVCache
from dormouse.model.engram import Engram
from dormouse.model.moe import MoE, SharedExpert


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.gain, self.eps)


class SharedBlock(nn.Module):
    """The block every iteration reuses; `it` selects the iteration's adapters,
    routing bias and Engram gate reading."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        std = cfg.init_std
        # Residual-output projections start smaller, as in GPT-2: the residual
        # sums 2 * max_iter of them.
        out_std = std / math.sqrt(2 * cfg.max_iter)
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.max_seq_len,
                              cfg.rope_base, cfg.rank, cfg.max_iter, std, out_std)
        # The FFN arms' input norm exists only when one of them does (else it
        # would be a parameter that never receives a gradient).
        self.ffn_norm = RMSNorm(cfg.d_model) if (cfg.moe_on or cfg.shared_rank) else None
        self.moe = (MoE(cfg.d_model, cfg.d_ffn, cfg.n_experts, cfg.moe_topk, cfg.moe_capacity,
                        cfg.max_iter, std, out_std) if cfg.moe_on else None)
        self.shared = SharedExpert(cfg.d_model, cfg.shared_rank, std, out_std) if cfg.shared_rank else None

    def forward(self, h: torch.Tensor, it: int, cache: KVCache | None = None,
                window: int = 0) -> tuple[torch.Tensor, dict | None]:
        h = h + self.attn(self.attn_norm(h), it, cache, window)
        stats = None
        if self.ffn_norm is None:
            return h, stats
        z = self.ffn_norm(h)
        if self.moe is not None:
            y, stats = self.moe(z, it)
            h = h + y
        if self.shared is not None:
            h = h + self.shared(z)
        return h, stats


class DormouseModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        std = cfg.init_std
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=std)
        self.engram = (Engram(cfg.d_model, cfg.engram_rows, cfg.engram_dim, cfg.engram_max_n,
                              cfg.engram_heads, std, std / math.sqrt(2 * cfg.max_iter))
                       if cfg.engram_on else None)
        self.block = SharedBlock(cfg)
        self.final_norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        nn.init.normal_(self.head.weight, std=std)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, *, cache: KVCache | None = None,
                sliding: bool = False):
        """x, y: (B, T) byte ids. Returns (logits (B, T, vocab), loss or None, aux).

        cache (generation, see `new_cache`): x continues the text the cache
        has seen; the result equals the last T positions of the uncached
        forward over the whole text (sliding=True once it is longer than
        max_seq_len). Only for a dropless MoE (a capacity limit drops by batch
        composition, so the whole window must be recomputed).

        sliding: x may be longer than max_seq_len; every position attends, at
        every iteration, to the max_seq_len positions ending at it (RoPE at
        absolute positions: within a window the offsets are those training
        saw). Within max_seq_len it is the plain forward. Because the block is
        looped, position t's state at iteration i > 0 carries what its own
        window saw at iteration i - 1, which reaches back before t's window:
        up to max_iter * (max_seq_len - 1) positions in all. This is what a
        KV cache computes when it slides without recomputing.

        aux["topk"][it]: (B, T, k) expert ids each token chose at iteration it;
        aux["loads"]: (max_iter, E) assignments per expert (before any drop);
        aux["dropped"]: assignments dropped by a capacity limit (0 if dropless).
        """
        cfg = self.cfg
        if cache is None and not sliding and x.shape[1] > cfg.max_seq_len:
            raise ValueError(f"window of {x.shape[1]} tokens exceeds max_seq_len={cfg.max_seq_len} "
                             "(sliding=True attends to a sliding window of that many)")
        window = cfg.max_seq_len if sliding else 0
        h = self.embed(x)
        if self.engram is not None:
            if cache is None:
                mem_key, mem_value = self.engram.lookup(x)
            else:  # the n-grams reach back into bytes already seen
                ctx = x if cache.tail is None else torch.cat([cache.tail, x], dim=1)
                mem_key, mem_value = (t[:, -x.shape[1]:] for t in self.engram.lookup(ctx))
                cache.tail = ctx[:, -(cfg.engram_max_n - 1):]
        topk, loads, dropped = [], [], 0
        for it in range(cfg.max_iter):
            if self.engram is not None:
                h = h + self.engram.gate(h, mem_key) * mem_value
            h, stats = self.block(h, it, cache, window)
            if stats is not None:
                topk.append(stats["topk"])
                loads.append(stats["load"])
                dropped += stats["dropped"]
        if cache is not None:
            cache.length += x.shape[1]
        logits = self.head(self.final_norm(h))
        loss = None
        if y is not None:
            loss = F.cross_entropy(logits.float().view(-1, cfg.vocab), y.reshape(-1))
        aux = {
            "topk": topk,
            "loads": torch.stack(loads) if loads else torch.zeros(cfg.max_iter, 0),
            "dropped": dropped,
        }
        return logits, loss, aux

    def new_cache(self) -> KVCache:
        """An empty cache for generating with `forward(x, cache=...)`."""
        if self.block.moe is not None and self.cfg.moe_capacity > 0:
            raise ValueError("a capacity-dropping MoE depends on the whole window: generate without a cache")
        return KVCache(self.cfg.max_iter, self.cfg.max_seq_len)

    def hidden_matrices(self) -> list[str]:
        """Names of the hidden-layer weights Muon orthogonalises: attention and
        its adapters, the experts, the shared expert, the Engram projections.
        Embeddings, the head, norm gains, the router and the Engram table
        (an embedding in all but name) are left to AdamW."""
        adamw = {"embed.weight", "head.weight", "block.moe.router.weight", "engram.table"}
        return [n for n, p in self.named_parameters() if p.ndim >= 2 and n not in adamw]

    @torch.no_grad()
    def balance_experts(self, loads: torch.Tensor) -> None:
        """Move the routing bias after an optimizer step from the step's expert
        loads (max_iter, E); in a fleet these must be the fleet's summed loads."""
        if self.block.moe is not None and self.cfg.moe_bias_rate > 0:
            self.block.moe.balance(loads, self.cfg.moe_bias_rate)
