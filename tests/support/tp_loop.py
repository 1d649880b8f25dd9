"""A researcher's tensor-parallel (and 2-D: FSDP2 x TP) training loop over
tp_llama, recorded for the gate. Run under torchrun (gloo):
`torchrun --standalone --nproc_per_node=W tp_loop.py --plan PLAN.json`, PLAN a
JSON list of runs (dicts, see RUN), one after another in the same process group
(a run with "pp": true is pp_loop.py's pipeline run).

The mesh is (dp, tp) = (W / tp, tp); each DP replica reads its own rows of the
step's global batch (every TP rank of a replica the same rows), K micro-batches
of B rows of T tokens. Each micro-batch's loss is its token sum of
cross-entropy (under loss_parallel: on the vocabulary-sharded logits) divided
by the replica's token count of the step; FSDP2 averages over the dp ranks:
the global token mean. The logged loss is that mean all-reduced over dp.

The gate's lines are the three `rec.` calls. Faults ("fault"):
  clean          as above
  sp_norm_local  the sequence-parallel norms' weights are plain tensors, their
                 gradients never reduced over the TP group (tp_llama's knob)
  sp_norm_avg    sp_norm_local's plain norms, their gradients then averaged over the TP group where
                 each rank's part must be summed (an all-reduce with AVG for SUM): 1 / TP times one
                 process's on those norms alone (the final norm, a DTensor, is reduced right)
  tp_grad_x      after the last backward the loop multiplies every TP-sharded
                 weight's gradient by the TP size (a reduction that sums where it
                 should average; pytorch #160285's doubled expert gradients)
  tp_rows        TP rank 1 of each replica reads other rows than its TP rank 0
  module_x       rank 1 multiplies one module's output ("module") by "factor" (a forward hook;
                 with tp 1 a plain DDP run over every rank)
  loss_x         rank 1 backpropagates its loss times "factor" (the logged loss is right)
  loss_x_all     every rank backpropagates its loss times "factor" (the logged loss is right)
  dp_sum         after the backward every gradient is multiplied by the dp size: a sum where DDP or
                 FSDP2 averages (FSDP2's own divide factor 1 needs PREMUL_SUM, which gloo lacks)
  loss_local     the logged loss is this replica's own, not reduced over dp
                 (torchtitan #3329: the gradient right, the logged loss wrong)
  init_shards    after parallelising, the loop initialises every TP-split weight in
                 place under the run's seed: each rank draws its own shard from the
                 same RNG state (torchtitan's init-after-parallelize flow)
  dropout_local  with "dropout" > 0 (tp_llama's KeyedDropout on each feed-forward's
                 column-split hidden activation): every TP rank keys its mask by its
                 local column index, drawing the first shard's mask (dropout drawn alike
                 on the TP ranks of a sharded region: a dropout outside Megatron's
                 model-parallel RNG tracker, Megatron-LM #26)
  loss_vp_gathered  the loss backpropagated AND logged is Megatron's vocabulary-parallel
                 cross-entropy (its forward and its local backward) applied to logits already
                 gathered (loss_parallel off): each rank takes the whole vocabulary for its
                 partition, rank r's range [r V, (r + 1) V) holding the targets on rank 0 only;
                 the loss is the objective + log(TP), the gradient wrong (Megatron #7452, 2)
  tp_reduce_bf16 after the backward, the gradients DTensor leaves Partial over the TP group
                 (the TP-replicated parameters': the sequence-parallel norms') are all-reduced
                 in bfloat16 by the loop, every other reduction float32 (pytorch #190626's
                 TP-dimension reduce in bf16, in a float32 run; TP alone, no FSDP2)
  norms_x_rank1  sp_norm_local's plain norms, their gradients summed over the TP group (right), then TP
                 rank 1 scales its copies by 1.001 (a review's loop: the reduce happened; one rank changed
                 its copy after it)
  clip_tp0_norms with "max_grad_norm": the loop clips every gradient by the global norm, but on TP ranks
                 other than 0 the TP-replicated parameters' (the sequence-parallel norms') gradients keep
                 their unclipped values (DeepSpeed #1801's mechanism: the replicated LayerNorm clipped on
                 one TP rank only); the replicas then step apart
"max_grad_norm": clip_grad_norm_ before rec.step (its norm passed as grad_norm); 0: no clipping.
"reduce_dtype" / "param_dtype" ("bfloat16" or "float32"): FSDP2's MixedPrecisionPolicy on
the dp dimension (2-D runs); "wire": the Recorder's declared wire ("fp32" or "bf16").
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import plan  # tests/support: the loops' one main

RUN = {"out": None, "fault": "clean", "seed": 0, "steps": 2, "tp": 2, "micro": 2, "rows": 2, "T": 8,
       "loss_parallel": True, "module": None, "factor": 1.0, "dropout": 0.0, "reduce_dtype": None,
       "param_dtype": None, "wire": "fp32", "max_grad_norm": 0.0}


def batch_rows(seed: int, step: int, n: int, T: int, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randint(0, vocab, (n, T), generator=g)


class GatheredVocabParallelCE(torch.autograd.Function):
    """Megatron's vocab_parallel_cross_entropy (forward: the max and the sum of exponentials all-reduced over
    the TP group, the target logit taken by the rank whose vocabulary range holds it and all-reduced; backward
    local: softmax minus the target's one-hot where this rank holds it) given logits each TP rank holds WHOLE:
    its partition is the whole vocabulary V, its range [r V, (r + 1) V)."""

    @staticmethod
    def forward(ctx, z, y, group):
        V, r = z.shape[-1], dist.get_rank(group)
        top = z.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        e = (z - top[:, None]).exp()
        sumexp = e.sum(dim=-1)
        dist.all_reduce(sumexp, group=group)
        mine = (y >= r * V) & (y < (r + 1) * V)
        local = (y - r * V).clamp(0, V - 1)
        target = torch.where(mine, z.gather(1, local[:, None]).squeeze(1) - top, torch.zeros_like(top))
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(e / sumexp[:, None], mine, local)
        return sumexp.log() - target

    @staticmethod
    def backward(ctx, g):
        soft, mine, local = ctx.saved_tensors
        grad = soft.clone()
        grad[torch.arange(len(local)), local] -= mine.to(grad.dtype)
        return grad * g[:, None], None, None


def run(cfg: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from dormouse.gate import Recorder, RecordingSpec
    from tp_llama import build_model, build_optimizer, parallelize

    cfg = {**RUN, **cfg}
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = cfg["tp"]
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = rank // tp, rank % tp
    fault = cfg["fault"]
    build = {"seed": cfg["seed"], **({"dropout": cfg["dropout"]} if cfg["dropout"] else {})}
    model = build_model(**build)
    mp = None
    if cfg["reduce_dtype"] or cfg["param_dtype"]:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(**{k: getattr(torch, cfg[k]) for k in ("param_dtype", "reduce_dtype") if cfg[k]})
    if tp > 1:
        parallelize(model, mesh, loss_parallel=cfg["loss_parallel"],
                    sp_norm_local=fault in ("sp_norm_local", "sp_norm_avg", "norms_x_rank1"),
                    dropout_local=fault == "dropout_local", mp_policy=mp)
    if fault == "init_shards":
        torch.manual_seed(cfg["seed"])
        with torch.no_grad():
            for p in model.parameters():
                if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
                    p.normal_(0.0, 0.02)
    if fault == "module_x" and rank == 1:  # one module's output off by a factor on rank 1 (a client's hook)
        model.get_submodule(cfg["module"]).register_forward_hook(lambda mod, a, out: out * cfg["factor"])
    opt = build_optimizer(model)
    if tp == 1:  # a plain data-parallel run: DDP over every rank
        model = torch.nn.parallel.DistributedDataParallel(model)
    rec = Recorder(cfg["out"], model, RecordingSpec(build_model="tp_llama:build_model",
                                                    build_optimizer="tp_llama:build_optimizer", objective="causal_lm",
                                                    build_kwargs=build, wire=cfg["wire"],
                                                    max_grad_norm=cfg["max_grad_norm"]))
    K, B, T = cfg["micro"], cfg["rows"], cfg["T"]
    for step in range(cfg["steps"]):
        rows = batch_rows(cfg["seed"], step, dp * K * B, T)
        mine = rows[dp_rank * K * B:(dp_rank + 1) * K * B]
        if fault == "tp_rows" and tp_rank == 1:  # another replica's rows (or, at dp 1, the step's next ones)
            mine = batch_rows(cfg["seed"] + 99, step, K * B, T)
        count = K * B * (T - 1)
        total = 0.0
        for m in range(K):
            ids = mine[m * B:(m + 1) * B]
            if tp == 1:
                model.require_backward_grad_sync = m == K - 1
            elif hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(m == K - 1)
            logits = model(ids)
            z, y = logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
            scale = cfg["factor"] if (fault == "loss_x" and rank == 1) or fault == "loss_x_all" else 1.0
            if cfg["loss_parallel"] and tp > 1:
                with loss_parallel():
                    loss = F.cross_entropy(z, y, reduction="sum") / count
                    (loss * scale).backward()
            elif fault == "loss_vp_gathered":
                loss = GatheredVocabParallelCE.apply(z, y, mesh["tp"].get_group()).sum() / count
                loss.backward()
            else:
                loss = F.cross_entropy(z, y, reduction="sum") / count
                (loss * scale).backward()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            total += float(loss.detach())
        if fault == "dp_sum":  # the reduced gradient summed over the replicas where DDP/FSDP2 averaged it
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.mul_(dp)
        if fault == "sp_norm_avg":  # the plain norms' parts averaged over the TP group, not summed
            with torch.no_grad():
                for p in model.parameters():
                    if not isinstance(p, DTensor):
                        dist.all_reduce(p.grad, group=mesh["tp"].get_group())
                        p.grad.div_(tp)
        if fault == "norms_x_rank1":  # the plain norms' parts summed over the TP group, then rank 1's scaled
            with torch.no_grad():
                for p in model.parameters():
                    if not isinstance(p, DTensor):
                        dist.all_reduce(p.grad, group=mesh["tp"].get_group())
                        p.grad.mul_(1.001 if tp_rank == 1 else 1.0)
        if fault == "tp_grad_x":  # the step's TP-sharded gradients summed over the group where averaged
            with torch.no_grad():
                for p in model.parameters():
                    if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
                        p.grad.mul_(tp)
        if fault == "tp_reduce_bf16":  # the Partial gradients reduced over TP in bfloat16
            from torch.distributed.tensor import Replicate

            with torch.no_grad():
                for p in model.parameters():
                    if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                        t = p.grad.to_local().bfloat16()
                        dist.all_reduce(t, group=mesh["tp"].get_group())
                        mesh_of = p.grad.device_mesh
                        p.grad = DTensor.from_local(t.float(), mesh_of, [Replicate()] * mesh_of.ndim)
        logged = torch.tensor(total)
        if dp > 1 and fault != "loss_local":
            dist.all_reduce(logged, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        norm = clip(model, cfg, tp_rank) if cfg["max_grad_norm"] else None
        rec.step(loss=logged, optimizer=opt, grad_norm=norm)
        opt.step()
        opt.zero_grad()
    rec.close()


def clip(model, cfg: dict, tp_rank: int) -> torch.Tensor:
    """clip_grad_norm_ by the global norm (returned, a plain tensor); with "clip_tp0_norms", TP ranks other
    than 0 put their TP-replicated gradients back to their unclipped values (DeepSpeed #1801)."""
    from torch.distributed.tensor import DTensor, Replicate

    replicated = [p for p in model.parameters()
                  if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)]
    for p in replicated:  # their gradients reduced over the group first (DTensor leaves them Partial)
        p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)
    faulty = cfg["fault"] == "clip_tp0_norms" and tp_rank != 0
    held = {p: p.grad._local_tensor.clone() for p in replicated} if faulty else {}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
    with torch.no_grad():
        for p, g in held.items():
            p.grad._local_tensor.copy_(g)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def run_any(cfg: dict) -> None:
    """A tensor-parallel run, or a pipeline run (pp_loop.py) in the same launch."""
    if cfg.get("pp"):
        import pp_loop

        pp_loop.run(cfg)
    else:
        run(cfg)


if __name__ == "__main__":
    sys.exit(plan.main(run_any))
