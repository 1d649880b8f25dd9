"""One process's training, timed: THE loop, dormouse.train.loop.train(),
driven by Stepper and split into parts at its hooks by StepClock."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Callable

import torch

from dormouse.config import RunConfig, TrainConfig, preset

SHAPES = {"tiny": (4, 64), "small": (8, 256)}  # (batch, seq_len) of each preset's bench step


class StepClock:
    """Times the steps of dormouse.train.loop.train() through its hooks
    (dormouse.train.hooks), never through a copy of the step. For step k,
    with t(on_step of k-1) its start (the previous step's end):

        compute   = t(first on_local_grads of k) - t(on_step of k-1)
                    (lr, zero_grad, the step's bytes, every slice's forward and backward)
        reduce    = t(on_reduced of k) - t(first on_local_grads of k)     (the synchroniser's reduce)
        optimizer = t(on_step of k) - t(on_reduced of k)
                    (on_grads, clipping, the optimizer step, the routing bias)
        step      = compute + reduce + optimizer

    The first step of a train() call has no previous on_step: it is not timed
    (it also builds the optimizer's state). Under FSDP2 on_local_grads is not
    called: compute then holds the reduce."""

    def __init__(self):
        self.steps: list[float] = []
        self.parts: dict[str, list[float]] = {"compute": [], "reduce": [], "optimizer": []}
        self._end: float | None = None  # the previous step's on_step
        self._local: float | None = None
        self._reduced: float | None = None

    def hooks(self, *also: Callable[[int, object, dict], None]):
        """The hooks for one train() call; `also`: more on_step callables, called after the clock's stamp."""
        from dormouse.train.hooks import Hooks

        self._end = self._local = self._reduced = None
        return Hooks(on_local_grads=[self._on_local], on_reduced=[self._on_reduced], on_step=[self._on_step, *also])

    def _on_local(self, piece) -> None:
        if self._local is None:
            self._local = time.perf_counter()

    def _on_reduced(self, state) -> None:
        self._reduced = time.perf_counter()

    def _on_step(self, step, model, info) -> None:
        now = time.perf_counter()
        if self._end is not None:
            local = self._local if self._local is not None else self._reduced
            self.steps.append(now - self._end)
            self.parts["compute"].append(local - self._end)
            self.parts["reduce"].append(self._reduced - local)
            self.parts["optimizer"].append(now - self._reduced)
        self._end, self._local, self._reduced = now, None, None


class Stepper:
    """One process's training on one preset, timed: every step is a step of
    THE loop, dormouse.train.loop.train() with LocalSync on the built-in
    corpus, timed by a StepClock through train()'s hooks. The model persists
    across calls (built once by build_model); each call is one train() of
    one untimed warm-up step and `n` timed steps (a fresh MixOptimizer from
    make_optimizer, as every train() makes). TrainConfig's defaults but for
    batch, seq_len, seed and `train`; no eval, no checkpoint, no log lines."""

    def __init__(self, name: str, batch: int, seq_len: int, seed: int = 0, *, device: str = "cpu",
                 bf16: bool = False, **train):
        from dormouse.train.loop import build_model

        self.name, self.batch, self.seq_len = name, batch, seq_len
        self._dir = tempfile.TemporaryDirectory(prefix=f"dormouse-bench-{name}-")
        self.run = RunConfig(source="bench", model=dataclasses.replace(preset(name), bf16=bf16), train=TrainConfig(
            seed=seed, batch=batch, seq_len=seq_len, steps=2, log_every=10**6, eval_every=0, ckpt_every=0,
            out_dir=self._dir.name, **train)).validate()
        self.model = build_model(self.run).to(device)  # train() casts to bf16 itself (model.bf16)
        self.clock = StepClock()
        self.losses: list[float] = []
        self.ns_kernel = ns_kernel(self.run.train)  # what the optimizer of every train() call runs

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def opt_s(self) -> list[float]:
        """Seconds of each timed step's optimizer part (clip, optimizer.step, routing bias)."""
        return self.clock.parts["optimizer"]

    def train(self, n: int, *also) -> list[float]:
        """One train() of 1 + n steps; returns the n timed steps' seconds."""
        from dormouse.train.loop import train

        run = dataclasses.replace(self.run, train=dataclasses.replace(self.run.train, steps=1 + n))
        before = len(self.clock.steps)
        report = train(self.model, run, log=lambda line: None, hooks=self.clock.hooks(*also))
        self.losses += report["losses"]
        return self.clock.steps[before:]

    def warm(self) -> None:
        """One untimed step."""
        self.train(0)

    def timed(self, n: int) -> list[float]:
        return self.train(n)


def ns_kernel(t: TrainConfig) -> str:
    """The Newton-Schulz kernel MixOptimizer resolves t.ns_kernel to here ("auto" included)."""
    from dormouse.train.newton_schulz import resolve_kernel

    return resolve_kernel(t.ns_kernel, {"float32": torch.float32, "bfloat16": torch.bfloat16}[t.ns_dtype])
