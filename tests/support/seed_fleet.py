"""The seed's driver, in the parts tests/test_distributed.py shares with its
rank script: the tiny network (the seed's TINY), its corpus, its RunConfig
and its init, through the public API exactly as the seed's
`tools/dist_gate.py` builds them."""

from __future__ import annotations

from pathlib import Path

import torch

from dormouse.config import ModelConfig, RunConfig, TrainConfig
from dormouse.model import DormouseModel

TINY = dict(
    d_model=64, n_heads=4, head_dim=16, d_ffn=128, vocab=256, max_seq_len=64, max_iter=2, rank=8,
    n_experts=4, moe_topk=2, engram_rows=64, engram_dim=8, bf16=False, shared_rank=16,
    moe_capacity=0.0,  # dropless: refuse_incompatible refuses a capacity-dropping MoE in a fleet
)
SEQ = 64
LR = 1e-3  # the seed's: low enough that 20 steps are not chaotic
SEED = 7


def write_corpus(path: Path, n_bytes: int = 4096, cycle: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(range(cycle)) * (n_bytes // cycle + 1))
    return path


def make_run(out: Path, *, steps: int, batch: int, capacity: str = "", dist: bool = False) -> RunConfig:
    """The seed's make_run: TrainConfig's defaults but for these fields (the
    data order among the defaults: that is what the seed relies on)."""
    cfg = TrainConfig(
        steps=steps, batch=batch, seq_len=SEQ, lr=LR, log_every=1, ckpt_every=10_000, ckpt_name="gate",
        out_dir=str(out / "ckpts"), data=str(write_corpus(out / "corpus.bin")), dist=dist,
        dist_capacity=capacity, dist_reduce="fp32", dist_shard="none", opt="mix",
    )
    return RunConfig(source="dist-gate", model=ModelConfig(**TINY), train=cfg)


def build(seed: int = SEED) -> DormouseModel:
    """The one init every mode shares: same seed, same model, same order."""
    torch.manual_seed(seed)
    return DormouseModel(ModelConfig(**TINY))
