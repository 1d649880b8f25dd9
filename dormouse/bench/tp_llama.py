"""A torchtitan-style tiny llama and its parallelisation, as a researcher's
client of the gate: the 2-D (dp x tp) run `dormouse bench` times with and
without the Recorder (dormouse.bench.recorder_2d), and the tests' TP, 2-D and
pipeline clients (tests/support/tp_llama.py adds their faults).

The model is torchtitan's llama in miniature (token embedding, blocks of
RMSNorm + causal multi-head attention + RMSNorm + SwiGLU feed-forward, a
final RMSNorm and the output projection), random init, seeded. `parallelize`
applies torchtitan's tensor-parallel plan (its `apply_tp` of parallelize_llama
before the move to spmd_types: RowwiseParallel embedding to sequence shards,
SequenceParallel norms, PrepareModuleInput before attention and feed-forward,
ColwiseParallel wq/wk/wv/w1/w3, RowwiseParallel wo/w2 back to sequence
shards, ColwiseParallel output with loss_parallel's vocabulary-sharded logits)
on the "tp" dimension of a device mesh, then FSDP2 (`fully_shard` per block
and on the whole model) on its "dp" dimension when that has more than one rank.

`parallelize(..., norm=...)` lets a client apply its own sequence-parallel
norm (a callable given the TP mesh and the norm module) in place of torch's
SequenceParallel: the tests' fault of a norm whose weight gradient is never
reduced over the TP group is planted that way.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them (torchtitan's view)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class KeyedDropout(nn.Module):
    """Dropout whose mask is a function of (key, position, GLOBAL column): element (t, j) of every row is
    kept when a hash of (key, t * columns + j) is at least p. One process and a tensor-parallel rank
    holding a column shard draw the same mask for the same element, provided the rank says which shard
    it holds (`shard(index, count)`, the client's line after parallelising: a ColwiseParallel output
    is a plain local tensor that does not know it). The same at every step (the one-process reference
    cannot see the step)."""

    def __init__(self, p: float, key: int, columns: int):
        super().__init__()
        self.p, self.key, self.columns = p, key, columns
        self._shard = (0, 1)  # (index, count) of this rank's column shard; private: the reference's is whole

    def shard(self, index: int, count: int) -> None:
        self._shard = (index, count)

    def mask(self, t: int, first: int, width: int) -> torch.Tensor:
        """The keep mask of positions 0..t-1 and global columns first..first+width-1 (31-bit integer hash)."""
        m = 0x7FFFFFFF
        x = torch.arange(t).view(-1, 1) * self.columns + torch.arange(first, first + width).view(1, -1)
        x = (x * 0x5BD1E995 + self.key * 0x27D4EB2F + 0x165667B1) & m
        for shift, mul in ((16, 0x45D9F3B), (15, 0x2C1B3C6D), (16, 0x297A2D39)):
            x = ((x ^ (x >> shift)) * mul) & m
        return (x ^ (x >> 16)).double() / 2 ** 31 >= self.p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        index, count = self._shard
        width = x.shape[-1]
        keep = self.mask(x.shape[-2], index * (self.columns // count), width).to(x.dtype)
        return x * keep / (1 - self.p)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, key: int = 0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.drop = KeyedDropout(dropout, key, hidden) if dropout else None  # on the (column-split) hidden

    def forward(self, x):
        h = F.silu(self.w1(x)) * self.w3(x)
        return self.w2(self.drop(h) if self.drop is not None else h)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int, dropout: float = 0.0, key: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden, dropout, key)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, n_heads: int = 4, n_layers: int = 2, hidden: int = 64,
                 dropout: float = 0.0, key: int = 0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, hidden, dropout, key + i) for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        # a pipeline stage holds some of the parts (torchtitan's way: the others set to None)
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def pipeline_stage_module(model, stage: int, stages: int = 2):
    """Stage `stage` of `stages` of the model, torchtitan's way: the layers of the other stages deleted,
    the embedding only on the first stage, the final norm and output only on the last; parameter names
    as in the whole model."""
    n = len(model.layers)
    keep = set(range(stage * n // stages, (stage + 1) * n // stages))
    for i in [i for i in range(n) if i not in keep]:
        del model.layers[str(i)]
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm, model.output = None, None
    return model


def build_model(seed: int = 0, vocab: int = 64, dim: int = 32, n_heads: int = 4, n_layers: int = 2,
                hidden: int = 64, dropout: float = 0.0, **_):
    """`dropout`: a KeyedDropout on each feed-forward's hidden activation, keyed by the seed and the block."""
    torch.manual_seed(seed)
    model = TinyLlama(vocab, dim, n_heads, n_layers, hidden, dropout, key=1000 * seed)
    with torch.no_grad():  # random, not a trained model's, and not all-ones norms (their gradients show)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
    return model


def build_optimizer(model, lr: float = 1e-2, **_):
    # foreach=False: the same per-tensor arithmetic on DTensor shards as on full tensors
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=False)


def parallelize(model, mesh, *, loss_parallel: bool = True, norm=None, mp_policy=None):
    """torchtitan's TP plan on mesh["tp"] (or a 1-D mesh), then FSDP2 on mesh["dp"] where there is one
    (with `mp_policy`, a MixedPrecisionPolicy, where given). `norm(tp_mesh, module)`, where given,
    parallelises each block's norms in place of SequenceParallel."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    names = mesh.mesh_dim_names or ()
    tp = mesh["tp"] if "tp" in names and mesh.ndim > 1 else mesh
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    parallelize_module(model, tp, plan)
    for block in model.layers.values():
        layer_plan = {
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp, layer_plan)
        for name in ("attention_norm", "ffn_norm"):
            if norm is not None:
                norm(tp, getattr(block, name))
            else:
                parallelize_module(getattr(block, name), tp, SequenceParallel())
    if "dp" in names and mesh["dp"].size() > 1:
        dp = mesh["dp"]
        mp = {} if mp_policy is None else {"mp_policy": mp_policy}
        for block in model.layers.values():
            fully_shard(block, mesh=dp, **mp)
        fully_shard(model, mesh=dp, **mp)
    return model
