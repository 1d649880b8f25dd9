"""A tiny mixture-of-experts LM for the expert-parallel tests (random init,
nothing downloaded): an embedding, one MoE layer (a linear router, top-k
experts, each a GELU MLP; the experts' weights stacked as w1 (E, d, h) and
w2 (E, h, d), Megatron's grouped layout), a residual, LayerNorm, an output
head. Every token alone: no attention.

build_model gives the one-process model with every expert; `shard_experts`
turns it into an expert-parallel rank's model (ep_loop.py): this rank keeps
experts [rank * E/ep, (rank + 1) * E/ep) of w1 and w2 and exchanges tokens
with the other ranks by all_to_all (gloo runs all_to_all_single on CPU,
autograd through
torch.distributed._functional_collectives.all_to_all_single_autograd, as torchtitan dispatches).

The objective (objective_scope="step"): the token mean of next-token
cross-entropy over the step's rows plus a load-balancing term over the same
rows, ALPHA * E * sum_e f_e P_e (Switch Transformer's), f_e the fraction of
routing assignments to expert e, P_e the mean router probability of e: over
the GLOBAL batch, so the fleet must reduce its routing counts over every
rank that shares the router."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, H, E = 64, 16, 24, 4
ALPHA = 0.1


class MoE(nn.Module):
    def __init__(self, d: int, h: int, experts: int, top_k: int):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, h) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, h, d) * h ** -0.5)
        self.experts, self.top_k = experts, top_k
        self._ep = None  # (rank, size) on an expert-parallel rank; private: not a plain attribute the gate copies
        self.stats = None  # (router probabilities, chosen experts) of the last forward: the balancing term's

    def _ffn(self, x: torch.Tensor, j: int) -> torch.Tensor:
        return F.gelu(x @ self.w1[j]) @ self.w2[j]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, d)
        probs = torch.softmax(self.router(x), dim=-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            w = w / w.sum(-1, keepdim=True)
        self.stats = (probs, idx)
        token = torch.arange(x.shape[0]).repeat_interleave(self.top_k)
        order = torch.argsort(idx.reshape(-1), stable=True)
        es = idx.reshape(-1)[order]
        xs = x[token[order]]
        counts = torch.bincount(es, minlength=self.experts)
        ys = self._local(xs, counts) if self._ep is None else self._dispatch(xs, counts)
        return torch.zeros_like(x).index_add(0, token[order], ys * w.reshape(-1)[order, None])

    def _local(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        parts = torch.split(xs, counts.tolist())
        return torch.cat([self._ffn(p, j) for j, p in enumerate(parts)])

    def _dispatch(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Tokens (sorted by expert) to the ranks holding their experts and back, by all_to_all."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

        size = self._ep[1]
        el = self.experts // size
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)  # from each rank q: its counts for my el experts
        send_rank, rc = counts.view(size, el).sum(1).tolist(), recv.view(size, el)
        recv_rank = rc.sum(1).tolist()
        xr = a2a(xs, recv_rank, send_rank, dist.group.WORLD)  # torchtitan's dispatch collective
        segs = torch.split(xr, rc.reshape(-1).tolist())  # (q, j) order: source rank, then local expert
        outs: list = [None] * (size * el)
        for j in range(el):  # each local expert on every rank's tokens for it (rank order, as one process)
            y = self._ffn(torch.cat([segs[q * el + j] for q in range(size)]), j)
            for q, piece in enumerate(torch.split(y, rc[:, j].tolist())):
                outs[q * el + j] = piece
        return a2a(torch.cat(outs), send_rank, recv_rank, dist.group.WORLD)


class _CopyToTP(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: the forward passes the input to this rank's
    column shard, the backward sums the ranks' input gradients (each holds its columns' part)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _GatherVocab(torch.autograd.Function):
    """Megatron's gather_from_tensor_model_parallel_region on the last dimension: the forward all-gathers
    the ranks' vocabulary shards of the logits, the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, z, rank: int, size: int):
        import torch.distributed as dist

        ctx.rank, ctx.n = rank, z.shape[-1]
        parts = [torch.empty_like(z) for _ in range(size)]
        dist.all_gather(parts, z.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None, None


class TinyMoELM(nn.Module):
    def __init__(self, top_k: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.moe = MoE(D, H, E, top_k)
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, VOCAB)
        self._tp = None  # (rank, size, reduce) with a vocabulary-parallel output head (shard_output)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        B, T, d = x.shape
        x = x + self.moe(x.reshape(-1, d)).reshape(B, T, d)
        if self._tp is None:
            return self.out(self.norm(x))
        rank, size, reduce = self._tp
        h = self.norm(x)
        return _GatherVocab.apply(self.out(_CopyToTP.apply(h) if reduce else h), rank, size)


def build_model(seed: int = 0, top_k: int = 2) -> TinyMoELM:
    torch.manual_seed(seed)
    return TinyMoELM(top_k)


def build_optimizer(model, **_):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def shard_experts(model: TinyMoELM, rank: int, size: int) -> TinyMoELM:
    """This rank's expert-parallel model: experts [rank * E/size, (rank + 1) * E/size) kept, the rest dropped."""
    moe, el = model.moe, E // size
    with torch.no_grad():
        moe.w1 = nn.Parameter(moe.w1[rank * el:(rank + 1) * el].clone())
        moe.w2 = nn.Parameter(moe.w2[rank * el:(rank + 1) * el].clone())
    moe._ep = (rank, size)
    return model


def shard_output(model: TinyMoELM, rank: int, size: int, reduce: bool = True) -> TinyMoELM:
    """Hand-written (Megatron-style) tensor parallelism: this rank keeps rows [rank * V/size, (rank + 1) *
    V/size) of the output head (a column-parallel linear over the vocabulary, plain tensors) and gathers the
    logits; every other parameter is replicated over the ranks, which read the same rows. reduce=False
    leaves out the all-reduce of the head's input gradient (copy_to_tensor_model_parallel_region's
    backward): each rank's replicated parameters then get only its own vocabulary shard's part."""
    v = VOCAB // size
    with torch.no_grad():
        model.out.weight = nn.Parameter(model.out.weight[rank * v:(rank + 1) * v].clone())
        model.out.bias = nn.Parameter(model.out.bias[rank * v:(rank + 1) * v].clone())
    model._tp = (rank, size, reduce)
    return model


def balance(probs: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """ALPHA * E * sum_e f_e P_e: f from `counts` (routing assignments per expert, over the rows the term is
    declared over), P the mean router probability over `probs`' rows."""
    f = counts.float() / counts.sum()
    return ALPHA * E * (f * probs.mean(0)).sum()


def objective(model, batches):
    """The step's token-mean cross-entropy plus the load-balancing term over every rank's rows (global
    routing counts), as (loss_sum, count): objective_scope="step"."""
    ids = torch.cat([b["arg0"] for b in batches])
    z = model(ids)
    ce = F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    probs, idx = model.moe.stats
    count = ids[:, 1:].numel()
    return ce + count * balance(probs, idx, torch.bincount(idx.reshape(-1), minlength=E)), count
