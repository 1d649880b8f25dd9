"""A tiny causal LM built as the models the sharded reference is for (tests/gate/drivers/
test_sharded_check.py): its layers in an nn.ModuleList (each an FSDP2 unit of its own) and its head
tied to the token embedding (a parameter two units would share: it stays with the root); the loop
that records it in one process, clean or with the mean of micro-batch means."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, D, T = 32, 16, 12


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc = torch.nn.Linear(D, 2 * D)
        self.out = torch.nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class BlockLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList([Block() for _ in range(3)])
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.tok(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(*, seed: int = 0, **_) -> BlockLM:
    torch.manual_seed(seed)
    return BlockLM()


def build_optimizer(model, *, lr: float = 1e-2, **_):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _batch(g: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of random lengths; labels -100 on padding."""
    lengths = torch.randint(3, T + 1, (rows,), generator=g)
    ids = torch.randint(0, VOCAB, (rows, T), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def record(out, *, micro_mean: bool = False, steps: int = 2, micro: int = 3) -> None:
    """One process's loop over `steps` steps of `micro` micro-batches, each micro-batch's token loss
    sum over the step's tokens (clean) or its own mean / micro (the mean of micro-batch means)."""
    from dormouse.gate import Recorder, RecordingSpec

    model = build_model(seed=0)
    opt = build_optimizer(model)
    spec = RecordingSpec(build_model="blocklm:build_model", build_optimizer="blocklm:build_optimizer",
                         objective="causal_lm", build_kwargs={"seed": 0}, max_grad_norm=0.0)
    rec = Recorder(out, model, spec)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        batches = [_batch(g, 2) for _ in range(micro)]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for b in batches:
            logits = model(**b)
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1),
                                 ignore_index=-100, reduction="sum")
            n = int((b["labels"][:, 1:] != -100).sum())
            (ce / n / micro if micro_mean else ce / tokens).backward()
        rec.step(optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec.close()
