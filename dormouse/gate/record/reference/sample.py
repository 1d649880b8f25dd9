"""Which recorded tensor steps the reference spends its checks of the batch's
shape on: fact 1's rows alone (example_sample) and the step's rows merged
into one forward. Each costs forwards and backwards beside the gradient's
own (the rows alone about 1.5 x their micro-batch's, the merged forward the
step's), so they are taken by a budget, not at every step: the first tensor
step always (every rank's first micro-batch row by row, and the merged
forward), a later one only while their rows so far stay within
EXTRAS_BUDGET x the rows the gradient differentiated so far. The check's
time then grows with the run's, about (1 + EXTRAS_BUDGET) x the gradient's
forwards, and the verdict states the steps and rows it took (info
"ex_micro", "merged")."""

from __future__ import annotations

import math

import torch

EXTRAS_BUDGET = 0.5  # the extras' rows, at most this fraction of the gradient's rows so far (past the first step)
ROW_COST = 1.5  # a micro-batch differentiated row by row, against its own backward


def batch_rows(batch: dict) -> int:
    """A micro-batch's rows: the first dimension of its first batched tensor (1 where it has none)."""
    return next((int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), 1)


def example_sample(mbs: list[tuple[int, int, dict]], j: int) -> set[int]:
    """Which of a step's micro-batches (rank, m, batch) fact 1's per-example
    check differentiates row by row at the j-th step the budget takes
    (0-based): j = 0 every rank's first micro-batch, j > 0 one micro-batch, the
    (j - 1)-th in rank-then-micro order, cyclically."""
    if j == 0:
        return {i for i, (r, m, _) in enumerate(mbs) if m == min(mm for rr, mm, _ in mbs if rr == r)}
    return {(j - 1) % len(mbs)}


class ExtrasBudget:
    """Across a reference's tensor steps, in order: take(mbs) gives the index j
    example_sample reads at a step the budget takes, None at one it skips."""

    def __init__(self, budget: float = EXTRAS_BUDGET):
        self.budget, self.rows, self.spent, self.taken = budget, 0.0, 0.0, 0

    def stated(self) -> float | None:
        """The budget the verdict states (None: every tensor step taken)."""
        return self.budget if math.isfinite(self.budget) else None

    def take(self, mbs: list[tuple[int, int, dict]]) -> int | None:
        rows = [batch_rows(b) for _, _, b in mbs]
        self.rows += sum(rows)
        j = self.taken
        cost = sum(rows) + ROW_COST * sum(rows[i] for i in example_sample(mbs, j))
        if j > 0 and self.spent + cost > self.budget * self.rows:
            return None
        self.spent += cost
        self.taken += 1
        return j
