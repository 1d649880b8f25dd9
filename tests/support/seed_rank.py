"""One rank of the seed's fleet (`--mode rank`), run by tests/test_distributed.py
under `python -m torch.distributed.run --standalone --nproc_per_node=2`:
train_dist exactly as the seed calls it, keeping the parameters after step 1
(for the hand-computed step) and at the end, and the logged losses.

    seed_rank.py OUT STEPS CAPACITY"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dormouse.train.distributed import train_dist
from seed_fleet import build, make_run

out, steps, capacity = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
run = make_run(out, steps=steps, batch=2, capacity=capacity, dist=True)
model = build()  # seeded before train_dist joins the fleet: every rank builds the same model
after: dict[int, list[torch.Tensor]] = {}
lines: list[str] = []


def keep_first_step(step: int, m, info) -> None:
    if step == 1:
        after[1] = [p.detach().clone() for p in m.parameters()]


report = train_dist(run, log=lines.append, device_type="cpu", model=model, close=False, on_step=keep_first_step)
losses = [float(m.group(1)) for line in lines if not line.startswith("eval ")
          for m in [re.search(r"\bloss=([-0-9.eE+]+)", line)] if m]
torch.save({"rank": report["rank"], "world_size": report["world_size"], "losses": losses,
            "step1": after[1], "final": [p.detach().clone() for p in model.parameters()]},
           out / f"rank{report['rank']}.pt")
dist.destroy_process_group()
