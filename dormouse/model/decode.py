"""Incremental decoding: one new position for each of B sequences per call,
with as few tensor operations, and as few bytes of weights read, as the
mathematics allows.

`Decoder(model).step(tokens, cache)` computes what `model(tokens[:, None],
cache=cache)` computes (the forward of DormouseModel, see network.py, at the
one position after the cache.length already seen, attending to the cache's
sliding window at every iteration), for a dropless MoE, without autograd. It
differs only in how the same products are grouped, so its logits equal the
forward's up to float round-off (tests bound it), never in what they are a
function of. At one sequence a step reads every weight it uses once: its time
is that of reading ~18 MB (small preset) from memory plus a fixed cost per
tensor operation, so both are kept small:

- weights are stored (in, out), contiguous: a row vector times a matrix then
  streams it once in memory order (a transposed view read it ~1.7x slower
  here, measured from a cold cache);
- each iteration's low-rank adapters are merged into its own copies of the
  projections: W_qkv + B_i A_i and W_out + D_i C_i (the same linear map,
  (W + B A) x = W x + B (A x)), one product each, and the output projection
  adds into the residual in the same product (addmm);
- rms-norm gains are folded into the matrices that read the norm's output:
  rms(h) * g @ W = (h * rsqrt(sum h^2 + d eps)) @ (sqrt(d) diag(g) W), since
  rsqrt(mean h^2 + eps) = sqrt(d) rsqrt(sum h^2 + d eps); so a norm costs one
  product h h^T (sum of squares, with d eps added in the same addmm), one
  rsqrt and one multiply. The FFN norm's gain goes into the router, the
  shared expert's input matrices (one [W_router; W_gate; W_up]) and every
  expert's [W_gate; W_up]; the final norm's into the head. Engram's gate
  <rms(h), rms(k)> / sqrt(d) = rsqrt(sum h^2 + d eps) <h, rms(k)>, with
  rms(k_t) computed once per position, not per iteration;
- RoPE rotates q, k (and v, by the identity) in one pass over precomputed
  rows: for x = (x1, x2), x * (cos, cos) + (x2, x1) * (-sin, sin) is, element
  by element, exactly apply_rope's (x1 cos - x2 sin, x1 sin + x2 cos); v's
  rows are cos = 1, sin = 0, which give v exactly;
- MoE: with one sequence, each of its k experts adds w_e * expert_e(z) into
  the residual (the gate weight as the addmm's alpha); with B > 1 sequences
  the assignments are grouped by expert as MoE.forward groups them, each
  expert one product over the rows that chose it (its weights read once for
  the batch), and y_b = sum over b's k choices of w_e * expert_e(z_b), added
  in expert order. The shared expert's down projection adds into the residual.
- one sequence (the common case, `generate`) does in Python numbers what a
  tensor op per value would cost more for: its n-grams' rows are hashed in
  Python integers (ngram_rows' arithmetic, exact; tested bitwise), its top-k
  experts are picked from the float32 probs + bias that MoE.forward ranks, and
  their weights p_e / sum p renormalised in double (within an ulp of float32's);
  its Engram rows come from one index_select of the flattened tables, and a
  position's key and value go into the cache in one copy (KVCache.rings).

The cache is DormouseModel's KVCache (fill it with a forward over the prompt,
then step); positions past the rope table get rows from the same formula.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dormouse.model.attention import KVCache, rope_tables
from dormouse.model.engram import _PRIME, _SENTINEL, ngram_rows


def _io(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A Linear-layout weight (out, in), computed in float32, as a contiguous (in, out) matrix of `dtype`."""
    return w.T.to(dtype).contiguous()


