"""The gate's fixtures: the network, the corpus and the run every mode shares.

The default network is the `tiny` preset (config.PRESETS: d_model 64, 4
experts top-2, adapters of rank 8, shared expert of rank 16, Engram 64 x 8,
the block applied twice, dropless MoE). `GateSettings.preset` swaps in any
preset, `GateSettings.config` a RunConfig JSON written by `dormouse train`.

The run turns on the code where data-parallel bugs live: linear warm-up, a
cosine schedule, decoupled weight decay, gradient clipping (its coefficient is
recorded per step), periodic eval on a held-out tail, and a seeded shuffled
data order whose epochs wrap around the corpus within one gate run.

The corpus is seeded pseudo-random bytes (no window repeats, so a fleet that
reads the wrong span reads different bytes) of a length that is no multiple of
the span (so the run crosses the wrap to the corpus's start), written into the
out dir so modes run on different machines compare the same bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from dormouse import atomic
from dormouse.config import RunConfig, TrainConfig, preset
from dormouse.errors import ConfigError
from dormouse.train.plan import FleetPlan

if TYPE_CHECKING:
    from dormouse.model import DormouseModel

TINY = preset("tiny")  # THE gate fixture's network (config.PRESETS["tiny"])
SEQ = 64  # window length of the fixture (and of a preset, capped by its max_seq_len)
# Low enough that a 20-step trajectory is not chaotic: round-off between the
# fleet and the reference stays at the floor unless a token's expert choice
# flips; at lr 1e-2 round-off grows to percent level in 20 steps.
LR = 1e-3
CORPUS_SEED = 20261130  # the fixture corpus's bytes: torch.Generator seeded with this
CORPUS_MIN_BYTES = 6007  # prime: never a multiple of a span
EVAL_FRAC = 0.1  # held-out tail of the fixture corpus (eval every EVAL_EVERY steps)
EVAL_EVERY = 5
RECIPE = dict(
    warmup=3, schedule="cosine", min_lr_frac=0.1, wd=0.01,
    # Clips at most steps of the tiny fixture at lr 1e-3 (the coefficient is
    # recorded at every step): the clip code path runs in every gate.
    grad_clip=0.05,
    # Newton-Schulz in float32, not torch's bfloat16: the quintic iteration
    # multiplies directions of small singular value by up to 3.4^5 ~ 480, so a
    # float32 round-off difference of 3e-7 in a gradient that flips one
    # bfloat16 rounding moved an expert's update by 9% in one element
    # (measured). The gate is there to see the fleet's mathematics.
    ns_dtype="float32",
)


def base_run(s) -> RunConfig:
    """The network and recipe the settings name (before the gate's own fields)."""
    if not s.config:
        model = preset(s.preset) if s.preset else dataclasses.replace(TINY)
        return RunConfig(source=f"preset:{s.preset}" if s.preset else "dist-gate", model=model,
                         train=TrainConfig(lr=LR, eval_every=EVAL_EVERY, eval_frac=EVAL_FRAC, **RECIPE))
    path = Path(s.config).expanduser()
    try:
        return RunConfig.from_json(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"config {s.config!r} is not a readable RunConfig JSON ({e})") from None


def window(s) -> int:
    """The fixture's window length for settings `s`."""
    run = base_run(s)
    return run.train.seq_len if s.config else min(SEQ, run.model.max_seq_len)


def fleet_plan(s) -> FleetPlan:
    """The fleet's plan for settings `s` (FleetPlan.make: PlanError when the
    profile or micro-batch is malformed)."""
    return FleetPlan.make(s.profile, world=s.world, batch=s.batch, seq_len=window(s), micro_batch=s.micro_batch,
                          max_seq_len=base_run(s).model.max_seq_len)


def corpus_bytes(span: int) -> bytes:
    """Seeded pseudo-random bytes, at least three spans (plus the eval tail)
    and never a whole number of spans."""
    n = max(CORPUS_MIN_BYTES, int(3 * span / (1 - EVAL_FRAC)) + 101)
    if n % span == 0:
        n += 1
    import torch

    g = torch.Generator().manual_seed(CORPUS_SEED)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes()


def corpus_path(s, *, write: bool = True) -> Path:
    """The corpus of a gate run: the user's file, or the fixture's written into
    out (`write=False`: only its path, for checking settings)."""
    if s.data:
        return Path(s.data).expanduser().resolve()
    if not write:
        return s.out_dir / "corpus.bin"
    span = s.plan.span
    return atomic.write_if_changed(s.out_dir / "corpus.bin", corpus_bytes(span))


def make_run(s, *, name: str, dist: bool, steps: int | None = None, resume_from: str = "",
             reduce: str | None = None, micro_batch: int | None = None, write_corpus: bool = True) -> RunConfig:
    """The RunConfig of one gate mode. The gate's settings override the base
    run's seed, steps, batch and fleet fields; `name` keeps each mode's
    checkpoints and metrics apart. The single process runs at the global batch."""
    base = base_run(s)
    plan = s.plan
    batch = s.batch if dist else plan.windows
    over = dict(
        seed=s.seed, steps=steps or s.steps, batch=batch, seq_len=plan.shapes[0].seq_len,
        lr=s.lr or base.train.lr, opt=s.opt, log_every=1, ckpt_every=0, ckpt_name=name,
        out_dir=str(s.out_dir / "ckpts"), data=str(corpus_path(s, write=write_corpus)), resume=False, resume_from=resume_from,
        dist=dist, dist_profile=plan.profile if dist else "", dist_reduce=reduce or s.reduce,
        dist_shard=s.shard if dist else "none", dist_bucket_mb=s.bucket_mb, data_order=s.data_order,
    )
    if hasattr(base.train, "micro_batch"):
        over["micro_batch"] = s.micro_batch if micro_batch is None else micro_batch
    if not dist and over["dist_reduce"] != "exact":
        over["dist_reduce"] = "fp32"
    return RunConfig(source=base.source, model=base.model, train=dataclasses.replace(base.train, **over))


def build(run: RunConfig) -> DormouseModel:
    """The one init every mode shares: the run's network seeded by its
    train.seed (the settings' seed), same order, and cast to bfloat16 when the
    configuration trains in it (model.bf16): every mode builds and casts its
    model itself, the fleet's ranks included."""
    import torch

    from dormouse.model import DormouseModel

    torch.manual_seed(run.train.seed)
    model = DormouseModel(run.model)
    return model.to(torch.bfloat16) if run.model.bf16 else model
