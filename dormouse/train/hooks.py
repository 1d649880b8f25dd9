"""Explicit points where code outside the loop observes or changes a step.

The loop and every synchroniser call them at fixed places of each step
(steps numbered from 1, as `on_step` numbers them):

    for each slice of this process: forward, backward
    on_local_grads(LocalGrads)   the gradient this process contributes, before
                                 any reduce reads it: `grads` are the very
                                 tensors the reduce sums (change them in place)
    the reduce (synchroniser)
    on_reduced(Reduced)          the step's combined gradient (in the model's
                                 .grad), loss and expert loads, before clipping
                                 and the optimizer; a hook may change the
                                 gradients in place or replace `loads` or
                                 `loss` (the step's logged loss)
    on_grads / clip / optimizer step / routing bias / on_step   (train()'s arguments)

A fleet's synchroniser sends a rank's gradient in pieces (buckets, overlapped
with backward; under the exact reduce one contribution per slice), so
`on_local_grads` is called once per piece: `grads` holds the parameters of
that piece, each parameter exactly once per contribution, and `slice` says
which of the step's slices it belongs to (None: the sum of all this
process's slices). A single process calls it once per step (or once per
slice under the exact reduce) with every parameter that has a gradient (a
fleet's piece holds a parameter without one as the zeros it sends). Under
FSDP2 sharding the reduce-scatter runs inside backward and on_local_grads is
not called.

Hooks come from `train(..., hooks=)` and from `install(...)`, which adds
hooks to every train() of this process (instrumentation that cannot reach
the call, e.g. a test's planted fault in a torchrun rank); installed hooks run
first. Nothing here changes training unless a hook does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class LocalGrads:
    """One piece of the gradient this process contributes to a step."""

    step: int  # the step (from 1)
    rank: int  # this process's rank (0 alone)
    slice: int | None  # global index of the slice this piece belongs to (None: all this process's slices)
    grads: dict[str, torch.Tensor]  # parameter name -> the tensor the reduce reads (a view; change in place)
    plan: object  # the step's FleetPlan


@dataclass
class Reduced:
    """The step after the reduce, before clipping and the optimizer."""

    step: int  # the step (from 1)
    rank: int  # this process's rank (0 alone)
    model: torch.nn.Module  # its .grad hold the combined gradient
    loss: float  # the step's global token-weighted loss
    loads: torch.Tensor | None  # the step's global expert loads (a hook may replace them)
    local_loads: torch.Tensor | None  # this process's own slices' loads, before the reduce
    plan: object  # the step's FleetPlan
    local_loss: float | None = None  # this process's share of the loss, sum over its slices of t_i L_i / T


@dataclass
class Hooks:
    """The hooks of one train() call: lists of callables, called in order."""

    on_local_grads: list[Callable[[LocalGrads], None]] = field(default_factory=list)
    on_reduced: list[Callable[[Reduced], None]] = field(default_factory=list)
    on_step: list[Callable[[int, torch.nn.Module, dict], None]] = field(default_factory=list)

    def local_grads(self, piece: LocalGrads) -> None:
        for h in self.on_local_grads:
            h(piece)

    def reduced(self, state: Reduced) -> None:
        for h in self.on_reduced:
            h(state)

    def stepped(self, step: int, model, info: dict) -> None:
        for h in self.on_step:
            h(step, model, info)

    def __add__(self, other: "Hooks") -> "Hooks":
        return Hooks(self.on_local_grads + other.on_local_grads, self.on_reduced + other.on_reduced,
                     self.on_step + other.on_step)


_INSTALLED: list[Hooks] = []


def install(hooks: Hooks) -> Callable[[], None]:
    """Add `hooks` to every train() of this process; returns the function that removes them."""
    _INSTALLED.append(hooks)
    return lambda: _INSTALLED.remove(hooks)


def for_call(given: Hooks | None) -> Hooks:
    """The hooks one train() runs: the installed ones, then the call's own."""
    out = Hooks()
    for h in [*_INSTALLED, given or Hooks()]:
        out = out + h
    return out
