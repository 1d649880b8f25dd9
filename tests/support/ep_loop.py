"""A researcher's expert-parallel training loop over ep_moe (a tiny MoE LM),
recorded for the gate with a declared sharding. Run under torchrun (gloo):
`torchrun --standalone --nproc_per_node=W ep_loop.py --plan PLAN.json`, PLAN a
JSON list of runs (dicts, see RUN), one after another in one process group.

Every rank builds the whole model (build_model) and keeps its E/W experts
(ep_moe.shard_experts): expert parallel over the W ranks, which are also
data-parallel ranks, each reading its own rows of the step's global batch
(one forward of "rows" rows of T tokens per step). Tokens travel to their
experts' ranks and back by all_to_all. Each rank's loss is its own token mean
of cross-entropy plus the load-balancing term, with the routing counts
all-reduced over every rank (the router is shared by all of them) and the
router probabilities' mean over its own rows. The dense parameters'
gradients are all-reduced and averaged over the ranks; an expert's gradient,
which the all_to_all's backward already summed over every rank's tokens, is
divided by the EP size. The logged loss is the ranks' mean.

The gate's lines: the declared sharding and the three `rec.` calls. Faults ("fault"):
  clean            as above
  ep_grad_unscaled the expert gradients are not divided by the EP size: W times one
                   process's while the loss is right (pytorch #160285, Megatron #5956)
  ep_grad_twice    the expert gradients divided by the EP size twice: 1 / W times one process's
  ep_flat_reduce   the expert gradients all-reduced and averaged over the ranks with the dense ones (one
                   loop over every parameter): each rank's experts get the sum of every rank's experts'
                   gradients, different experts mixed
  aux_local        the balancing term's routing counts are this rank's own, not
                   all-reduced (torchtitan #3000): another objective than the declared one
  declare_reversed the run is clean, its declaration names the ranks in the reverse of
                   the order their experts concatenate in (a wrong declaration)

With "tp": true the run is hand-written (Megatron-style) tensor parallelism
instead: every expert on every rank, the output head split over the ranks'
vocabulary (ep_moe.shard_output, plain tensors, declared shard(0, ranks)),
the logits gathered, every rank reading the same rows (one replica): the
replicated parameters' gradients are already equal on every rank. Its fault:
  rng_apart        with "emb_dropout" > 0 (torch's dropout on the embedding's output, build_dropout_model):
                   each rank seeds the global RNG by its rank, so the TP ranks draw different masks in a
                   region they all hold whole
  tp_sum_replicated every replicated parameter's gradient summed over the TP ranks after the backward
                   (as if they were data-parallel ranks): TP times one process's, each rank already
                   holding the whole gradient
  tp_no_reduce     the head's input gradient is not all-reduced over the TP ranks (a
                   hand-written all-reduce whose backward communicates nothing,
                   flash-attention #1244): each rank's replicated gradients hold
                   only its own vocabulary shard's part
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import plan  # tests/support: the loops' one main

RUN = {"out": None, "fault": "clean", "seed": 0, "steps": 2, "rows": 4, "T": 8, "top_k": 2, "tp": False,
       "emb_dropout": 0.0}


def build_dropout_model(seed: int = 0, top_k: int = 2, emb_dropout: float = 0.1):
    """ep_moe's model with torch's dropout (the global RNG) on the embedding's output: under the
    hand-written TP a region every rank holds whole, where the TP ranks must draw one mask."""
    from ep_moe import build_model

    model = build_model(seed=seed, top_k=top_k)
    model.emb.register_forward_hook(lambda m, a, out: F.dropout(out, emb_dropout, m.training))
    return model
EXPERT_PARAMS = ("moe.w1", "moe.w2")


def run(cfg: dict) -> None:
    from dormouse.gate import Recorder, RecordingSpec, shard
    from ep_moe import E, balance, build_model, build_optimizer, shard_experts, shard_output
    from tp_loop import batch_rows

    cfg = {**RUN, **cfg}
    world, rank = dist.get_world_size(), dist.get_rank()
    fault = cfg["fault"]
    kw = {"seed": cfg["seed"], "top_k": cfg["top_k"], **({"emb_dropout": cfg["emb_dropout"]} if cfg["emb_dropout"]
                                                         else {})}
    if cfg["emb_dropout"]:
        build_model = build_dropout_model  # noqa: F811  (the recording names it below)
    tp, ranks = cfg["tp"], list(range(world))
    if tp:  # the vocabulary-parallel head: one replica of `world` tensor-parallel ranks
        model = shard_output(build_model(**kw), rank, world, reduce=fault != "tp_no_reduce")
        sharding, dp, dp_rank = {"out.*": shard(0, ranks)}, 1, 0
    else:  # the experts split over the ranks, which are data-parallel ranks too
        model, sharding, dp, dp_rank = shard_experts(build_model(**kw), rank, world), \
            {"moe.w*": shard(0, ranks[::-1] if fault == "declare_reversed" else dist.new_group(ranks), "expert")}, \
            world, rank  # the group as a ProcessGroup (its ranks in its order), or a list of ranks
    opt = build_optimizer(model)
    if cfg["emb_dropout"]:  # the replicated region's masks: one RNG state on every rank, or ("rng_apart") not
        torch.manual_seed(4321 + (rank if fault == "rng_apart" else 0))
    rec = Recorder(cfg["out"], model, RecordingSpec(
        build_model="ep_loop:build_dropout_model" if cfg["emb_dropout"] else "ep_moe:build_model",
        build_optimizer="ep_moe:build_optimizer", objective="ep_moe:objective", objective_scope="step",
        build_kwargs=kw), sharding=sharding)
    B, T = cfg["rows"], cfg["T"]
    for step in range(cfg["steps"]):
        ids = batch_rows(cfg["seed"], step, dp * B, T)[dp_rank * B:(dp_rank + 1) * B]
        z = model(ids)
        ce = F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        probs, idx = model.moe.stats
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        if fault != "aux_local" and not tp:  # the routing counts of every rank sharing the router
            dist.all_reduce(counts)
        loss = ce + balance(probs, idx, counts)
        loss.backward()
        with torch.no_grad():
            for n, p in model.named_parameters() if not tp else ():
                if n in EXPERT_PARAMS and fault != "ep_flat_reduce":  # summed over every rank's tokens by
                    # the all_to_all's backward
                    if fault != "ep_grad_unscaled":
                        p.grad.div_(world * world if fault == "ep_grad_twice" else world)
                else:  # dense: data parallel over the same ranks
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            for n, p in model.named_parameters() if tp and fault == "tp_sum_replicated" else ():
                if not n.startswith("out."):  # replicated: already whole and equal on every TP rank
                    dist.all_reduce(p.grad)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        rec.step(loss=logged / world, optimizer=opt)
        opt.step()
        opt.zero_grad()
    rec.close()


if __name__ == "__main__":
    sys.exit(plan.main(run))
