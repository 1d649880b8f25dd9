"""The data the framework clients (Lightning, accelerate) train on, laid out per
optimizer step: global step s, accumulation micro-batch m, rank r holds rows
`perm[((s * K + m) * W + r) * B : ... + B]` of `loopmodel.dataset`, right-padded
(`loopmodel.collate`, variable lengths 3..12, so that per-micro-batch and
per-rank token means differ from the global batch's).

Each micro-batch carries two counts the loop's loss needs (what HF's Trainer
computes as `num_items_in_batch` by looking ahead over the step's batches):
`n_step`, the target tokens (labels shifted by one, -100 ignored) of the whole
global step (every rank, every micro-batch), and `n_rank`, this rank's own in
the step. They are not passed to the model, so the Recorder does not record
them: the gate's reference counts for itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import loopmodel

B = 2  # rows per micro-batch


def targets(batch: dict) -> int:
    return int(batch["labels"][:, 1:].ne(-100).sum())


def step_batches(*, seed: int, world: int, rank: int, k: int, steps: int, b: int = B) -> list[dict]:
    """This rank's micro-batches in training order (steps * k of them), each with n_step and n_rank."""
    rows = loopmodel.dataset(steps * k * world * b, seed)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    grid = [[[loopmodel.collate([rows[perm[((s * k + m) * world + r) * b + i]] for i in range(b)])
              for r in range(world)] for m in range(k)] for s in range(steps)]
    out = []
    for s in range(steps):
        n_step = sum(targets(grid[s][m][r]) for m in range(k) for r in range(world))
        n_rank = sum(targets(grid[s][m][rank]) for m in range(k))
        for m in range(k):
            out.append({**grid[s][m][rank], "n_step": torch.tensor(n_step), "n_rank": torch.tensor(n_rank)})
    return out


def loss_sum(net, batch: dict) -> tuple[torch.Tensor, int]:
    """The micro-batch's summed next-token cross-entropy and its target count (what causal_lm declares)."""
    out = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    logits = out.logits if hasattr(out, "logits") else out
    y = batch["labels"][:, 1:]
    s = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                        reduction="sum")
    return s, int(y.ne(-100).sum())


class Listed(torch.utils.data.Dataset):
    """A list of ready micro-batches as a map-style dataset (DataLoader(batch_size=None) yields them as they are)."""

    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def one_process_gradient(build_net, batches: list[dict], *, weights: list[float] | None = None) -> dict:
    """The gradient one process computes, by hand and independently of the gate's
    reference: sum over the micro-batches of weight_i * S_i (S_i the summed
    cross-entropy), the weights 1 / N_global by default (the global token mean).
    Frozen parameters (requires_grad False) have none."""
    net = build_net()
    net.train()
    n = sum(targets(b) for b in batches)
    weights = weights or [1.0 / n] * len(batches)
    total = sum(w * loss_sum(net, b)[0] for w, b in zip(weights, batches))
    total.backward()
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def relative(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every tensor of b (float64)."""
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b)
    den = sum(float((b[k].double() ** 2).sum()) for k in b)
    return (num / den) ** 0.5
