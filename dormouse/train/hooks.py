"""Explicit points where code outside the loop observes or changes a step.

The loop and every synchroniser call them at fixed places of each step
(steps numbered from 1, as `on_step` numbers them):

    on_start(Start)              once, before the first step this call trains
                                 (after any resume: `Start.step` steps are done);
                                 the model is the one the loop calls (sharded
                                 under FSDP2), not yet stepped
    on_batch(Batch)              the step's windows this process read, before
                                 any forward: a hook may replace them
                                 (`Batch.read` reads another step's,
                                 `Batch.read_at` a span from another byte) and
                                 the identities the loop reports for them
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
    on_grads                     (train()'s argument)
    clip (train.grad_clip)
    on_clipped(Clipped)          the gradient the optimizer is about to apply
                                 (clipped; as reduced when clipping is off)
    optimizer step / routing bias / on_step
    on_eval(Evaluated)           at an eval step, the held-out loss before it is
                                 logged and reported (a hook may replace `loss`)
    on_saved(Saved)              at a checkpoint step, after every rank's part of
                                 the checkpoint is written
    on_end(report)               once, after the last step, with train()'s report
                                 (every rank reaches it: a hook may synchronise)

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

from dataclasses import dataclass, field, fields
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
    examples: list[int] | None = None  # where each window this process read starts in the corpus (their identities)
    epoch: int | None = None  # the data's epoch this step belongs to (data.py: each whole span once an epoch)
    routes: list | None = None  # this process's tokens' expert choices: per forward, per iteration (B, T, k)


@dataclass
class Clipped:
    """The step after clipping, just before the optimizer applies the model's .grad."""

    step: int  # the step (from 1)
    rank: int  # this process's rank (0 alone)
    model: torch.nn.Module  # its .grad hold the gradient the optimizer applies
    clip_coef: float  # what clipping multiplied the gradient by (1.0: clipping off or not binding)
    grad_norm: float | None  # the global norm clipping computed (None: clipping off)


@dataclass
class Batch:
    """The windows this process computes at a step, before any forward."""

    step: int  # the step (from 1)
    rank: int  # this process's rank (0 alone)
    batches: list  # (x, y) per group of slices this process computes, in its order (a hook may replace it)
    windows: list[int]  # where each window starts in the corpus: the identities Reduced.examples reports
    read: Callable[[int], list]  # read(k): the batches this process would read at step k (from 1)
    read_at: Callable[[int], tuple[list, list[int]]]  # read_at(start): (batches, windows) of a span at byte start


@dataclass
class Evaluated:
    """An eval of the held-out tail after a step."""

    step: int  # the step just done (from 1)
    rank: int  # this process's rank (0 alone)
    loss: float  # the token-mean held-out loss (a hook may replace it)


@dataclass
class Saved:
    """A checkpoint the loop has just written (every rank calls it: a hook may synchronise)."""

    step: int  # the steps the checkpoint holds (from 1)
    rank: int  # this process's rank (0 alone)
    path: object  # the checkpoint: a file, or a folder of shards under FSDP2 (train/checkpoint.py)
    peers: object  # the run's synchroniser (barrier(), is_main)


@dataclass
class Start:
    """The run as train() is about to step it."""

    step: int  # steps already done (0 fresh; the checkpoint's step when resumed)
    rank: int  # this process's rank (0 alone)
    world: int  # processes in the fleet (1 alone)
    model: torch.nn.Module  # the module the loop calls (an FSDP2 module under sharding)
    run: object  # the RunConfig being trained
    plan: object  # the steps' FleetPlan


@dataclass
class Hooks:
    """The hooks of one train() call: lists of callables, called in order."""

    on_local_grads: list[Callable[[LocalGrads], None]] = field(default_factory=list)
    on_reduced: list[Callable[[Reduced], None]] = field(default_factory=list)
    on_step: list[Callable[[int, torch.nn.Module, dict], None]] = field(default_factory=list)
    on_start: list[Callable[[Start], None]] = field(default_factory=list)
    on_end: list[Callable[[dict], None]] = field(default_factory=list)
    on_clipped: list[Callable[[Clipped], None]] = field(default_factory=list)
    on_batch: list[Callable[[Batch], None]] = field(default_factory=list)
    on_eval: list[Callable[[Evaluated], None]] = field(default_factory=list)
    on_saved: list[Callable[[Saved], None]] = field(default_factory=list)

    def batch(self, state: Batch) -> None:
        for h in self.on_batch:
            h(state)

    def evaluated(self, state: Evaluated) -> None:
        for h in self.on_eval:
            h(state)

    def saved(self, state: Saved) -> None:
        for h in self.on_saved:
            h(state)

    def clipped(self, state: Clipped) -> None:
        for h in self.on_clipped:
            h(state)

    def started(self, state: Start) -> None:
        for h in self.on_start:
            h(state)

    def ended(self, report: dict) -> None:
        for h in self.on_end:
            h(report)

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
        return Hooks(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(Hooks)})


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
