"""The normalised form "gn" made after a step's g, where the caller asks for it.

gn (each micro-batch's loss sum x W / N backpropagated, summed, / W: what HF's
Trainer and DDP loops backpropagate) costs a second backward per micro-batch.
The judge holds each float32 step to the nearer of g and gn, so a step whose
fleet gradient is already within its bound of g needs no gn: `dormouse gate
check` passes step_gradient_parts a `normalised(rec, step, info, g)` that
says where (judge/forms.py), and this module makes gn there, after g, with
the seed, the model's attributes and the RNG state g's backward had.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import rngstate as RS
from dormouse.gate.record.reference.spill import Spill, StepParts


class FormedG(Mapping):
    """The step's g tensor by tensor, each formed (float64) from its spilled sources when asked."""

    def __init__(self, spill: Spill, n_total: float, present: set):
        self.spill, self.n_total, self.names = spill, n_total, sorted(present)

    def __getitem__(self, n: str) -> torch.Tensor:
        if n not in self.names:
            raise KeyError(n)
        return self.spill.value(A.GRAD, n) / self.n_total

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def normalised_form(model, rec, step: int, user, mbs, spill: Spill, parts: StepParts, aw, scale: float) -> float:
    """gn's sources spilled beside g's (each micro-batch's backward at loss sum x `scale`, weighted 1 / W, in
    g's order); returns gn's norm (what the clip check compares the loop's with)."""
    objective, w = rec.spec.objective, len({r for r, _, _ in mbs})
    for r, m, batch in mbs:
        undo = FW.attrs(model, rec, r, step, m)
        try:
            RS.restore(rec, r, step, m)  # the masks its rank drew
            FW.backward(model, objective, batch, user, rec.autocast(r, step, m), scale=scale, aux_weight=aw)
            spill.add(A.GRAD_NORMALISED, spill.put(model)[0], 1.0 / w)
        finally:
            model.zero_grad(set_to_none=True)
            undo()
    total = 0.0
    for n in parts.names:
        for rows in parts._ranges(n):
            v = spill.value(A.GRAD_NORMALISED, n, rows)
            total += float(v.square().sum()) if v is not None else 0.0
    return math.sqrt(total)
