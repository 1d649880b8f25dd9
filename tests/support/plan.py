"""The main of every client loop a test launches under torchrun (ddp_loop, batch_loop, tp_loop,
pp_loop, ep_loop, titan_loop): one gloo process group, every run of the `--plan` file (a JSON list,
the same on every rank) in order, each run's objects collected and a barrier after each, and the
group destroyed at the end whatever happened."""

from __future__ import annotations

import argparse
import gc
import json
import sys
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
            gc.collect()  # the run's model, optimizer and Recorder gone before the next run builds its own
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def runs_main(one: Callable[[dict, Path], None], parse: Callable[[str], dict], description: str,
              argv: list[str] | None = None) -> int:
    """The main of a framework client (lightning_client, trl_client): `--out DIR RUN...`, each RUN text
    parsed and run in order (the framework initialises the process group itself); a DormouseError is one
    line on stderr and exit 2; the group, if any, destroyed at the end."""
    from dormouse.errors import DormouseError

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("runs", nargs="+")
    a = p.parse_args(argv)
    rc = 0
    for text in a.runs:
        try:
            one(parse(text), a.out)
        except DormouseError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            rc = 2
            break
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return rc
