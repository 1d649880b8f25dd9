"""A researcher's plain DDP loop whose objective is more than a sum over rows,
recorded for the gate (tests/gate/catches/test_batch_level_objectives.py). Run under
torchrun (gloo): `torchrun --standalone --nproc_per_node=2 batch_loop.py --plan PLAN.json`,
PLAN a JSON list of runs (see RUN), one after another in one process group.

kind "moe"     batchmodels.MoELM: next-token cross-entropy + ALPHA x a load-balancing term
               stats "local":  over each forward's own routing statistics (what HF's MoE models do)
               stats "global": over the step's statistics, all-reduced across ranks with autograd
                               (torch.distributed.nn.functional.all_reduce; one micro-batch a rank)
kind "pair"    batchmodels.PairEncoder: in-batch contrastive loss, the negatives every rank's positives
               (torch.distributed.nn.functional.all_gather, with autograd; one micro-batch a rank)
kind "switch"  batchmodels.SwitchLM, next-token cross-entropy (objective causal_lm), with knobs:
               "flip"     the loop passes flip=True (a bool keyword) to micro-batch 0's forward ("rank1": on
                          rank 1 alone, a branch one rank switches)
               "attrs"    the loop sets model.mix.on = True before the Recorder, and mix.gain = 2.0
                          ("rank1": mix.gain = 2.0 on rank 1 alone, from step 1 on)
                          from step 2 on
               "labels"   "model": none (the loss reads the input ids); "rec": the loss's labels mask
                          each row's first 3 positions (-100) and the loop gives them with rec.labels;
                          "unrecorded": the same labels, not given to the Recorder
               "compile"  None, or where torch.compile goes (backend "eager": dynamo traces the module and
                          its hooks as under any backend, without a C++ compiler's minutes):
                          "outer" compile(DDP(m)); "inner" DDP(compile(m)); "block" m.mix.compile();
                          "given" DDP(compile(m)) with the Recorder given compile(m)
Every run: the Recorder's objective and objective_scope from "objective" and "scope".
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402  (tests/support)
import batchmodels as BM  # noqa: E402

from dormouse.gate import Recorder, RecordingSpec  # noqa: E402

RUN = {"out": "", "kind": "moe", "stats": "local", "objective": "batchmodels:moe_forward", "scope": "example",
       "seed": 0, "steps": 2, "micro": 2, "batch": 1, "flip": False, "attrs": False, "labels": "model",
       "compile": None}
BUILD = {"moe": "batchmodels:build_moe", "pair": "batchmodels:build_pair", "switch": "batchmodels:build_switch"}


def rows(cfg: dict, step: int, rank: int, m: int, world: int) -> torch.Tensor:
    """This micro-batch's rows: disjoint across ranks, micro-batches and steps (fixed length T)."""
    i = ((step * world + rank) * cfg["micro"] + m) * cfg["batch"]
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + i)
    return torch.randint(0, BM.VOCAB, (cfg["batch"], BM.T), generator=g)


def run(cfg: dict) -> None:
    cfg = {**RUN, **cfg}
    world, rank = dist.get_world_size(), dist.get_rank()
    K, B, kind = cfg["micro"], cfg["batch"], cfg["kind"]
    model = {"moe": BM.build_moe, "pair": BM.build_pair, "switch": BM.build_switch}[kind](seed=cfg["seed"])
    if cfg["attrs"]:
        model.mix.on = True
    opt = BM.build_optimizer(model)
    where, given = cfg["compile"], None
    if where == "block":
        model.mix.compile(backend="eager")
    if where in ("inner", "given"):
        given = torch.compile(model, backend="eager")
        ddp = torch.nn.parallel.DistributedDataParallel(given)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    net = torch.compile(ddp, backend="eager") if where == "outer" else ddp
    rec = Recorder(cfg["out"], given if where == "given" else net, RecordingSpec(
        build_model=BUILD[kind], build_optimizer="batchmodels:build_optimizer", objective=cfg["objective"],
        objective_scope=cfg["scope"], build_kwargs={"seed": cfg["seed"]}))
    n_global = world * K * B * (BM.T - 1) if kind != "pair" else world * K * B
    for s in range(cfg["steps"]):
        if cfg["attrs"] is True and s == 1 or cfg["attrs"] == "rank1" and s == 0 and rank == 1:
            model.mix.gain = 2.0
        total = torch.zeros(())
        for m in range(K):
            x = rows(cfg, s, rank, m, world)
            ctx = ddp.no_sync() if m < K - 1 else contextlib.nullcontext()
            with ctx:
                if kind == "moe":
                    logits, p = net(input_ids=x)
                    ce, n = BM.ce_sum(logits, x)
                    psum, fcount, tokens = BM.routing_stats(p)
                    if cfg["stats"] == "global":  # the step's statistics: every rank's, with autograd
                        import torch.distributed.nn.functional as dnn

                        psum = dnn.all_reduce(psum)
                        fcount = fcount.detach().clone()
                        dist.all_reduce(fcount)
                        loss = ce * world / n_global + BM.ALPHA * BM.balance(psum, fcount, tokens * world)
                    else:  # this forward's own statistics, weighted by its tokens
                        loss = (ce + BM.ALPHA * BM.balance(psum, fcount, tokens) * n) * world / n_global
                elif kind == "pair":
                    import torch.distributed.nn.functional as dnn

                    y = rows({**cfg, "seed": cfg["seed"] + 17}, s, rank, m, world)
                    q, k = net(input_ids=x, pair_ids=y)
                    keys = torch.cat(dnn.all_gather(k))  # every rank's positives are the negatives
                    target = rank * B + torch.arange(B)
                    ce = F.cross_entropy(q @ keys.T / BM.TAU, target, reduction="sum")
                    loss = ce * world / n_global
                else:
                    flip = cfg["flip"] and m == 0 and (cfg["flip"] is True or rank == 1)
                    logits = net(input_ids=x, flip=True) if flip else net(input_ids=x)
                    y = x
                    if cfg["labels"] in ("rec", "unrecorded"):  # the prompt's positions are not trained on
                        y = x.clone()
                        y[:, :3] = -100
                        if cfg["labels"] == "rec":
                            rec.labels(y)
                    ce = F.cross_entropy(logits[:, :-1].reshape(-1, BM.VOCAB), y[:, 1:].reshape(-1),
                                         ignore_index=-100, reduction="sum")
                    per_row = BM.T - 1 - (2 if cfg["labels"] in ("rec", "unrecorded") else 0)  # the targets a row has
                    loss = ce * world / (world * K * B * per_row)
                loss.backward()
            total += ce.detach()
        rec.step(optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec.close()
    dist.barrier()


if __name__ == "__main__":
    sys.exit(plan.main(run))
