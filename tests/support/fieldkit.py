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

import itertools

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
    """The micro-batch's summed next-token cross-entropy and its target count (what causal_lm declares).
    A padding-free micro-batch (position_ids, no attention_mask: examples concatenated in a row, each
    restarting its positions at 0) is computed example by example, each in a forward of its own: what
    one process computes whatever else shares the row."""
    if "attention_mask" not in batch and "position_ids" in batch:
        total, n = 0.0, 0
        for row in range(batch["input_ids"].shape[0]):
            starts = batch["position_ids"][row].eq(0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
            for a, b in itertools.pairwise(starts):
                if b - a < 2:
                    continue  # a lone token (or the right padding's zeros) has no next-token target
                s, c = loss_sum(net, {"input_ids": batch["input_ids"][row:row + 1, a:b],
                                      "attention_mask": torch.ones(1, b - a, dtype=torch.long),
                                      "labels": batch["labels"][row:row + 1, a:b]})
                total, n = total + s, n + c
        return total, n
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


def _at(net, params: dict | None):
    """net with the trainable parameters set to `params` (name -> tensor; None: as built)."""
    if params:
        with torch.no_grad():
            for name, p in net.named_parameters():
                if name in params:
                    p.copy_(params[name])
    return net


def one_process_gradient(build_net, batches: list[dict], *, weights: list[float] | None = None,
                         params: dict | None = None) -> dict:
    """The gradient one process computes, by hand and independently of the gate's
    reference: sum over the micro-batches of weight_i * S_i (S_i the summed
    cross-entropy), the weights 1 / N_global by default (the global token mean),
    at the initial parameters or at `params` (a later step's recorded ones).
    Frozen parameters (requires_grad False) have none."""
    net = _at(build_net(), params)
    net.train()
    n = sum(targets(b) for b in batches)  # padding-free rows too: TRL's collator labels each example's start -100
    weights = weights or [1.0 / n] * len(batches)
    total = sum(w * loss_sum(net, b)[0] for w, b in zip(weights, batches))
    total.backward()
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def relative(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every tensor of b (float64)."""
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b)
    den = sum(float((b[k].double() ** 2).sum()) for k in b)
    return (num / den) ** 0.5


def _logp_rows(net, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the summed log-likelihood of its labelled next tokens, the summed NLL and the count
    (from cross_entropy, apart from trl_client's log_softmax)."""
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    y = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-100,
                          reduction="none").view(y.shape)
    return -nll.sum(1), nll.sum(1), y.ne(-100).sum(1)


def dpo_gradient(build_net, batches: list[dict], *, beta: float, sft: str | None = None,
                 params: dict | None = None) -> dict:
    """DPO's gradient by hand: each micro-batch's rows are B chosen then B rejected, pair i = rows
    (i, i + B); the reference log-likelihoods from a second copy of the initial model; the loss the
    mean over every pair of -log sigmoid(beta (log-ratio chosen - log-ratio rejected)). sft adds the
    chosen completions' NLL: "global" its token mean over the whole step (one process at the global
    batch), "micro" the mean over micro-batches of each one's own token mean (what each forward of
    DPOTrainer's "sft" loss computes)."""
    net, ref = _at(build_net(), params), build_net()
    net.train()
    ref.eval()
    terms, nlls, counts = [], [], []
    for b in batches:
        lp, nll, cnt = _logp_rows(net, b)
        with torch.no_grad():
            ref_lp = _logp_rows(ref, b)[0]
        half = lp.shape[0] // 2
        margin = (lp[:half] - ref_lp[:half]) - (lp[half:] - ref_lp[half:])
        terms.append(F.softplus(-beta * margin))  # -log sigmoid(x) = softplus(-x)
        nlls.append(nll[:half].sum())
        counts.append(int(cnt[:half].sum()))
    total = torch.cat(terms).mean()
    if sft == "global":
        total = total + sum(nlls) / sum(counts)
    elif sft == "micro":
        total = total + sum(x / c for x, c in zip(nlls, counts)) / len(batches)
    total.backward()
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def repeated_rows(epochs: list[list[dict]]) -> int:
    """Rows read more than once within an epoch (each epoch a list of micro-batches), a row being its
    tokens under the attention mask (a padding-free row: each example between position_ids 0s)."""
    repeats = 0
    for batches in epochs:
        seen: set = set()
        for b in batches:
            for i in range(b["input_ids"].shape[0]):
                ids = b["input_ids"][i]
                if "attention_mask" in b:
                    pieces = [tuple(ids[b["attention_mask"][i].bool()].tolist())]
                elif "position_ids" in b:
                    cut = b["position_ids"][i].eq(0).nonzero().flatten().tolist() + [ids.shape[0]]
                    pieces = [tuple(ids[x:y].tolist()) for x, y in itertools.pairwise(cut) if y - x > 1]
                else:
                    pieces = [tuple(ids.tolist())]
                for piece in pieces:
                    repeats += piece in seen
                    seen.add(piece)
    return repeats
