"""The main of every client loop a test launches under torchrun (ddp_loop, batch_loop, tp_loop,
pp_loop, ep_loop): one gloo process group, every run of the `--plan` file (a JSON list, the same on
every rank) in order with a barrier after each, and the group destroyed at the end whatever happened."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


def main(run: Callable[[dict], None]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True, help="a JSON list of runs (see the loop's RUN)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for cfg in json.loads(Path(args.plan).read_text()):
            run(cfg)
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0