class Decoder:
    """The one-position step of a DormouseModel (eval, no autograd), for a
    dropless MoE. Built once per generation: it copies (merges, folds) the
    weights it reads, so build a new one after the weights change."""

    @torch.no_grad()
    def __init__(self, model):
        cfg = model.cfg
        if cfg.moe_on and cfg.moe_capacity > 0:
            raise ValueError("a capacity-dropping MoE depends on the whole window: no incremental decoder")
        self.cfg, self.model = cfg, model
        blk, att = model.block, model.block.attn
        d = self.d = cfg.d_model
        self.inner, self.H, self.hd, self.window = att.n_heads * att.head_dim, att.n_heads, att.head_dim, cfg.max_seq_len
        dt = model.head.weight.dtype
        f32 = lambda t: t.detach().float()  # noqa: E731  folding and merging in float32, then stored in dt
        sd = math.sqrt(d)
        # (gain * sqrt(d)) per input column: what a folded norm's matrix is scaled by.
        fold = lambda norm: f32(norm.gain) * sd  # noqa: E731
        self.iters = []
        g_attn = fold(blk.attn_norm)
        for it in range(cfg.max_iter):
            qkv, out = f32(att.qkv), f32(att.out)
            if att.rank:
                qkv = torch.addmm(qkv, f32(att.lora_qkv_b[it]), f32(att.lora_qkv_a[it]))  # (3I, d)
                out = torch.addmm(out, f32(att.lora_out_b[it]), f32(att.lora_out_a[it]))  # (d, I)
            self.iters.append({"qkv": _io(qkv * g_attn, dt), "out": _io(out, dt)})
        # sum h^2 + d eps of each norm, as the (1, 1) input of an addmm
        self.c_attn = torch.full((1, 1), d * blk.attn_norm.eps, dtype=dt)
        self.c_final = torch.full((1, 1), d * model.final_norm.eps, dtype=dt)
        moe, sh = blk.moe, blk.shared
        self.E = moe.n_experts if moe is not None else 0
        self.sr = sh.w_gate.shape[0] if sh is not None else 0
        self.ffn = blk.ffn_norm is not None
        if self.ffn:
            g_ffn = fold(blk.ffn_norm)
            self.c_ffn = torch.full((1, 1), d * blk.ffn_norm.eps, dtype=dt)
            front = ([moe.router.weight] if moe is not None else []) + ([sh.w_gate, sh.w_up] if sh else [])
            self.front = _io(torch.cat([f32(w) for w in front]) * g_ffn, dt)  # (d, E + 2 sr)
            self.front_split = ([self.E] if self.E else []) + ([self.sr, self.sr] if self.sr else [])
        if moe is not None:
            self.topk, self.bias, self.f = moe.topk, moe.router_bias.float(), moe.expert_w_gate.shape[1]
            self.gate_up = [_io(torch.cat([f32(moe.expert_w_gate[e]), f32(moe.expert_w_up[e])]).mul_(g_ffn), dt)
                            for e in range(self.E)]  # (d, 2F)
            self.down = [_io(f32(moe.expert_w_down[e]), dt) for e in range(self.E)]  # (F, d)
        if sh is not None:
            self.shared_down = _io(f32(sh.w_down), dt)
        eg = model.engram
        if eg is not None:
            self.kv = _io(torch.cat([f32(eg.key), f32(eg.value)]), dt)  # (K dim, 2d)
            self.rows_of = torch.arange(eg.table.shape[0], device=eg.table.device)
            self.c_engram = torch.full((1, 1), d * torch.finfo(dt).eps, dtype=dt)  # F.rms_norm's eps=None
            # One sequence hashes its n-grams in Python integers (ngram_rows' arithmetic,
            # exact: products < 2^40) and reads the K rows from the tables as one flat table.
            K, rows = eg.table.shape[:2]
            self.multipliers, self.rows = eg.multipliers.tolist(), rows  # (orders, heads, max_n)
            self.table_rows = eg.table.detach().reshape(K * rows, -1)  # (K rows, dim), row k * rows + r
        self.head = _io(f32(model.head.weight) * fold(model.final_norm), dt)
        self._cos3 = self._sin3 = None
        self._rope_rows(0)

    def _rope_rows(self, pos: int) -> None:
        """(cos, cos) and (-sin, sin) rows of q and k, and (1, 0) of v, for a table of positions covering pos."""
        if self._cos3 is not None and pos < self._cos3.shape[0]:
            return
        n = max(self.window, pos + 1)
        n = self.window * math.ceil(n / self.window)  # whole windows: extended rarely
        cos, sin = rope_tables(n, self.hd, self.model.block.attn.rope_base)
        dev, dt = self.head.device, self.head.dtype
        cos, sin = cos.to(dev, dt), sin.to(dev, dt)  # apply_rope casts the same way
        cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (n, hd)
        self._cos3 = torch.stack([cos2, cos2, torch.ones_like(cos2)], dim=1)[:, :, None]  # (n, 3, 1, hd)
        self._sin3 = torch.stack([sin2, sin2, torch.zeros_like(sin2)], dim=1)[:, :, None]

    @staticmethod
    def _inv_rms(h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """rsqrt(sum over the row of h^2 + c) of each row of h (B, d): (B, 1)."""
        if h.shape[0] == 1:
            return torch.addmm(c, h, h.mT).rsqrt_()
        return torch.linalg.vecdot(h, h).unsqueeze(1).add_(c).rsqrt_()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens (B,) byte ids of the position cache.length -> logits (B, vocab);
        advances the cache by one position."""
        if tokens.shape[0] == 1:
            return self._step_one(tokens, cache)
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
            key_t = F.rms_norm(key, (d,)).mT  # (d, B): rms(k_t), once
        self._rope_rows(pos)
        cos3, sin3 = self._cos3[pos], self._sin3[pos]
        slot, n = pos % W, min(pos + 1, W)
        for it, p in enumerate(self.iters):
            if eg is not None:  # sigmoid(rsqrt(sum h^2 + d eps) <h, rms(k)>) * v
                score = torch.mm(h, key_t) if B == 1 else torch.linalg.vecdot(h, key_t.mT).unsqueeze(1)
                h = torch.addcmul(h, torch.sigmoid(score.mul_(self._inv_rms(h, self.c_engram))), value)
            # Attention at this position against the window in the cache.
            qkv = torch.mm(h * self._inv_rms(h, self.c_attn), p["qkv"]).view(B, 3, H, hd)
            qkv = torch.addcmul(qkv * cos3, qkv.roll(hd // 2, -1), sin3)  # RoPE of q and k; v as it was
            cache.ring(it, B, H, hd, qkv)
            kb, vb = cache.kv[it]
            q, k, v = qkv.unbind(1)  # (B, H, hd) each
            kb[:, :, slot] = k
            vb[:, :, slot] = v
            z = F.scaled_dot_product_attention(q.unsqueeze(2), kb.narrow(2, 0, n), vb.narrow(2, 0, n))
            h = torch.addmm(h, z.reshape(B, I), p["out"])
            if not self.ffn:
                continue
            z = h * self._inv_rms(h, self.c_ffn)  # rms(h) / sqrt(d) without the gain: folded
            f = torch.mm(z, self.front).split_with_sizes(self.front_split, dim=1)  # router, shared gate, up
            if self.E:
                h = self._moe(h, z, f[0], it)
            if self.sr:
                h = torch.addmm(h, F.silu(f[-2]) * f[-1], self.shared_down)
        cache.length += 1
        return torch.mm(h * self._inv_rms(h, self.c_final), self.head)

    def _ngram_rows_one(self, ctx: list[int]) -> list[int]:
        """ngram_rows' rows of the last position of one sequence's context
        (ctx: its last bytes, at most max_n), as indices into table_rows."""
        mult, rows = self.multipliers, self.rows
        max_n = len(mult[0][0])
        back = [b + 1 for b in reversed(ctx)] + [_SENTINEL + 1] * (max_n - len(ctx))  # x_{t-i} + 1
        out, k = [], 0
        for o, heads in enumerate(mult):  # order n = o + 2: terms i < n
            for m in heads:
                h = 0
                for i in range(o + 2):
                    h ^= back[i] * m[i]
                out.append(k * rows + h % _PRIME % rows)
                k += 1
        return out

    def _step_one(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """step() for one sequence: the same products, with the routing and the
        n-gram hashing in Python numbers, and each position's key and value
        written in one copy."""
        cfg, model = self.cfg, self.model
        d, H, hd, I = self.d, self.H, self.hd, self.inner
        pos, W = cache.length, self.window
        tok = int(tokens)
        h = model.embed.weight[tok:tok + 1]  # (1, d): a view; every op below makes a new h
        eg = model.engram
        if eg is not None:  # this position's n-grams, from the bytes the cache has seen
            keep = cfg.engram_max_n - 1
            ctx = ([] if cache.tail is None else cache.tail.tolist()[0]) + [tok]
            cache.tail = torch.tensor([ctx[-keep:]], dtype=tokens.dtype, device=tokens.device)
            idx = torch.tensor(self._ngram_rows_one(ctx[-(keep + 1):]), device=tokens.device)
            e = self.table_rows.index_select(0, idx).view(1, -1)  # (1, K dim)
            key, value = torch.mm(e, self.kv).split(d, dim=1)
            key_t = F.rms_norm(key, (d,)).mT  # (d, 1): rms(k_t), once
        self._rope_rows(pos)
        cos3, sin3 = self._cos3[pos], self._sin3[pos]
        slot, n = pos % W, min(pos + 1, W)
        E, f = self.E, getattr(self, "f", 0)
        for it, p in enumerate(self.iters):
            if eg is not None:  # sigmoid(rsqrt(sum h^2 + d eps) <h, rms(k)>) * v
                score = torch.mm(h, key_t)
                h = torch.addcmul(h, torch.sigmoid(score.mul_(self._inv_rms(h, self.c_engram))), value)
            qkv = torch.mm(h * self._inv_rms(h, self.c_attn), p["qkv"]).view(1, 3, H, hd)
            qkv = torch.addcmul(qkv * cos3, qkv.roll(hd // 2, -1), sin3)  # RoPE of q and k; v as it was
            cache.ring(it, 1, H, hd, qkv).select(3, slot).copy_(qkv.narrow(1, 1, 2))  # this position's k, v
            kb, vb = cache.kv[it]
            z = F.scaled_dot_product_attention(qkv[:, 0].unsqueeze(2), kb.narrow(2, 0, n), vb.narrow(2, 0, n))
            h = torch.addmm(h, z.view(1, I), p["out"])
            if not self.ffn:
                continue
            z = h * self._inv_rms(h, self.c_ffn)  # rms(h) / sqrt(d) without the gain: folded
            fr = torch.mm(z, self.front).split_with_sizes(self.front_split, dim=1)  # router, shared gate, up
            if E:  # MoE.forward's routing: softmax, top-k of probs + bias, weights renormalised
                probs = torch.softmax(fr[0] if fr[0].dtype == torch.float32 else fr[0].float(), dim=-1)
                p_, s_ = probs.tolist()[0], (probs + self.bias[it]).tolist()[0]
                chosen = sorted(range(E), key=s_.__getitem__, reverse=True)[:self.topk]
                total = sum(p_[e] for e in chosen)
                for e in chosen:  # each of its k experts added into h with its weight
                    g, u = torch.mm(z, self.gate_up[e]).split_with_sizes((f, f), dim=1)
                    h = torch.addmm(h, F.silu(g).mul_(u), self.down[e], alpha=p_[e] / total)
            if self.sr:
                h = torch.addmm(h, F.silu(fr[-2]).mul_(fr[-1]), self.shared_down)
        cache.length += 1
        return torch.mm(h * self._inv_rms(h, self.c_final), self.head)

    def _moe(self, h: torch.Tensor, z: torch.Tensor, router_logits: torch.Tensor, it: int) -> torch.Tensor:
        """h plus the routed experts' weighted sum for each row of z (B, d), as MoE.forward routes."""
        probs = torch.softmax(router_logits.float(), dim=-1)  # (B, E)
        chosen = torch.topk(probs + self.bias[it], self.topk, dim=-1).indices  # (B, k)
        w = probs.gather(1, chosen)
        w = w / w.sum(-1, keepdim=True)  # (B, k), float32
        f = self.f
        if z.shape[0] == 1:  # its k experts directly, each added into h with its weight
            for e, we in zip(chosen.tolist()[0], w.tolist()[0]):
                g, u = torch.mm(z, self.gate_up[e]).split_with_sizes((f, f), dim=1)
                h = torch.addmm(h, F.silu(g) * u, self.down[e], alpha=we)
            return h
        # Several rows: assignments grouped by expert, each expert one product
        # over the rows that chose it, added back weighted (a row's k terms in
        # expert order).
        w = w.to(z.dtype)
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
                g, u = torch.mm(xs[start:start + n], self.gate_up[e]).split_with_sizes((f, f), dim=1)
                ye = torch.mm(F.silu(g) * u, self.down[e])
                y.index_add_(0, rows[start:start + n], ye * ws[start:start + n])
                start += n
        return h + y
