"""Tiny models and declared objectives for batch_loop.py (the Recorder on
loops whose objective is a function of more than each row): an MoE language
model with a load-balancing term, an in-batch contrastive encoder, and a
small LM with a branch switch (a bool forward keyword, a model attribute).
Their builders and objectives are what the recordings name by import path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, EXPERTS, T = 32, 16, 4, 8
ALPHA = 0.5  # the load-balancing term's weight (large, so that its share of the gradient is seen)


class MoELM(nn.Module):
    """Embedding, a soft mixture of EXPERTS experts (router softmax), a head.
    Returns (logits, router probabilities (B, T, E))."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.router = nn.Linear(D, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(EXPERTS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids):
        h = self.tok(input_ids)
        p = torch.softmax(self.router(h), -1)
        y = sum(p[..., e:e + 1] * torch.tanh(ex(h)) for e, ex in enumerate(self.experts))
        return self.head(h + y), p


def build_moe(seed: int = 0):
    torch.manual_seed(seed)
    return MoELM()


def build_optimizer(model, seed: int = 0, **_):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def routing_stats(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sum of router probabilities per expert, tokens routed to each expert (argmax), tokens)."""
    flat = p.reshape(-1, EXPERTS)
    return flat.sum(0), F.one_hot(flat.argmax(-1), EXPERTS).sum(0).to(flat.dtype), flat.shape[0]


def balance(psum: torch.Tensor, fcount: torch.Tensor, n: int) -> torch.Tensor:
    """Switch's load-balancing term: E * sum_e (f_e / n) (P_e / n)."""
    return EXPERTS * ((fcount / n) * (psum / n)).sum()


def ce_sum(logits, ids) -> tuple[torch.Tensor, int]:
    z, y = logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
    return F.cross_entropy(z.float(), y, reduction="sum"), y.numel()


def moe_forward(model, batch):
    """Next-token cross-entropy plus ALPHA x the load-balancing term over THIS forward's routing statistics
    (each row of the step the same length, so each forward weighs its term by its token count)."""
    logits, p = model(batch["input_ids"])
    ce, n = ce_sum(logits, batch["input_ids"])
    return ce + ALPHA * balance(*routing_stats(p)) * n, n


def moe_step(model, batches):
    """Next-token cross-entropy plus ALPHA x the load-balancing term over the WHOLE step's routing statistics."""
    ce, n, ps, fs, tokens = 0.0, 0, 0.0, 0.0, 0
    for b in batches:
        logits, p = model(b["input_ids"])
        c, k = ce_sum(logits, b["input_ids"])
        psum, fcount, m = routing_stats(p)
        ce, n, ps, fs, tokens = ce + c, n + k, ps + psum, fs + fcount, tokens + m
    return ce + ALPHA * balance(ps, fs, tokens) * n, n


class PairEncoder(nn.Module):
    """Mean-pooled embeddings of a query and its positive (pair_ids), normalised."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.proj = nn.Linear(D, D)

    def encode(self, ids):
        return F.normalize(self.proj(self.tok(ids).mean(1)), dim=-1)

    def forward(self, input_ids, pair_ids):
        return self.encode(input_ids), self.encode(pair_ids)


def build_pair(seed: int = 0):
    torch.manual_seed(seed)
    return PairEncoder()


TAU = 0.1


def contrastive_local(model, batch):
    """In-batch contrastive loss with this forward's rows as the negatives."""
    q, k = model(batch["input_ids"], batch["pair_ids"])
    return F.cross_entropy(q @ k.T / TAU, torch.arange(q.shape[0]), reduction="sum"), q.shape[0]


def contrastive_step(model, batches):
    """In-batch contrastive loss with every row of the step (every rank's) as the negatives."""
    qs, ks = zip(*(model(b["input_ids"], b["pair_ids"]) for b in batches))
    q, k = torch.cat(qs), torch.cat(ks)
    return F.cross_entropy(q @ k.T / TAU, torch.arange(q.shape[0]), reduction="sum"), q.shape[0]


class SwitchLM(nn.Module):
    """A small LM whose forward a bool keyword (`flip`) and a module attribute
    (`mix.gain`, a float; `mix.on`, a bool) switch."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.mix = Mix()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids, flip: bool = False):
        h = self.mix(self.tok(input_ids))
        return self.head(-h if flip else h)


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.on, self.gain = False, 1.0

    def forward(self, h):
        return h + self.gain * torch.tanh(self.lin(h)) if self.on else h


def build_switch(seed: int = 0):
    torch.manual_seed(seed)
    return SwitchLM()
