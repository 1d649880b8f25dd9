"""One review loop: tensor parallel (1-D) or FSDP2 x TP (2-D), with an optional planted fault.

torchrun --standalone --nproc_per_node=2 tp_run.py --out runs/NAME --fault none [--dp 2 --tp 2]
Besides the Recorder, rank by rank it saves its OWN copy of the full parameters before
each step and the full gradient the optimizer applies (truth/), for truth.py."""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

import common
from dormouse.gate import Recorder

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--fault", default="none")
ap.add_argument("--dp", type=int, default=1)
ap.add_argument("--tp", type=int, default=2)
ap.add_argument("--vocab", type=int, default=64)
ap.add_argument("--loss-parallel", type=int, default=1)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--micro", type=int, default=2)
ap.add_argument("--seed", type=int, default=0)
a, _ = ap.parse_known_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == a.dp * a.tp
torch.manual_seed(1234 + rank)      # the ranks' own RNG differs, as in a real launch
if a.dp > 1:
    mesh = init_device_mesh("cpu", (a.dp, a.tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
else:
    mesh = tp_mesh = init_device_mesh("cpu", (a.tp,), mesh_dim_names=("tp",))
    dp_mesh = None
replica = dp_mesh.get_local_rank() if dp_mesh is not None else 0
tp_rank = tp_mesh.get_local_rank()

kw = {"vocab": a.vocab, "seed": a.seed}
model = common.build_model(**kw)
lp = bool(a.loss_parallel) and a.fault != "gathered_vocab_ce"
out_style = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False) if lp
             else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
parallelize_module(model, tp_mesh, {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": out_style,
})
for name, block in model.layers.items():
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if a.fault in ("sp_norm_local", "sp_norm_avg") and name == "0":
        del plan["attention_norm"]       # the norm runs on the local sequence shard as a plain module
    parallelize_module(block, tp_mesh, plan)
if dp_mesh is not None:
    from torch.distributed.fsdp import fully_shard
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)

if a.fault == "init_after_tp":
    common.init_weights(model, a.seed)    # on the DTensor shards, each rank its own RNG stream
opt, sched = common.build_optimizer(model)
rec = Recorder(a.out, model, build_model="common:build_model_titan" if a.fault == "init_after_tp" else "common:build_model", build_optimizer="common:build_optimizer",
               objective="causal_lm", build_kwargs=kw)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def megatron_ce(logits, labels):
    """Megatron's vocab-parallel cross-entropy applied to logits already gathered (#7452, 2):
    every rank's 'partition' is the whole vocabulary, so the sum of exp is counted TP times."""
    m = logits.detach().max(-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_mesh.get_group())
    z = (logits - m).exp().sum(-1)
    z = dfn.all_reduce(z, group=tp_mesh.get_group())
    valid = labels != -100
    tgt = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per = z.log() + m.squeeze(-1) - tgt
    return (per * valid).sum()


os.makedirs(f"{a.out}_truth", exist_ok=True)
for step in range(1, a.steps + 1):
    params = {n: full(p) for n, p in model.named_parameters()}
    data_rep = 0 if a.fault == "dp_same_data" else replica
    batches = [common.batch(step, data_rep, m, a.vocab) for m in range(a.micro)]
    n_global = sum(common.n_targets(common.batch(step, r, m, a.vocab)[1])
                   for r in range(a.dp) for m in range(a.micro))
    n_replica = sum(common.n_targets(y) for _, y in batches)
    local_sum = torch.zeros(())
    for x, y in batches:
        logits = model(x)
        rec.labels(y)
        lab = common.shifted(y)
        ctx = loss_parallel() if lp else contextlib.nullcontext()
        with ctx:                          # loss_parallel: the loss AND its backward inside
            if a.fault == "gathered_vocab_ce":
                s = megatron_ce(logits, lab)
            else:
                s = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
            denom = n_replica if a.fault == "dp_own_count" else n_global
            loss = s / denom * a.dp           # FSDP2 averages the dp replicas
            if a.fault == "loss_x_tp":
                loss = loss * a.tp
            if a.fault == "loss_div_tp":
                loss = loss / a.tp
            loss.backward()
        local_sum += (s.full_tensor() if isinstance(s, DTensor) else s).detach()
    if a.fault == "sp_norm_avg":
        for p in model.layers["0"].attention_norm.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=tp_mesh.get_group())
    if dp_mesh is not None:
        dist.all_reduce(local_sum, group=dp_mesh.get_group())
    logged = local_sum / n_global
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    torch.save({"params": params, "grads": grads, "loss": float(logged)}, f"{a.out}_truth/rank{rank}_step{step}.pt")
    rec.step(loss=logged, optimizer=opt)
    opt.step(); sched.step(); opt.zero_grad()
rec.close()
dist.destroy_process_group()
