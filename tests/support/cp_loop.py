"""A researcher's context-parallel training loop, recorded for the gate. Run under torchrun (gloo):
`torchrun --standalone --nproc_per_node=W cp_loop.py --plan PLAN.json`, PLAN a JSON list of runs (dicts,
see RUN), one after another in the same process group.

The model is a tiny causal transformer with rotary positions (CPLM): each attention's core
(`layers.<i>.attn.core`) attends over the whole sequence although its rank holds only a shard of it. The
ranks form (dp, cp) = (W / cp, cp): CP group d is ranks d*cp .. d*cp + cp - 1; each DP replica reads its
own rows of the step's global batch, every CP rank of a replica the same rows, each its shard of every
row's sequence: "contiguous" (rank c holds chunk c of cp) or "load_balanced" (torch's head-tail balancer:
rank c holds chunks c and 2cp - 1 - c of 2cp). Labels are cut from the global rows (shifted before
sharding), positions are each token's place in the global sequence. Each rank backpropagates its
shard's cross-entropy sum divided by the step's global token count, and the gradients are all-reduced
(summed) over every rank: the global token mean. The logged loss is that mean.

Attention ("ring"):
  torch   torch's own ring attention, PRIVATE API pinned to torch 2.13
          (torch.distributed.tensor.experimental._context_parallel._attention:
          _templated_ring_attention / _templated_ring_attention_backward, _cp_options), given the CPU
          attention operator aten._scaled_dot_product_flash_attention_for_cpu (and its backward);
          torch's public context_parallel() has no CPU sharding strategy for that operator.
          "rotate": "allgather" | "alltoall"; "merge_f32": _cp_options.convert_to_f32
  plain   a ring of its own: keys and values all-gathered over the CP group with
          torch.distributed._functional_collectives.all_gather_tensor_autograd, the local queries
          attending causally to every rank's keys by their global positions

Faults ("fault"):
  clean         as above
  nn_gather     the plain ring with torch.distributed.nn.functional.all_gather instead (its backward writes
                into a non-contiguous buffer on gloo, pytorch #192920: the output, dQ and dV right, dK wrong)
  loss_avg      each rank backpropagates its own shard's token mean and the gradients are averaged over
                the ranks: the mean of the shards' means, not the token mean (shards hold unequal counts)
  no_cp_reduce  the gradients are all-reduced over the DP group only (none at CP x DP 1): each CP rank
                keeps the gradient of its own shard
  cp_avg        the gradients all-reduced with an average over the ranks where the CP shards' parts
                must be summed (each rank's loss divided by the whole sequence's tokens): 1 / CP
  positions     every shard's positions start at 0 (rotary offsets not shifted per shard)
  lb_order      load balanced, plain ring: the gathered keys taken in rank order as the sequence's order
                (their positions for the causal mask), not put back at their load-balanced places
  declared_order  the loop shards load balanced but tells the Recorder order="contiguous"
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

RUN = {"out": None, "fault": "clean", "seed": 0, "steps": 2, "cp": 2, "micro": 1, "rows": 2, "T": 16,
       "order": "contiguous", "ring": "torch", "rotate": "allgather", "merge_f32": True, "lr": 1e-2}
VOCAB = 32


# ------------------------------------------------------------------------------------------- the model

def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, H, T, D) at positions pos (B, T)."""
    d = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(d, dtype=torch.float32) / d))
    ang = pos[:, None, :, None].float() * inv  # (B, 1, T, d)
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _cpu_fwd(query, key, value, *, is_causal, **kw):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal)


def _cpu_bwd(*, grad_out, query, key, value, out, logsumexp, is_causal, **kw):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal)


