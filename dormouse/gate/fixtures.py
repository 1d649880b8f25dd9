"""The gate's fixtures: the tiny model, its corpus and the run every mode shares.

The corpus is written into the out dir, so modes run on different machines
(the single reference here, a fleet on a GPU box) compare the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dormouse import atomic
from dormouse.config import ModelConfig, RunConfig, TrainConfig
from dormouse.model import DormouseModel
from dormouse.train.data import RankShape
from dormouse.train.distributed import parse_capacity

TINY = dict(
    d_model=64, n_heads=4, head_dim=16, d_ffn=128, vocab=256, max_seq_len=64,
    max_iter=2, rank=8, n_experts=4, moe_topk=2, engram_rows=64, engram_dim=8,
    bf16=False, shared_rank=16,
    # DROPLESS (0): a capacity-dropping MoE drops assignments by a rule that
    # depends on the window's composition, so a fleet's split window is a
    # different network. refuse_incompatible makes this a loud requirement of
    # every distributed run, not a test-only tweak.
    moe_capacity=0.0,
)
SEQ = 64
STEPS = 20
# Low enough that the 20-step trajectory is not chaotic: at this lr the
# fleet/reference divergence is float round-off, amplified only when a token's
# expert choice flips; at lr 1e-2 round-off grows to percent level in 20 steps.
LR = 1e-3
WORLD = 2


def write_corpus(path: Path, n_bytes: int = 4096, cycle: int = 16) -> Path:
    """The cyclic corpus 0, 1, ..., cycle-1, 0, 1, ... (written atomically, and
    only when different, so concurrent modes never see a torn file)."""
    return atomic.write_if_changed(path, bytes(range(cycle)) * (n_bytes // cycle + 1))


def rank_shapes(capacity: str, *, world: int, batch: int) -> list[RankShape]:
    """The fleet's shape per rank for a capacity profile at the fixture's
    window length and model (parse_capacity: FleetError when malformed)."""
    return parse_capacity(capacity, world_size=world, cfg=TrainConfig(batch=batch, seq_len=SEQ),
                          max_seq_len=TINY["max_seq_len"])


def single_batch(shapes: list[RankShape]) -> int | None:
    """The single process's batch that reads exactly these ranks' bytes, or
    None when they mix window lengths (no one batch of SEQ windows holds them)."""
    if any(sh.seq_len != SEQ for sh in shapes):
        return None
    return sum(sh.batch for sh in shapes)


def make_run(
    out: Path, *, steps: int, batch: int, capacity: str = "", dist: bool = False, lr: float = LR,
    shard: str = "none", opt: str = "mix", reduce: str = "fp32", name: str = "gate", resume_from: str = "",
    bucket_mb: float = 4.0,
) -> RunConfig:
    """The gate's run. `name` keeps each mode's checkpoint and metrics apart."""
    out = Path(out)
    cfg = TrainConfig(
        steps=steps, batch=batch, seq_len=SEQ, lr=lr, log_every=1,
        ckpt_every=10_000, ckpt_name=name, out_dir=str(out / "ckpts"),
        data=str(write_corpus(out / "corpus.bin")),
        dist=dist, dist_capacity=capacity,
        dist_reduce=reduce,  # fp32 is the exact reference; bf16 has its own bound
        dist_shard=shard, opt=opt, resume_from=resume_from, dist_bucket_mb=bucket_mb,
        warmup=0, schedule="constant", grad_clip=0.0,  # gradref applies one plain step
        # Newton-Schulz in float32, not torch's bfloat16: the quintic iteration
        # multiplies directions of small singular value by up to 3.4^5 ~ 480,
        # so a float32 round-off difference of 3e-7 in a gradient that happens
        # to flip one bfloat16 rounding moved an expert's update by 9% in one
        # element (measured: 6.6e-4 relative in the post-step parameters).
        # In float32 the same gradients give 2e-7. The gate is there to see
        # the fleet's mathematics, not the bf16 noise of the reference.
        ns_dtype="float32",
    )
    return RunConfig(source="dist-gate", model=ModelConfig(**TINY), train=cfg)


def build(seed: int) -> DormouseModel:
    """The one init every mode shares: same seed, same model, same order."""
    torch.manual_seed(seed)
    return DormouseModel(ModelConfig(**TINY))
