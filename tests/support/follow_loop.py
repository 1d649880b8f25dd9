"""A researcher's DDP (or FSDP2) loop recorded with the in-run checks on
(RecordingSpec(selfcheck=k)), for the follower and the reduction tests: loopmodel's
TinyLM, K micro-batches a step, AdamW, clipping, each rank's loss sum and
token count passed to rec.step. Run under torchrun (gloo) with `--plan PLAN`
(a JSON list of runs, see RUN), one after another.

Faults, by each run's "fault" (the loop's own code, no patched module):
  clean        DDP's own reduction (or the user's hook, "hook": "user": a plain fp32 all-reduce / W)
  rank1_x      from step "from" on, rank 1 scales its synchronised gradient by 1.01 before clipping
  no_reduce    no all-reduce at all (no_sync on every micro-batch; with "hook": "user", the user's hook
               returns each bucket unreduced)
  times_w      a factor W: without a hook, the loop all-reduces the synchronised gradients once more (a sum
               of means); with the user's hook, the hook forgets to divide by W
  drop_bucket  one bucket not reduced: without a hook, the loop's own reduction (no_sync, then a
               hand-written all-reduce / W of every gradient but fc.weight's); with the user's hook,
               the hook returns the bucket holding fc.weight unreduced (buckets of ~4 KB)
  fsdp_sum     (FSDP2) the gradient divide factor set to 1: the shards' reduce-scatter sums
"hook": "bf16": ddp_loop's line-for-line copy of torch's bf16_compress_hook (gloo refuses torch's own);
  "wire": the Recorder's declared wire ("bf16" when that hook is meant)
"stop": RecordingSpec(stop_on_fail=True); the RecorderError it raises is caught and printed as
  "[rank R] stopped: ..." (one line), and the loop goes on to the plan's next run.
"sleep": seconds each step sleeps (a slower fleet, as a real run's steps are).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402  (tests/support)
from loopmodel import VOCAB, build_model, build_optimizer, collate, dataset  # noqa: E402

from dormouse.gate import Recorder, RecordingSpec  # noqa: E402
from dormouse.gate.record.options import RecorderError  # noqa: E402

RUN = {"out": "", "fault": "clean", "from": 1, "hook": None, "fsdp": False, "steps": 4, "micro": 2, "batch": 2,
       "n": 64, "seed": 0, "sleep": 0.0, "stop": False, "selfcheck": 64,
       "wire": "fp32"}


def user_hook(fault: str, drop: set):
    """The user's own DDP communication hook: an fp32 all-reduce of the bucket / W, or its faults."""
    def hook(state, bucket):
        buf = bucket.buffer()
        world = dist.get_world_size()
        if fault == "no_reduce" or (fault == "drop_bucket" and drop & {id(p) for p in bucket.parameters()}):
            fut = torch.futures.Future()
            fut.set_result(buf)
            return fut
        if fault != "times_w":
            buf.div_(world)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    return hook


def run(cfg: dict) -> None:
    cfg = {**RUN, **cfg}
    world, rank = dist.get_world_size(), dist.get_rank()
    fault, K, B, n = cfg["fault"], cfg["micro"], cfg["batch"], cfg["n"]
    kw = {"seed": cfg["seed"], "lr": 1e-2}
    model = build_model(**kw)
    hand = fault in ("no_reduce", "drop_bucket") and cfg["hook"] is None  # the loop reduces (or not) itself
    if cfg["fsdp"]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        if fault == "fsdp_sum":  # gloo has no PREMUL_SUM: the sum by SUM, divided by nothing
            model.set_force_sum_reduction_for_comms(True)
            model.set_gradient_divide_factor(1.0)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
        if cfg["hook"] == "user":
            net.register_comm_hook(None, user_hook(fault, {id(model.fc.weight)}))
        elif cfg["hook"] == "bf16":
            from ddp_loop import bf16_wire_hook

            net.register_comm_hook(None, bf16_wire_hook)
    opt, sched = build_optimizer(model, **kw)
    try:
        rec = Recorder(cfg["out"], net, RecordingSpec(build_model="loopmodel:build_model",
                                                      build_optimizer="loopmodel:build_optimizer",
                                                      objective="causal_lm", max_grad_norm=1.0, dataset_len=n,
                                                      build_kwargs=kw, selfcheck=cfg["selfcheck"],
                                                      stop_on_fail=cfg["stop"], wire=cfg["wire"]))
        data = dataset(n, cfg["seed"])
        per_epoch = n // (world * K * B)
        for s in range(cfg["steps"]):
            epoch, j = divmod(s, per_epoch)
            sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                                                          seed=cfg["seed"], drop_last=True)
            sampler.set_epoch(epoch)
            idx = list(sampler)[j * K * B:(j + 1) * K * B]
            mbs = [collate([data[i] for i in idx[m * B:(m + 1) * B]]) for m in range(K)]
            counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs]
            total = torch.tensor(sum(counts))
            dist.all_reduce(total)
            local_sum = torch.zeros(())
            for m, mb in enumerate(mbs):
                last = m == K - 1
                if cfg["fsdp"]:
                    model.set_requires_gradient_sync(last)
                    ctx = contextlib.nullcontext()
                else:
                    ctx = net.no_sync() if (not last or hand) else contextlib.nullcontext()
                with ctx:
                    logits = net(**mb)
                    loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), mb["labels"][:, 1:].reshape(-1),
                                               ignore_index=-100, reduction="sum")
                    (loss_sum * world / int(total)).backward()
                local_sum += loss_sum.detach()
            if hand and fault == "drop_bucket":  # the loop's own reduction, one tensor forgotten
                for name, p in model.named_parameters():
                    if p.grad is not None and name != "fc.weight":
                        dist.all_reduce(p.grad)
                        p.grad /= world
            if fault == "times_w" and cfg["hook"] is None:  # DDP's mean, then the loop's own sum on top
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
            if fault == "rank1_x" and rank == 1 and s + 1 >= cfg["from"]:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.01)
            logged = local_sum.clone()
            dist.all_reduce(logged)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            rec.step(loss=logged / int(total), optimizer=opt, grad_norm=norm, loss_sum=local_sum,
                     tokens=sum(counts))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if cfg["sleep"]:
                time.sleep(cfg["sleep"])
        rec.close()
    except RecorderError as e:
        print(f"[rank {rank}] stopped: {e}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(plan.main(run))
