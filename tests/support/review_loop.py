"""The reviewer's plain DDP loop (tests/gate/test_recorder_review.py): the loop
of ddp_loop.py (loopmodel's TinyLM, GA over padded variable-length rows,
AdamW + LambdaLR, clipping) with faults that ddp_loop.py does not plant,
selected by each run's "fault" through the explicit hooks below. Run under
torchrun (gloo): `torchrun --nproc_per_node=2 review_loop.py --plan PLAN.json`.

  clean          the global token mean (loss_sum * W / N_global)
  rank1_eps      rank 1 scales its loss by 1 + eps (cfg "eps")
  bias_x2        after the all-reduce, one small tensor's gradient (ln1.bias) doubled on every rank
  bias_eps       ... ln1.bias's gradient scaled by 1 + eps (cfg "eps") on every rank
  row_x2         after the all-reduce, one row of tok.weight's gradient doubled on every rank
  no_shift       the loop's loss compares logits with UNshifted labels (objective declared causal_lm)
  double_shift   ... with labels shifted by two
  sched_twice    the scheduler stepped twice per optimizer step
  wd_wrong       the loop's optimizer has weight decay x1.001 (build_optimizer's not)
  fwd_no_bwd     the last micro-batch is forwarded but its loss is never backpropagated
  late_x15       at step 2 only, every rank scales its loss by 1.5 (non-tensor step when every > 1)
  dup_data       a clean loop over a dataset with duplicate rows (data[2j+1] == data[2j])
  nograd_log     a clean loop that also runs a no_grad forward in train mode to log a probe loss
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopmodel import VOCAB, build_model, build_optimizer, collate, dataset  # noqa: E402

from dormouse.gate import Recorder  # noqa: E402

RUN = {"out": "", "fault": "clean", "seed": 0, "steps": 4, "micro": 3, "batch": 2, "n": 48,
       "max_grad_norm": 1.0, "sketch": 0, "every": 1, "lr": 1e-2, "eps": 0.0, "drop_last": True,
       "ids": False, "epoch": False}  # ids / epoch: pass rec.step(example_ids=...) / rec.step(epoch=...)


def shift_of(fault: str) -> int:
    return {"no_shift": 0, "double_shift": 2}.get(fault, 1)


def scale_of(fault: str, rank: int, step: int, eps: float) -> float:
    if fault == "rank1_eps" and rank == 1:
        return 1.0 + eps
    if fault == "late_x15" and step == 2:
        return 1.5
    return 1.0


def after_sync(fault: str, model, eps: float) -> None:
    if fault == "bias_x2":
        model.ln1.bias.grad *= 2
    if fault == "bias_eps":
        model.ln1.bias.grad *= 1 + eps
    if fault == "row_x2":
        model.tok.weight.grad[3] *= 2


def data_of(fault: str, n: int, seed: int):
    d = dataset(n, seed)
    if fault == "dup_data":
        d = [d[2 * (i // 2)] for i in range(n)]
    return d


def run(cfg: dict) -> None:
    cfg = {**RUN, **cfg}
    world, rank = dist.get_world_size(), dist.get_rank()
    fault, K, B, n, mgn = cfg["fault"], cfg["micro"], cfg["batch"], cfg["n"], cfg["max_grad_norm"]
    kw = {"seed": cfg["seed"], "lr": cfg["lr"]}
    model = build_model(**kw)
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt, sched = build_optimizer(model, **kw)
    if fault == "wd_wrong":
        for g in opt.param_groups:
            g["weight_decay"] *= 1.001
    rec = Recorder(cfg["out"], net, build_model="loopmodel:build_model", build_optimizer="loopmodel:build_optimizer",
                   objective="causal_lm", max_grad_norm=mgn, dataset_len=n, build_kwargs=kw,
                   sketch=cfg["sketch"], every=cfg["every"])
    data = data_of(fault, n, cfg["seed"])
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                                                  seed=cfg["seed"], drop_last=True)
    per_epoch = len(sampler) // (K * B)  # a DataLoader with drop_last=True
    sh = shift_of(fault)
    for s in range(cfg["steps"]):
        epoch, j = divmod(s, per_epoch)
        sampler.set_epoch(epoch)
        idx = list(sampler)[j * K * B:(j + 1) * K * B]
        mbs = [collate([data[i] for i in idx[m * B:(m + 1) * B]]) for m in range(K)]
        counts = [int((mb["labels"][:, sh:] != -100).sum()) for mb in mbs]
        n_global = torch.tensor(sum(counts))
        dist.all_reduce(n_global)
        n_global = int(n_global)
        local_sum = torch.zeros(())
        c = scale_of(fault, rank, s + 1, cfg["eps"])
        for m, mb in enumerate(mbs):
            last = m == K - 1
            ctx = net.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                logits = net(**mb)
                T = logits.shape[1]
                loss_sum = F.cross_entropy(logits[:, :T - sh].reshape(-1, VOCAB),
                                           mb["labels"][:, sh:].reshape(-1), ignore_index=-100, reduction="sum")
                if not (fault == "fwd_no_bwd" and last):
                    (loss_sum * world / n_global * c).backward()
                elif last:  # the last micro-batch's backward is lost, but DDP must still sync: a zero backward
                    (logits.sum() * 0).backward()
            local_sum += loss_sum.detach()
        if fault == "nograd_log":
            with torch.no_grad():
                net(**mbs[0])
        reported = local_sum.clone()
        dist.all_reduce(reported)
        reported = reported / n_global
        after_sync(fault, model, cfg["eps"])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), mgn) if mgn else None
        rec.step(loss=reported, optimizer=opt, grad_norm=norm, example_ids=torch.tensor(idx) if cfg["ids"] else None,
                 epoch=epoch if cfg["epoch"] else None)
        opt.step()
        sched.step()
        if fault == "sched_twice":
            sched.step()
        opt.zero_grad(set_to_none=True)
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
