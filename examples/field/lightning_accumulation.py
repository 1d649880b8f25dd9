"""Reproduction: Lightning's gradient accumulation is not the larger batch on
padded data (Lightning #20350).

    python examples/field/lightning_accumulation.py      # one process, CPU, seconds

With `Trainer(accumulate_grad_batches=N)`, Lightning's automatic optimization
divides the loss `training_step` returns by N before each backward
(pytorch-lightning 2.6.6, `loops/optimization/automatic.py`: line 329 hands
`trainer.accumulate_grad_batches` to `ClosureResult.from_training_step_output` as
`normalize`, and line 83 does `closure_loss = closure_loss / normalize`), and the usual
`training_step` returns its micro-batch's token mean (`F.cross_entropy(...,
ignore_index=-100)`). The optimizer then applies the mean of the micro-batches'
token means. On padded rows of different lengths that is not the token mean over
the larger batch (batch size x N) that the accumulation stands in for: each
micro-batch's tokens are weighted by 1 / (its own count). Lightning hands the loss
to the user and has no count of the step's tokens to pass (HF's Trainer passes
`num_items_in_batch`).

The script trains one step of a tiny causal LM on the same four padded rows twice
(2 micro-batches of 2 rows with accumulate_grad_batches=2, and 1 batch of 4
rows), reads the gradient the optimizer receives (`on_before_optimizer_step`),
and compares; then the same with rows of equal length (equal, as expected).
Measured here (pytorch-lightning 2.6.6, torch 2.13 CPU): 1.2e-1 apart on the
padded rows, 7e-8 on rows of equal length.
docs/field-report.md row `lightning` `micro_mean` is the same on 2 gloo ranks.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D = 32, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.out = nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, ids):  # causal: each position sees the running mean of the embeddings before it
        x = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]
        return self.out(torch.tanh(self.mix(x)))


def rows(equal: bool) -> list[torch.Tensor]:
    lengths = [8, 8, 8, 8] if equal else [3, 8, 2, 7]
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def padded(batch: list[torch.Tensor]) -> dict:
    T = max(len(r) for r in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100)
    for i, r in enumerate(batch):
        ids[i, :len(r)], labels[i, :len(r)] = r, r
    return {"ids": ids, "labels": labels}


def lightning_gradient(micro: int, accumulate: int, equal: bool) -> dict:
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.grad = TinyLM(), None

        def training_step(self, batch, _):  # the usual idiom: the micro-batch's token mean
            z = self.net(batch["ids"])
            return F.cross_entropy(z[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)

        def on_before_optimizer_step(self, optimizer):
            self.grad = {n: p.grad.clone() for n, p in self.net.named_parameters()}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    data = rows(equal)
    batches = [padded(data[i:i + micro]) for i in range(0, len(data), micro)]
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return module.grad


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b) ** 0.5
    return num / sum(float(b[k].pow(2).sum()) for k in b) ** 0.5


def main() -> int:
    import logging

    import pytorch_lightning as pl

    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(f"pytorch-lightning {pl.__version__}, torch {torch.__version__}")
    for equal in (False, True):
        accumulated = lightning_gradient(2, 2, equal)
        larger = lightning_gradient(4, 1, equal)
        print(f"rows of {'equal' if equal else 'different'} lengths: accumulate_grad_batches=2 x 2 rows vs "
              f"1 x 4 rows: relative difference {rel(accumulated, larger):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
