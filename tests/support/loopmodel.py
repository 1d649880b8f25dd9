"""A tiny GPT-like causal LM, its optimizer and its generated data: the
user's code of the plain DDP/FSDP2 loop in ddp_loop.py (random init, nothing
downloaded). The Recorder records `loopmodel:build_model` and
`loopmodel:build_optimizer` with the run's keyword arguments, and the gate's
reference rebuilds from them in another process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, D, T = 48, 16, 12


class TinyLM(torch.nn.Module):
    """Embedding + position, one causal self-attention block with an MLP, a head.
    Options a fault needs: BatchNorm over the features (batch statistics),
    dropout, and a parameter the forward never uses."""

    def __init__(self, *, bn: bool = False, dropout: float = 0.0, unused: bool = False):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Embedding(T, D)
        self.ln1 = torch.nn.LayerNorm(D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)
        self.ln2 = torch.nn.LayerNorm(D)
        self.fc = torch.nn.Linear(D, 2 * D)
        self.out = torch.nn.Linear(2 * D, D)
        self.head = torch.nn.Linear(D, VOCAB)
        self.bn = torch.nn.BatchNorm1d(D) if bn else None
        self.drop = torch.nn.Dropout(dropout) if dropout else None
        self.spare = torch.nn.Linear(D, D) if unused else None  # never called: no gradient in one process

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None):
        b, t = input_ids.shape
        x = self.tok(input_ids) + self.pos(torch.arange(t) if position_ids is None else position_ids)
        if self.bn is not None:
            x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True)
        a = self.proj(a.squeeze(1))
        if self.drop is not None:
            a = self.drop(a)
        x = x + a
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return self.head(x)


def build_model(*, seed: int = 0, bn: bool = False, dropout: float = 0.0, unused: bool = False, **_) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(bn=bn, dropout=dropout, unused=unused)


def lr_factor(step: int) -> float:
    """Linear warm-up over 3 steps, then linear decay."""
    return min(1.0, (step + 1) / 3) * max(0.1, 1.0 - step / 20)


def build_optimizer(model, *, lr: float = 1e-2, weight_decay: float = 0.1, **_):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def dataset(n: int, seed: int) -> list[torch.Tensor]:
    """n token sequences of random lengths 3..T (the data the loop reads)."""
    g = torch.Generator().manual_seed(1000 + seed)
    lengths = torch.randint(3, T + 1, (n,), generator=g)
    return [torch.randint(0, VOCAB, (int(L),), generator=g) for L in lengths]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded to the micro-batch's longest row; labels -100 on padding."""
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class TinyClassifier(torch.nn.Module):
    """A sequence classifier ((B, C) logits): a model the causal LM objective does not fit."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, D)
        self.head = torch.nn.Linear(D, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.head(self.tok(input_ids).mean(1))


def build_classifier(*, seed: int = 0, **_) -> TinyClassifier:
    torch.manual_seed(seed)
    return TinyClassifier()


def token_sum(model, batch):
    """A user objective (model, batch) -> (loss_sum, count): the causal LM's, by hand."""
    logits = model(batch["input_ids"])
    y = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, int((y != -100).sum())


class FlatLM(torch.nn.Module):
    """TinyLM's shape with every parameter on the module itself (no submodules):
    embedding, a causal attention, an MLP and a head by torch.nn.functional."""

    def __init__(self):
        super().__init__()
        g = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.3)  # noqa: E731
        self.tok, self.pos = g(VOCAB, D), g(T, D)
        self.qkv_w, self.qkv_b = g(3 * D, D), torch.nn.Parameter(torch.zeros(3 * D))
        self.fc_w, self.fc_b = g(2 * D, D), torch.nn.Parameter(torch.zeros(2 * D))
        self.out_w, self.head_w = g(D, 2 * D), g(VOCAB, D)

    def forward(self, input_ids, attention_mask=None, labels=None):
        b, t = input_ids.shape
        x = F.embedding(input_ids, self.tok) + self.pos[:t]
        q, k, v = F.linear(F.layer_norm(x, (D,)), self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True).squeeze(1)
        x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (D,)), self.fc_w, self.fc_b)), self.out_w)
        return F.linear(x, self.head_w)


class HeadAutocastLM(TinyLM):
    """TinyLM whose own forward runs only its head under bfloat16 autocast (the body in float32)."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        head, self.head = self.head, torch.nn.Identity()
        try:
            x = super().forward(input_ids, attention_mask)
        finally:
            self.head = head
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(x)


class AmpLM(TinyLM):
    """TinyLM plus amp * (a - b) on the logits, where a and b are the same linear map of the
    features, a under the ambient autocast and b in float32: zero in exact arithmetic (and in
    float32), amp x the round-off under autocast, in the forward and in the gradient."""

    def __init__(self, amp: float, **kw):
        super().__init__(**kw)
        self.amp = amp
        self.twin = torch.nn.Linear(D, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        z = super().forward(input_ids, attention_mask)
        b, t = input_ids.shape
        x = self.tok(input_ids) + self.pos(torch.arange(t))
        a = self.twin(x)
        with torch.autocast("cpu", enabled=False):
            b_ = F.linear(x.float(), self.twin.weight, self.twin.bias)
        return z + self.amp * (a.float() - b_)


def build_review_model(*, seed: int = 0, kind: str = "flat", amp: float = 0.0, **kw):
    """The reviewer's models: "flat" (FlatLM), "head_autocast", "amp" (AmpLM with `amp`)."""
    torch.manual_seed(seed)
    if kind == "flat":
        return FlatLM()
    if kind == "head_autocast":
        return HeadAutocastLM()
    return AmpLM(amp)
