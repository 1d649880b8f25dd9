"""Incremental decoding: one new position for each of B sequences per call,
with as few tensor operations as the mathematics allows.

`Decoder(model).step(tokens, cache)` computes what `model(tokens[:, None],
cache=cache)` computes (the forward of DormouseModel, see network.py, at the
one position after the cache.length already seen, attending to the cache's
sliding window at every iteration), for a dropless MoE, without autograd. It
differs only in how the same products are grouped, so its logits equal the
forward's up to float round-off (a few ulps; tests bound it), never in what
they are a function of:

- weights that read the same input are concatenated once, at construction, so
  one matrix product computes several of them: per iteration i,
  [W_qkv; A_i] x gives the projection and the adapter's low-rank input in one
  product, then qkv = W_qkv x + B_i (A_i x) is one addmm; the same for the
  output projection [W_out; C_i] z; the router and the shared expert's two
  input matrices read rms(h) together; each expert's gate and up matrices are
  one [W_gate; W_up]; Engram's key and value matrices one [K; V];
- RoPE rotates q and k in one pass over precomputed rows: for x = (x1, x2),
  x * (cos, cos) + (x2, x1) * (-sin, sin) is, element by element, exactly
  apply_rope's (x1 cos - x2 sin, x1 sin + x2 cos);
- rms(k_t) of Engram's key is computed once per position, not per iteration;
- MoE: with one sequence, its k experts run directly and the weighted sum is
  one product w (1, k) @ y (k, D); with B > 1 sequences the assignments are
  grouped by expert as MoE.forward groups them, each expert one product over
  the rows that chose it (its weights read once for the batch), and
  y_b = sum over b's k choices of w_e * expert_e(z_b), added in expert order.

The cache is DormouseModel's KVCache (fill it with a forward over the prompt,
then step); positions past the rope table get rows from the same formula.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dormouse.model.attention import KVCache, rope_tables
from dormouse.model.engram import ngram_rows


class Decoder:
    """The one-position step of a DormouseModel (eval, no autograd), for a
    dropless MoE. Built once per generation: it copies the weights it
    concatenates, so build a new one after the weights change."""

    @torch.no_grad()
    def __init__(self, model):
        cfg = model.cfg
        if cfg.moe_on and cfg.moe_capacity > 0:
            raise ValueError("a capacity-dropping MoE depends on the whole window: no incremental decoder")
        self.cfg, self.model = cfg, model
        blk, att = model.block, model.block.attn
        self.d, self.inner, self.r = cfg.d_model, att.n_heads * att.head_dim, att.rank
        self.H, self.hd, self.window = att.n_heads, att.head_dim, cfg.max_seq_len
        self.iters = []
        for it in range(cfg.max_iter):
            p = {}
            if self.r:
                p["qkv"] = torch.cat([att.qkv, att.lora_qkv_a[it]]).T  # (d, 3I + r)
                p["qkv_b"] = att.lora_qkv_b[it].T  # (r, 3I)
                p["out"] = torch.cat([att.out, att.lora_out_a[it]]).T  # (I, d + r)
                p["out_b"] = att.lora_out_b[it].T  # (r, d)
            else:
                p["qkv"], p["out"] = att.qkv.T, att.out.T
            self.iters.append(p)
        self.attn_gain, self.attn_eps = blk.attn_norm.gain, blk.attn_norm.eps
        self.ffn = blk.ffn_norm
        moe, sh = blk.moe, blk.shared
        self.E = moe.n_experts if moe is not None else 0
        self.sr = sh.w_gate.shape[0] if sh is not None else 0
        if self.ffn is not None:
            front = ([moe.router.weight] if moe is not None else []) + ([sh.w_gate, sh.w_up] if sh else [])
            self.front = torch.cat(front).T  # (d, E + 2 sr)
            self.front_split = ([self.E] if self.E else []) + ([self.sr, self.sr] if self.sr else [])
        if moe is not None:
            self.topk, self.bias, self.f = moe.topk, moe.router_bias.float(), moe.expert_w_gate.shape[1]
            self.gate_up = [torch.cat([moe.expert_w_gate[e], moe.expert_w_up[e]]).T for e in range(self.E)]
            self.down = [moe.expert_w_down[e].T for e in range(self.E)]
        if sh is not None:
            self.shared_down = sh.w_down.T
        eg = model.engram
        if eg is not None:
            self.kv = torch.cat([eg.key, eg.value]).T  # (K dim, 2d)
            self.rows_of = torch.arange(eg.table.shape[0], device=eg.table.device)
        self.head = model.head.weight.T
        self._cos2 = self._sin2 = None
        self._rope_rows(0)

    def _rope_rows(self, pos: int) -> None:
        """(cos, cos) and (-sin, sin) rows for a table of positions covering pos."""
        if self._cos2 is not None and pos < self._cos2.shape[0]:
            return
        n = max(self.window, pos + 1)
        n = self.window * math.ceil(n / self.window)  # whole windows: extended rarely
        cos, sin = rope_tables(n, self.hd, self.model.block.attn.rope_base)
        dev, dt = self.head.device, self.head.dtype
        cos, sin = cos.to(dev, dt), sin.to(dev, dt)  # apply_rope casts the same way
        self._cos2 = torch.cat([cos, cos], dim=-1)  # (n, hd)
        self._sin2 = torch.cat([-sin, sin], dim=-1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens (B,) byte ids of the position cache.length -> logits (B, vocab);
        advances the cache by one position."""
        cfg, model = self.cfg, self.model
        B, d, H, hd, I = tokens.shape[0], self.d, self.H, self.hd, self.inner
        pos, W = cache.length, self.window
        h = F.embedding(tokens, model.embed.weight)  # (B, d)
        eg = model.engram
        if eg is not None:  # this position's n-grams, from the bytes the cache has seen
            ctx = tokens[:, None] if cache.tail is None else torch.cat([cache.tail, tokens[:, None]], dim=1)
            cache.tail = ctx[:, -(cfg.engram_max_n - 1):]
            idx = ngram_rows(ctx, eg.multipliers, eg.rows)[:, -1]  # (B, K)
            e = eg.table[self.rows_of, idx].flatten(1)  # (B, K dim)
            key, value = torch.mm(e, self.kv).split(d, dim=1)
            key_n = F.rms_norm(key, (d,)) / math.sqrt(d)  # the gate's rms(k_t) / sqrt(d), once
        self._rope_rows(pos)
        cos2, sin2 = self._cos2[pos], self._sin2[pos]
        slot, n = pos % W, min(pos + 1, W)
        for it, p in enumerate(self.iters):
            if eg is not None:
                score = torch.linalg.vecdot(F.rms_norm(h, (d,)), key_n).unsqueeze(1)  # (B, 1)
                h = torch.addcmul(h, torch.sigmoid(score), value)
            # Attention at this position against the window in the cache.
            x = F.rms_norm(h, (d,), self.attn_gain, self.attn_eps)
            qkv = torch.mm(x, p["qkv"])
            if self.r:
                qkv, xa = qkv.split(3 * I, dim=1)
                qkv = torch.addmm(qkv, xa, p["qkv_b"])
            qkv = qkv.view(B, 3, H, hd)
            qk = qkv[:, :2]
            qk = torch.addcmul(qk * cos2, qk.roll(hd // 2, -1), sin2)  # (B, 2, H, hd): RoPE of q and k
            if cache.kv[it] is None:
                cache.kv[it] = (qk.new_zeros(B, H, W, hd), qk.new_zeros(B, H, W, hd))
            kb, vb = cache.kv[it]
            kb.select(2, slot).copy_(qk[:, 1])
            vb.select(2, slot).copy_(qkv[:, 2])
            z = F.scaled_dot_product_attention(qk[:, 0].unsqueeze(2), kb[:, :, :n], vb[:, :, :n])
            z = z.reshape(B, I)
            y = torch.mm(z, p["out"])
            if self.r:
                y, za = y.split(d, dim=1)
                y = torch.addmm(y, za, p["out_b"])
            h = h + y
            if self.ffn is None:
                continue
            z = F.rms_norm(h, (d,), self.ffn.gain, self.ffn.eps)
            f = torch.mm(z, self.front).split(self.front_split, dim=1)
            if self.E:
                h = h + self._moe(z, f[0], it)
            if self.sr:
                h = h + torch.mm(F.silu(f[-2]) * f[-1], self.shared_down)
        cache.length += 1
        return torch.mm(F.rms_norm(h, (d,), model.final_norm.gain, model.final_norm.eps), self.head)

    def _moe(self, z: torch.Tensor, router_logits: torch.Tensor, it: int) -> torch.Tensor:
        """The routed experts' weighted sum for each row of z (B, d), as MoE.forward routes."""
        probs = torch.softmax(router_logits.float(), dim=-1)  # (B, E)
        chosen = torch.topk(probs + self.bias[it], self.topk, dim=-1).indices  # (B, k)
        w = probs.gather(1, chosen)
        w = (w / w.sum(-1, keepdim=True)).to(z.dtype)  # (B, k)
        f = self.f
        if z.shape[0] == 1:  # its k experts directly
            ys = []
            for e in chosen[0].tolist():
                g, u = torch.mm(z, self.gate_up[e]).split(f, dim=1)
                ys.append(torch.mm(F.silu(g) * u, self.down[e]))
            return torch.mm(w, torch.cat(ys))  # (1, k) @ (k, d)
        # Several rows: assignments grouped by expert, each expert one product
        # over the rows that chose it, added back weighted (a row's k terms in
        # expert order).
        k = self.topk
        expert_of = chosen.reshape(-1)  # (B k,)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=self.E).tolist()
        rows = order // k
        xs, ws = z[rows], w.reshape(-1, 1)[order]
        y = torch.zeros_like(z)
        start = 0
        for e, n in enumerate(counts):
            if n:
                g, u = torch.mm(xs[start:start + n], self.gate_up[e]).split(f, dim=1)
                ye = torch.mm(F.silu(g) * u, self.down[e])
                y.index_add_(0, rows[start:start + n], ye * ws[start:start + n])
                start += n
        return y