class TorchRing(torch.autograd.Function):
    """torch's templated ring attention (private, torch 2.13) with the CPU attention operator."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

        out, lse = _templated_ring_attention(group, 2, _cpu_fwd, q, k, v, is_causal=True)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, g):
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward,
        )

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _templated_ring_attention_backward(ctx.group, 2, _cpu_bwd, g.contiguous(), "grad_out", q, k, v,
                                                         out, lse, is_causal=True)[:3]
        return dq, dk, dv, None


def chunks_of(n: int, order: str) -> list[list[int]]:
    """The chunks of the sequence each of n CP ranks holds (the loop's own cut)."""
    return [[i] for i in range(n)] if order == "contiguous" else [[i, 2 * n - 1 - i] for i in range(n)]


def shard(t: torch.Tensor, dim: int, n: int, c: int, order: str) -> torch.Tensor:
    held = chunks_of(n, order)
    parts = t.chunk(sum(len(h) for h in held), dim)
    return torch.cat([parts[i] for i in held[c]], dim)


class Core(nn.Module):
    """Causal attention of q, k, v (B, H, T, D). Without a CP setting (`_cp`, set by the loop) one process's
    SDPA over the whole sequence; with one, this rank's queries against the CP group's whole sequence."""

    def __init__(self):
        super().__init__()
        self._cp: dict | None = None

    def forward(self, q, k, v):
        cp = self._cp
        if cp is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        group, n, c, order = cp["group"], cp["n"], cp["c"], cp["order"]
        if cp["ring"] == "torch":
            return TorchRing.apply(q, k, v, group)
        if cp["ring"] == "nn":  # the trap: torch.distributed.nn's all_gather (pytorch #192920)
            import torch.distributed.nn.functional as dnn

            ks, vs = list(dnn.all_gather(k, group=group)), list(dnn.all_gather(v, group=group))
        else:
            import torch.distributed._functional_collectives as ft_c

            ks = list(ft_c.all_gather_tensor_autograd(k.contiguous(), 2, group).chunk(n, 2))
            vs = list(ft_c.all_gather_tensor_autograd(v.contiguous(), 2, group).chunk(n, 2))
        T = sum(x.shape[2] for x in ks)
        qpos = shard(torch.arange(T), 0, n, c, order)
        if cp.get("fault") == "lb_order":  # the gathered shards taken in rank order as the sequence's order
            kpos = torch.arange(T)
        else:  # each gathered shard's keys at their places in the sequence
            kpos = torch.cat([shard(torch.arange(T), 0, n, r, order) for r in range(n)])
        # scores against each rank's keys, side by side (softmax over all keys: their order is immaterial)
        s = torch.cat([q @ kr.transpose(-1, -2) for kr in ks], dim=-1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~(kpos[None, :] <= qpos[:, None]), float("-inf"))
        return torch.softmax(s, dim=-1) @ torch.cat(vs, 2)


class Attn(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.core = Core()

    def forward(self, x, pos):
        B, T, d = x.shape
        split = lambda t: t.view(B, T, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        out = self.core(rotate(q, pos), rotate(k, pos), v)
        return self.o(out.transpose(1, 2).reshape(B, T, d))


class Norm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.n1, self.attn, self.n2 = Norm(d), Attn(d, heads), Norm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, pos):
        x = x + self.attn(self.n1(x), pos)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class CPLM(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = Norm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        x = self.emb(input_ids)
        for b in self.layers:
            x = b(x, position_ids)
        return self.head(self.norm(x))


def build_model(seed: int = 0) -> CPLM:
    torch.manual_seed(seed)
    return CPLM()


def build_optimizer(model, seed: int = 0, lr: float = 1e-2):
    return torch.optim.AdamW(model.parameters(), lr=lr)


def global_batch(seed: int, step: int, n: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global rows: inputs (n, T) and labels (n, T) (the next tokens; the last `pad` of row i
    are -100, pad = 3 i mod T: unequal counts between the sequence's shards)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randint(0, VOCAB, (n, T + 1), generator=g)
    y = x[:, 1:].clone()
    for i in range(n):
        pad = (3 * i + 2) % T
        if pad:
            y[i, T - pad:] = -100
    return x[:, :T], y


# ------------------------------------------------------------------------------------------- the loop

def run(cfg: dict) -> None:
    from dormouse.gate import Recorder, RecordingSpec

    cfg = {**RUN, **cfg}
    rank, world = dist.get_rank(), dist.get_world_size()
    n, fault, order = cfg["cp"], cfg["fault"], cfg["order"]
    dp = world // n
    cp_groups = [dist.new_group(list(range(d * n, d * n + n))) for d in range(dp)]
    dp_groups = [dist.new_group(list(range(c, world, n))) for c in range(n)]
    d, c = rank // n, rank % n
    cp_group, dp_group = cp_groups[d], dp_groups[c]
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    cpa._cp_options.enable_load_balance = order == "load_balanced"
    cpa._cp_options.convert_to_f32 = bool(cfg["merge_f32"])
    cpa.set_rotate_method(cfg["rotate"])

    model = build_model(cfg["seed"])
    ring = "nn" if fault == "nn_gather" else cfg["ring"]
    for m in model.modules():
        if isinstance(m, Core):
            m._cp = {"group": cp_group, "n": n, "c": c, "order": order, "ring": ring, "fault": fault}
    opt = build_optimizer(model, lr=cfg["lr"])
    declared = "contiguous" if fault == "declared_order" else order
    rec = Recorder(cfg["out"], model, RecordingSpec(build_model="cp_loop:build_model",
                                                    build_optimizer="cp_loop:build_optimizer", objective="token_mean",
                                                    build_kwargs={"seed": cfg["seed"]}),
                   context_parallel=dict(group=cp_group, seq_dim=1, order=declared))
    B, K, T = cfg["rows"], cfg["micro"], cfg["T"]
    for step in range(cfg["steps"]):
        X, Y = global_batch(cfg["seed"], step, dp * K * B, T)
        total = float((Y != -100).sum())
        loss_sum = torch.zeros((), dtype=torch.float64)
        for m in range(K):
            rows = slice((d * K + m) * B, (d * K + m + 1) * B)
            x, y = X[rows], Y[rows]
            pos = torch.arange(T).expand_as(x)
            xs, ys, ps = (shard(t, 1, n, c, order) for t in (x, y, pos))
            if fault == "positions":
                ps = torch.arange(xs.shape[1]).expand_as(xs)
            logits = model(input_ids=xs, position_ids=ps)
            rec.labels(ys)
            ce = F.cross_entropy(logits.reshape(-1, VOCAB), ys.reshape(-1), ignore_index=-100, reduction="sum")
            loss_sum += ce.detach().double()
            if fault == "loss_avg":  # this shard's own token mean
                (ce / (ys != -100).sum().clamp_min(1) / K).backward()
            else:
                (ce / total).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if fault == "loss_avg":
            dist.all_reduce(flat)
            flat /= world
        elif fault == "cp_avg":
            dist.all_reduce(flat)
            flat /= world
        elif fault == "no_cp_reduce":
            if dp > 1:
                dist.all_reduce(flat, group=dp_group)
        else:
            dist.all_reduce(flat)
        i = 0
        for g in grads:
            g.copy_(flat[i:i + g.numel()].view_as(g))
            i += g.numel()
        dist.all_reduce(loss_sum)
        rec.step(loss=float(loss_sum) / total, optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec.close()


if __name__ == "__main__":
    import plan  # tests/support: the loops' one main

    sys.exit(plan.main(run))
