"""Mixture-of-experts FFN: softmax router, top-k, stacked SwiGLU experts, an
always-on low-rank shared expert, and loss-free load balancing.

Routing (per token x, E experts, k chosen):

    p = softmax(W_router x)                     # (E,)
    chosen = top-k of (p + b_it)                # b_it: balancing bias, selection only
    w_e = p_e / sum_{c in chosen} p_c           # gate weights renormalised over the k
    y = sum_{e in chosen} w_e * expert_e(x)

Balancing follows DeepSeek-V3's auxiliary-loss-free strategy (arXiv:2412.19437,
sec. 2.1.2): after each optimizer step, b_e += rate * sign(mean load - load_e)
per iteration. The loss is therefore pure cross-entropy, a token mean, so the
fleet's token-weighted gradient reduce is exact; the loads that drive the bias
are counts, summed exactly over a fleet by the trainer (`balance_experts`).

Dispatch is dropless when capacity == 0: assignments are sorted by expert and
each expert runs one matmul on its contiguous slice (a loop over experts, never
over tokens). With capacity factor c > 0 each expert keeps the first
ceil(c * N * k / E) of its assignments in token order and drops the rest; the
set dropped depends on which tokens share the batch, which is why a fleet
refuses it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SharedExpert(nn.Module):
    """A SwiGLU MLP of hidden width `rank` that every token passes through."""

    def __init__(self, d_model: int, rank: int, init_std: float, out_std: float):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(rank, d_model) * init_std)
        self.w_up = nn.Parameter(torch.randn(rank, d_model) * init_std)
        self.w_down = nn.Parameter(torch.randn(d_model, rank) * out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w_gate.T) * (x @ self.w_up.T)) @ self.w_down.T


class MoE(nn.Module):
    def __init__(self, d_model: int, d_ffn: int, n_experts: int, topk: int,
                 capacity: float, max_iter: int, init_std: float, out_std: float):
        super().__init__()
        self.n_experts, self.topk, self.capacity = n_experts, topk, capacity
        self.router = nn.Linear(d_model, n_experts, bias=False)
        nn.init.normal_(self.router.weight, std=init_std)
        # Experts stacked as 3D weights (E, out, in), each slice laid out like a
        # Linear weight, so Muon's shape rule reads rows = out, cols = in.
        self.expert_w_gate = nn.Parameter(torch.randn(n_experts, d_ffn, d_model) * init_std)
        self.expert_w_up = nn.Parameter(torch.randn(n_experts, d_ffn, d_model) * init_std)
        self.expert_w_down = nn.Parameter(torch.randn(n_experts, d_model, d_ffn) * out_std)
        # One balancing bias per iteration: each iteration routes differently.
        self.register_buffer("router_bias", torch.zeros(max_iter, n_experts))

    def _apply(self, fn, recurse=True):
        """Casting the model (e.g. to bfloat16) keeps the routing bias in
        float32: it moves by steps of moe_bias_rate, which bfloat16 rounds
        away once |bias| >= 0.5 (8 bits of mantissa)."""
        super()._apply(fn, recurse)
        if self.router_bias.dtype != torch.float32:
            self.router_bias = self.router_bias.float()
        return self

    def forward(self, x: torch.Tensor, it: int) -> tuple[torch.Tensor, dict]:
        B, T, D = x.shape
        flat = x.reshape(B * T, D)  # (N, D)
        probs = torch.softmax(self.router(flat).float(), dim=-1)  # (N, E)
        with torch.no_grad():
            chosen = torch.topk(probs + self.router_bias[it].float(), self.topk, dim=-1).indices  # (N, k)
        w = probs.gather(1, chosen)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)  # (N, k)

        if B * T == 1 and not torch.is_grad_enabled():  # one token, generating: its k experts directly
            return self._one_token(flat, chosen, w, probs)
        expert_of = chosen.reshape(-1)  # (N*k,) assignment -> expert
        order = torch.argsort(expert_of, stable=True)  # assignments grouped by expert, token order kept
        counts = torch.bincount(expert_of, minlength=self.n_experts)  # (E,)
        xs = flat[order // self.topk]  # (N*k, D) the token of each sorted assignment
        keep = self._kept_per_expert(B * T)
        outs, start, dropped = [], 0, 0
        for e, n in enumerate(counts.tolist()):
            if n == 0 and not torch.is_grad_enabled():
                continue  # no assignments and no autograd: nothing to compute (training runs it for a zero gradient)
            kept = n if keep is None else min(n, keep)
            seg = xs[start:start + kept]
            outs.append(self._expert(e, seg))
            if kept < n:  # capacity overflow: these assignments contribute nothing
                outs.append(seg.new_zeros(n - kept, D))
                dropped += n - kept
            start += n
        ys = torch.cat(outs)  # (N*k, D) in sorted order
        y_assign = ys[torch.argsort(order)].view(B * T, self.topk, D)  # back to (N, k, D)
        y = (y_assign * w.unsqueeze(-1)).sum(1).view(B, T, D)
        stats = {"topk": chosen.view(B, T, self.topk), "load": counts.float(), "dropped": dropped}
        return y, stats

    def _one_token(self, flat: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor,
                   probs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The dispatch below for a single token (no sort, no empty experts):
        the same expert products and the same weighted sum over its k choices.
        Nothing is dropped: a capacity admits at least one assignment per expert."""
        ys = torch.cat([self._expert(e, flat) for e in chosen[0].tolist()])  # (k, D) in choice order
        y = (ys.view(1, self.topk, -1) * w.unsqueeze(-1)).sum(1).view(1, 1, -1)
        load = torch.bincount(chosen.reshape(-1), minlength=self.n_experts).float()
        return y, {"topk": chosen.view(1, 1, self.topk), "load": load, "dropped": 0}

    def _expert(self, e: int, seg: torch.Tensor) -> torch.Tensor:
        h = F.silu(seg @ self.expert_w_gate[e].T) * (seg @ self.expert_w_up[e].T)
        return h @ self.expert_w_down[e].T

    def _kept_per_expert(self, n_tokens: int) -> int | None:
        if self.capacity <= 0:
            return None
        return math.ceil(self.capacity * n_tokens * self.topk / self.n_experts)

    @torch.no_grad()
    def balance(self, loads: torch.Tensor, rate: float) -> None:
        """b_e += rate * sign(mean load - load_e), per iteration; loads (max_iter, E)."""
        loads = loads.to(self.router_bias.device, torch.float32)
        err = loads.mean(dim=-1, keepdim=True) - loads
        self.router_bias.add_(torch.sign(err), alpha=rate)
