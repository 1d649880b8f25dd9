"""One review loop: a 2-stage pipeline (torch.distributed.pipelining), optional planted fault.

torchrun --standalone --nproc_per_node=2 pp_run.py --out runs/NAME --schedule gpipe|1f1b --fault none
Each stage saves its own parameters before each step and the gradient the optimizer applies
(truth/), for truth.py (labels = input_ids: the pipeline's model never receives labels)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import common
from dormouse.gate import Recorder

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--fault", default="none")
ap.add_argument("--schedule", default="gpipe")
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--micro", type=int, default=2)
ap.add_argument("--clip", type=float, default=0.0)
a, _ = ap.parse_known_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
kw = {"vocab": 64, "seed": 0}
model = common.build_model(**kw)
if rank == 0:                      # torchtitan's way: delete what the stage does not hold
    del model.layers["1"]
    model.norm = None
    model.output = None
else:
    del model.layers["0"]
    model.tok_embeddings = None
stage = PipelineStage(model, rank, 2, torch.device("cpu"))
n_global = a.micro * 2 * (common.T - 1)     # rows 2, T-1 targets a row, no masking


def loss_fn(logits, y):
    s = F.cross_entropy(logits.flatten(0, 1), common.shifted(y).flatten(), ignore_index=-100, reduction="sum")
    if a.fault == "mb_mean_no_scale":
        return s / (y.shape[0] * (common.T - 1))        # each micro-batch's own mean, scale_grads=False
    return s / n_global * a.micro                       # scale_grads divides by the micro-batches


Sched = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
schedule = Sched(stage, a.micro, loss_fn=loss_fn, scale_grads=(a.fault != "mb_mean_no_scale"))
opt, sched = common.build_optimizer(model)
rec = Recorder(a.out, model, build_model="common:build_model", build_optimizer="common:build_optimizer",
               objective="causal_lm", build_kwargs=kw, pipeline_stage=stage, max_grad_norm=a.clip)
os.makedirs(f"{a.out}_truth", exist_ok=True)
for step in range(1, a.steps + 1):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    xs, ys = zip(*(common.batch(step, 0, m, mask=False) for m in range(a.micro)))
    x, y = torch.cat(xs), torch.cat(ys)
    losses = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    mean_loss = torch.stack(losses).sum() / a.micro if rank == 1 else torch.zeros(())
    if a.fault == "mb_mean_no_scale" and rank == 1:
        mean_loss = torch.stack(losses).mean()
    dist.broadcast(mean_loss, src=1)
    norm = None
    if a.clip:
        local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        if a.fault == "local_clip":
            norm = local                              # each stage clips by its own norm
        else:
            sq = local ** 2
            dist.all_reduce(sq)
            norm = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), a.clip, norm)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.save({"params": params, "grads": grads, "loss": float(mean_loss)}, f"{a.out}_truth/rank{rank}_step{step}.pt")
    rec.step(loss=mean_loss, optimizer=opt, grad_norm=norm)
    opt.step(); sched.step()
    if not (a.fault == "no_zero_grad" and rank == 1):
        opt.zero_grad()
rec.close()
dist.destroy_process_group()
