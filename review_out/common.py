"""A tiny torchtitan-style llama, its data and its optimizer, for the review's own loops.

Written from the docs alone (docs/parallelisms.md, docs/your-loop.md). Shared by the
fleet scripts (tp_run.py, pp_run.py) and by truth.py, the independent one-process
computation (which does not import the gate)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

D, H, T = 16, 4, 8


class Attention(nn.Module):
    def __init__(self, d=D, h=H):
        super().__init__()
        self.hd = d // h
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (w(x).view(B, L, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))


class FFN(nn.Module):
    def __init__(self, d=D, hidden=32):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(D), nn.LayerNorm(D)   # weight AND bias
        self.attention, self.feed_forward = Attention(), FFN()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, n_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(D)
        self.output = nn.Linear(D, vocab, bias=False)

    def forward(self, input_ids):
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(vocab=64, seed=0, **_):
    torch.manual_seed(seed)
    m = TinyLM(vocab)
    with torch.no_grad():          # non-trivial norm parameters, so their gradients are not special
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return m


def build_optimizer(model, **_):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def batch(step, replica, micro, vocab=64, rows=2, data_seed=0, mask=True):
    """input_ids (rows, T) and labels (-100 on ~30% of positions, so token counts differ)."""
    g = torch.Generator().manual_seed(10_000 * data_seed + 1000 * step + 100 * replica + micro)
    x = torch.randint(0, vocab, (rows, T), generator=g)
    y = x.clone()
    if mask:
        y[torch.rand(rows, T, generator=g) < 0.3] = -100
    return x, y


def shifted(y):
    """labels aligned with logits: position t predicts y[t+1]; the last position ignored."""
    return F.pad(y[:, 1:], (0, 1), value=-100)


def n_targets(y):
    return int((shifted(y) != -100).sum())


def init_weights(m, seed=0):
    """torchtitan's flow: initialise in place (after parallelising, on the sharded parameters)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.fill_(1.0 if n.endswith("weight") else 0.0)
            else:
                p.normal_(0.0, 0.02)


def build_model_titan(vocab=64, seed=0, **_):
    m = TinyLM(vocab)
    init_weights(m, seed)
    return m
