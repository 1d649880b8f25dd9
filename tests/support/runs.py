"""A RunConfig for the train-side fleet tests (tests/train/test_exact.py and its rank
scripts): the gate fixture's network, corpus and recipe, at a given batch, with
a checkpoint at the end of every run (named `name`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dormouse.config import RunConfig
from dormouse.gate import fixtures
from dormouse.gate.settings import GateSettings


def make_run(out: Path, *, steps: int, batch: int, profile: str = "", dist: bool = False, lr: float = 1e-3,
             reduce: str = "fp32", resume_from: str = "", name: str = "gate") -> RunConfig:
    """`batch` is the per-rank batch of a fleet (dist) and the global batch of one process."""
    s = GateSettings(out=str(out), steps=steps, batch=batch, world=len(profile.split(",")) if profile else 1,
                     profile=profile, lr=lr, resume_world=0)
    run = fixtures.make_run(s, name=name, dist=dist, resume_from=resume_from, reduce=reduce)
    run.train = dataclasses.replace(run.train, ckpt_every=10_000)
    return run
