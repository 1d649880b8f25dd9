"""A researcher's plain data-parallel loop, recorded for the gate: DDP (or
FSDP2) with gradient accumulation over variable-length padded sequences,
AdamW with an lr schedule, clipping, checkpoint and resume. Run under torchrun
(gloo): `torchrun --standalone --nproc_per_node=2 ddp_loop.py --plan PLAN.json`
where PLAN is a JSON list of runs, each a dict (see RUN), run one after another
in the same process group.

The gate's lines are the three `rec.` calls. Faults enter through the explicit
hooks below (`loss_of`, `reported_of`, ...) selected by each run's "fault":
  clean            the global token mean: loss_sum * W / N_global (DDP averages over ranks)
  micro_mean       the mean of per-micro-batch token means (HF, 2024)
  comp_twice       world-size compensation applied twice (loss * W * W / N)
  comp_none        ... and not at all (loss / N)
  local_count      each rank normalises by its own token count
  same_data        every rank reads the same data (no DistributedSampler)
  bn               BatchNorm without SyncBN
  dropout          dropout active, each rank its own RNG
  clip_local       clipping by each rank's local norm (before a hand-written all-reduce)
  unused_zero      zero gradients written for an unused parameter, with weight decay
  resume_drop_sched  the resume drops the lr scheduler's state
  loss_rank_mean   the logged loss is a mean of rank means (the gradient is right)
  resume_data      the resume restarts the epoch's data order from its beginning
  rank_lr          rank 1's optimizer has another lr (the ranks drift apart)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopmodel import VOCAB, build_model, build_optimizer, collate, dataset  # noqa: E402

from dormouse.gate import Recorder  # noqa: E402

RUN = {"out": "", "fault": "clean", "seed": 0, "steps": 6, "stop_at": 0, "leg": 0, "fsdp": False,
       "micro": 3, "batch": 2, "n": 48, "max_grad_norm": 1.0, "sketch": 0, "every": 1}


def loss_of(fault: str, loss_sum, n_mb, n_local, n_global, world: int, micro: int):
    """The loss each micro-batch backpropagates (DDP/FSDP2 then AVERAGE over ranks)."""
    if fault == "micro_mean":
        return loss_sum / n_mb / micro
    if fault == "comp_twice":
        return loss_sum * world * world / n_global
    if fault == "comp_none":
        return loss_sum / n_global
    if fault == "local_count":
        return loss_sum / n_local
    return loss_sum * world / n_global


def reported_of(fault: str, local_sum, n_local, n_global, world: int):
    """The loss the loop logs."""
    if fault == "loss_rank_mean":
        x = (local_sum / n_local).clone()
        dist.all_reduce(x)
        return x / world
    x = local_sum.clone()
    dist.all_reduce(x)
    return x / n_global


def order_of(fault: str, n: int, world: int, rank: int, seed: int, epoch: int) -> list[int]:
    """This rank's example order in `epoch`."""
    if fault == "same_data":
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7 + epoch)).tolist()
    s = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                            drop_last=True)
    s.set_epoch(epoch)
    return list(s)


def run(cfg: dict) -> None:
    cfg = {**RUN, **cfg}
    world, rank = dist.get_world_size(), dist.get_rank()
    fault, K, B, n, mgn = cfg["fault"], cfg["micro"], cfg["batch"], cfg["n"], cfg["max_grad_norm"]
    out = Path(cfg["out"])
    kw = {"seed": cfg["seed"], "bn": fault == "bn", "dropout": 0.1 if fault == "dropout" else 0.0,
          "unused": fault == "unused_zero"}
    model = build_model(**kw)
    if cfg["fsdp"]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=kw["unused"])
    opt, sched = build_optimizer(model, **kw)
    start, stop = 0, cfg["steps"]
    if cfg["leg"] == 1:
        stop = cfg["stop_at"]
    elif cfg["leg"] == 2:
        ck = torch.load(out / "ckpt.pt", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        if fault != "resume_drop_sched":
            sched.load_state_dict(ck["sched"])
        start = ck["step"]
    if fault == "dropout":
        torch.manual_seed(1234 + rank)
    if fault == "rank_lr" and rank == 1:
        for group in opt.param_groups:
            group["lr"] *= 1.01
    rec = Recorder(out, net, build_model="loopmodel:build_model", build_optimizer="loopmodel:build_optimizer",
                   objective="causal_lm", max_grad_norm=mgn, dataset_len=n, build_kwargs=kw,
                   sketch=cfg["sketch"], every=cfg["every"], resume=start if cfg["leg"] == 2 else False)
    data = dataset(n, cfg["seed"])
    per_epoch = n // (world * K * B)
    for s in range(start, stop):
        epoch, j = divmod(s - start if fault == "resume_data" else s, per_epoch)
        idx = order_of(fault, n, world, rank, cfg["seed"], epoch)[j * K * B:(j + 1) * K * B]
        mbs = [collate([data[i] for i in idx[m * B:(m + 1) * B]]) for m in range(K)]
        counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs]
        n_local = sum(counts)
        n_global = torch.tensor(n_local)
        dist.all_reduce(n_global)
        n_global = int(n_global)
        manual = fault == "clip_local"
        local_sum = torch.zeros(())
        for m, mb in enumerate(mbs):
            last = m == K - 1
            if cfg["fsdp"]:
                model.set_requires_gradient_sync(last)
                ctx = contextlib.nullcontext()
            else:
                ctx = net.no_sync() if (manual or not last) else contextlib.nullcontext()
            with ctx:
                logits = net(**mb)
                loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), mb["labels"][:, 1:].reshape(-1),
                                           ignore_index=-100, reduction="sum")
                loss_of(fault, loss_sum, counts[m], n_local, n_global, world, K).backward()
            local_sum += loss_sum.detach()
        reported = reported_of(fault, local_sum, n_local, n_global, world)
        norm = None
        if manual:  # clip this rank's own gradient by its own norm, then all-reduce by hand
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), mgn)
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        elif mgn:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), mgn)
        if fault == "unused_zero":
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        rec.step(loss=reported, optimizer=opt, grad_norm=norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    if cfg["leg"] == 1 and rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "step": stop}, out / "ckpt.pt")
    rec.close()
    dist.barrier()
    del net, model, opt
    gc.collect()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True, help="a JSON list of runs (see RUN)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for cfg in json.loads(Path(args.plan).read_text()):
            run(cfg)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
