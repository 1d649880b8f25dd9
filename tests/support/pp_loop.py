"""A researcher's pipeline-parallel loop (torch.distributed.pipelining) over
tp_llama, recorded for the gate. Run under torchrun (gloo, 2 ranks = 2 stages):
`torchrun --standalone --nproc_per_node=2 pp_loop.py --plan PLAN.json`.

Each rank builds the whole model (build_model) and keeps its stage
(tp_llama.pipeline_stage_module: layers split, the embedding on stage 0, the
final norm and output on stage 1), wraps it in a PipelineStage and runs a
schedule ("GPipe" or "1F1B") over "micro" micro-batches of the step's rows,
with scale_grads (the default): the loss function returns each micro-batch's
token mean, the schedule divides the gradients by the number of micro-batches:
the step's token mean (every micro-batch has the same token count). The last
stage's mean loss is broadcast to every rank and logged.

Faults ("fault"):
  clean        as above
  loss_div     the loss function also divides by the number of micro-batches, on
               top of scale_grads (the gradient too small by that number)
  stale        the last stage never zeroes its gradients: each step's adds to the
               last one's, which scale_grads divides by the micro-batches again
  tied         True: the output tied to the embedding (build_tied_model: two names, one parameter);
               "shared": the output projection is the embedding's weight under its one name on both
               stages (build_shared_model)
  tied_one_way (with "tied") the tied weight's
               gradients reduced to the first stage only: the last stage's copy never receives the
               first stage's part

  sum_loss     the loss function returns each micro-batch's summed cross-entropy with
               scale_grads=False, and the division by the step's token count is applied
               after schedule.step(), to the logged loss alone: the schedule backpropagates
               the raw sum, the gradient is the token count times too large while the logged
               loss is right (torchtitan #2972: its PP path divides by global_valid_tokens
               after the backward, for metrics only)

Gradient accumulation ("accum": A > 1): each optimizer step runs schedule.step() A times,
each on its own "rows" rows, without zeroing between them. With scale_grads (the
default) each call divides the gradients ALREADY ACCUMULATED by the micro-batches
again (torch's `_PipelineSchedule._maybe_scale_grads` -> `PipelineStage.scale_grads`,
in place on every parameter's .grad): the earlier calls' share shrinks by K each
call, a moving average instead of a sum (torchtitan #1733). "scale": false
(the schedule built with scale_grads=False) with the loss divided by K x A is the sum done right.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import plan  # tests/support: the loops' one main

RUN = {"out": None, "fault": "clean", "seed": 0, "steps": 2, "schedule": "GPipe", "micro": 2, "rows": 4, "T": 8,
       "tied": False, "accum": 1, "scale": True}


def build_tied_model(seed: int = 0, **kw):
    """tp_llama's model with its output projection tied to the input embedding (one parameter, two names)."""
    from tp_llama import build_model

    model = build_model(seed=seed, **kw)
    model.output.weight = model.tok_embeddings.weight
    return model


def build_shared_model(seed: int = 0, **kw):
    """tp_llama's model whose output projection IS the input embedding, with no output module: each stage
    that uses the weight keeps it under its one name, tok_embeddings.weight (the review's pipeline)."""
    from dormouse.bench.tp_llama import TinyLlama, build_model

    class SharedTiedLlama(TinyLlama):
        role = "whole"  # a stage's: "first" (embeds, no head) or "last" (its input an activation)

        def forward(self, input_ids):
            h = input_ids if self.role == "last" else self.tok_embeddings(input_ids)
            for layer in self.layers.values():
                h = layer(h)
            return h if self.role == "first" else F.linear(self.norm(h), self.tok_embeddings.weight)

    model = build_model(seed=seed, **kw)
    model.__class__, model.output = SharedTiedLlama, None
    return model


def shared_stage(model, rank: int, world: int):
    """Stage `rank` of build_shared_model's model: its layers, the embedding on the first stage and the
    last (as the output projection), the final norm on the last."""
    n = len(model.layers)
    for i in [i for i in range(n) if not rank * n // world <= i < (rank + 1) * n // world]:
        del model.layers[str(i)]
    model.role = "first" if rank == 0 else "last"
    if rank != world - 1:
        model.norm = None
    return model


def sync_tied(module, rank: int, world: int, fault: str) -> None:
    """The tied weight's two copies (the embedding on the first stage, the output on the last) each get
    the sum of both stages' gradients (an all-reduce over the two stages); "tied_one_way": a reduce to
    the first stage only, the last stage's copy keeping its own part."""
    part = module.tok_embeddings if rank == 0 or module.output is None else module.output if rank == world - 1 \
        else None
    g = part.weight.grad if part is not None else torch.zeros(())
    if fault == "tied_one_way":
        dist.reduce(g, dst=0)
    else:
        dist.all_reduce(g)


def run(cfg: dict) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dormouse.gate import Recorder, RecordingSpec
    from tp_llama import build_model, build_optimizer, pipeline_stage_module
    from tp_loop import batch_rows

    cfg = {**RUN, **cfg}
    rank, world = dist.get_rank(), dist.get_world_size()
    K = cfg["micro"]
    if cfg["tied"] == "shared":
        module = shared_stage(build_shared_model(seed=cfg["seed"]), rank, world)
    else:
        module = pipeline_stage_module((build_tied_model if cfg["tied"] else build_model)(seed=cfg["seed"]), rank,
                                       world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))

    acc, scale = cfg["accum"], cfg["scale"] and cfg["fault"] != "sum_loss"

    def loss_fn(logits, target):
        if cfg["fault"] == "sum_loss":  # the raw sum: the schedule backpropagates it as it is
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), reduction="sum")
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())
        loss = loss / acc if scale else loss / (K * acc)  # unscaled: the schedule leaves the division to us
        return loss / K if cfg["fault"] == "loss_div" else loss

    schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[cfg["schedule"]](stage, K, loss_fn=loss_fn,
                                                                               scale_grads=scale)
    opt = build_optimizer(module)
    rec = Recorder(cfg["out"], module, RecordingSpec(
        build_model={True: "pp_loop:build_tied_model", "shared": "pp_loop:build_shared_model"}.get(
            cfg["tied"], "tp_llama:build_model"),
        build_optimizer="tp_llama:build_optimizer", objective="causal_lm",
        build_kwargs={"seed": cfg["seed"]}), pipeline_stage=stage)
    for step in range(cfg["steps"]):
        losses: list = []
        for a in range(acc):  # accumulation: each schedule.step() on rows of its own, no zero_grad between
            ids = batch_rows(cfg["seed"], step * acc + a if acc > 1 else step, cfg["rows"], cfg["T"])
            got: list = []  # the schedule clears the list it is given
            if rank == 0:
                schedule.step(ids)
            else:
                schedule.step(target=ids, losses=got)
            losses += got
        # the micro-batches' token means (the loss_fn's values times what it divided them by)
        if cfg["fault"] == "sum_loss":  # divided after the backward, for the logged loss alone
            losses = [x * K / (acc * cfg["rows"] * (cfg["T"] - 1)) for x in losses]
        else:
            losses = [x * (acc if scale else K * acc) for x in losses]
        logged = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(logged, src=world - 1)
        if cfg["tied"]:
            sync_tied(module, rank, world, cfg["fault"])
        rec.step(loss=logged, optimizer=opt)
        opt.step()
        if not (cfg["fault"] == "stale" and rank == world - 1):
            opt.zero_grad()
    rec.close()


if __name__ == "__main__":
    sys.exit(plan.main(run))
