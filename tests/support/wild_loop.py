"""Loops written the way users write them, for the faults and clean runs of issue 37's review
(tests/gate/catches/test_loops_we_did_not_write.py): a plain DDP loop over loopmodel's TinyLM,
2 gloo ranks under torchrun, `--plan PLAN.json` (a JSON list of RUN dicts, one launch).

Knobs (RUN keys):
  "model"        "tiny" (loopmodel:build_model) or "aux" (wild_loop:build_aux_model: a TinyLM that keeps
                 a non-leaf tensor as a module attribute after its forward, as many MoE layers keep
                 their balancing term: self.aux)
  "labels"       "masked" (padding -100, loopmodel.collate) or "inputs" (labels equal to the input
                 tokens, padding NOT masked: TrainCheck's pytorch-84803 workload)
  "bn_rank0"     TinyLM with BatchNorm, frozen (eval mode) in the training forwards; after each step rank 0
                 alone moves its running statistics by a train-mode forward of its first micro-batch
                 (no gradient) and broadcasts them: statistics of one rank's rows
  "collate_drop" rank 1's collator drops the last token of every row (rank 0's rows are the dataset's)
  "clip_no_norm" the loop clips (clip_grad_norm_) before rec.step but does not pass it grad_norm
  "skip_bwd"     steps (1-based) at which the loop calls opt.step() without any forward or backward
                 (gradients None: pytorch #115607's Adam step-counter case)
  "zero_grads"   opt.zero_grad(set_to_none=False): at a "skip_bwd" step the optimizer steps on zeros (AdamW
                 then decays every weight and its moments, and counts the step)
  "dropout"      TinyLM's dropout at this p, each rank seeding its own RNG (seed + rank) after the build: a
                 clean loop whose masks are each rank's own draws
  "zero_labels"  rank 1 moves each micro-batch to its "device" (a copy) and zeroes the copy's labels there
                 before the forward: its loss trains every position (padding too) towards token 0
  "loss_x"       {step (1-based, as a string): factor}: every rank backpropagates its loss times the factor at
                 that step alone (the logged loss is right)
  "sketch"       RecordingSpec(sketch=k): CountSketches of k numbers per tensor, not the full tensors
  "grad_x"       {tensor name: factor}: after the all-reduce, every rank scales those tensors' gradients alone
                 (a tied weight's or a router's gradient averaged once more than the rest: x 0.5)
  "ref"          the loss is ref_objective's (declared "wild_loop:ref_objective"): a DPO-like term a target
                 token against a frozen reference, the initial model built with the run's seed
  "rec_late"     the loop calls rec.step AFTER opt.step() (a misplaced call; the training itself is right)
  "overlap"      hand-written shards, no sampler and no example ids: rank r reads the window of steps x micro x
                 batch examples from r x (that - 1), so rank 1's first example is rank 0's last
A later review's knobs:
  "skip_loss"    at a "skip_bwd" step the loop logs rec.step(loss=0.0) (a number, not None)
  "stale_after"  steps (1-based) after which the loop does not zero the gradients (with "skip_bwd" the step
                 after: its optimizer steps on the stale gradient)
  "metric"       "all" or a rank: after each step's backwards, that rank (every rank) runs a train-mode
                 forward of its first micro-batch with gradients on, for a metric, never backpropagated
  "metric_rows"  the metric's rows: "trained" (the first micro-batch), "sliced" (its first 6 positions),
                 "other" (the dataset's last rows, which the step does not train on: a validation metric)
  "nan_attr"     every rank sets model.best = float("nan") before the Recorder starts
  "posmask"      the loop passes the attention mask positionally: net(input_ids, attention_mask)
  "model" "slots" wild_loop:build_slots_model: TinyLM returning an object with __slots__ (no __dict__)
  "detach_r1"    rank 1 never backpropagates its first micro-batch's loss (the loop still counts its tokens)
  "is_main"      every rank sets model.is_main = (rank == 0) before the Recorder starts (the forward never
                 reads it)
  "rank_grad_x"  rank 1 scales its whole synchronised gradient by this factor (max_grad_norm 0: no clip)
  "opt_copy"     the optimizer is built over another instance of the model (its zero_grad and step reach
                 that instance alone: the model never moves, its gradients accumulate)
  "model" "dc"   wild_loop:build_dc_model: TinyLM whose forward returns a dataclass (DCOut.logits), trained
                 with model.eval() (TinyLM has no dropout: eval changes nothing it computes)
"""

from __future__ import annotations

import dataclasses

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402  (tests/support)
from loopmodel import VOCAB, TinyLM, build_model, build_optimizer, collate, dataset  # noqa: E402

from dormouse.gate import Recorder, RecordingSpec  # noqa: E402

RUN = {"out": "", "seed": 0, "steps": 3, "micro": 2, "batch": 2, "n": 48, "lr": 1e-2, "model": "tiny",
       "labels": "masked", "skip_bwd": [], "max_grad_norm": 1.0, "bn_rank0": False,
       "collate_drop": False, "clip_no_norm": False, "zero_grads": False,
       "dropout": 0.0, "zero_labels": False, "loss_x": {}, "sketch": 0, "grad_x": {},
       "ref": False, "rec_late": False, "overlap": False, "skip_loss": False, "stale_after": [], "metric": None,
       "nan_attr": False, "rank_grad_x": 0.0, "is_main": False, "opt_copy": False,
       "detach_r1": False, "posmask": False, "metric_rows": "trained"}
REF_BETA = 0.5
_REFS: dict = {}


def ref_objective(model, batch, *, seed: int = 0, **_):
    """A DPO-like objective: over each target token, -logsigmoid(REF_BETA (log p(y) - log p_ref(y))), p_ref
    the frozen initial model built with the run's seed (which reaches it from build_kwargs): (sum, count)."""
    if seed not in _REFS:
        with torch.random.fork_rng():
            _REFS[seed] = build_model(seed=seed).requires_grad_(False)
    y = batch["labels"][:, 1:]
    on = y != -100

    def logp(m):  # the forward given the labels too: the Recorder records what the model is given
        z = m(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels") if k in batch})[:, :-1].float()
        return torch.log_softmax(z, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]

    with torch.no_grad():
        ref = logp(_REFS[seed])
    return (-F.logsigmoid(REF_BETA * (logp(model) - ref)) * on).sum(), int(on.sum())


class AuxLM(TinyLM):
    """TinyLM that keeps its last forward's mean activation (a non-leaf tensor, part of the graph) as
    an attribute, the way MoE layers keep their balancing term for the loop to read."""

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None):
        logits = super().forward(input_ids, attention_mask, labels, position_ids)
        self.aux = logits.float().pow(2).mean()
        return logits


def build_aux_model(*, seed: int = 0, **_) -> AuxLM:
    torch.manual_seed(seed)
    return AuxLM()


@dataclasses.dataclass
class DCOut:
    logits: torch.Tensor


class SlotsOut:
    __slots__ = ("logits",)

    def __init__(self, logits):
        self.logits = logits


class WrappedLM(TinyLM):
    """TinyLM whose forward returns its logits inside a model's own output class: a dataclass (DCOut), or
    an object with __slots__ and no __dict__ to walk (SlotsOut)."""

    def __init__(self, out_class):
        super().__init__()
        self.out_class = out_class

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None):
        return self.out_class(super().forward(input_ids, attention_mask, labels, position_ids))


def build_dc_model(*, seed: int = 0, **_) -> WrappedLM:
    torch.manual_seed(seed)
    return WrappedLM(DCOut)


def build_slots_model(*, seed: int = 0, **_) -> WrappedLM:
    torch.manual_seed(seed)
    return WrappedLM(SlotsOut)


def _logits(out):
    return out.logits if isinstance(out, (DCOut, SlotsOut)) else out


def batches(cfg: dict, data, idx, rank: int = 0):
    cut = 1 if cfg["collate_drop"] and rank == 1 else 0  # rank 1's collator drops each row's last token
    mbs = [collate([data[i][:len(data[i]) - cut] for i in idx[m * cfg["batch"]:(m + 1) * cfg["batch"]]])
           for m in range(cfg["micro"])]
    if cfg["labels"] == "inputs":  # labels = input_ids, padding (token 0) left as a target
        for mb in mbs:
            mb["labels"] = mb["input_ids"].clone()
    if cfg["zero_labels"] and rank == 1:  # the "device" copy's labels zeroed on rank 1 alone
        mbs = [{k: v.clone() for k, v in mb.items()} for mb in mbs]
        for mb in mbs:
            mb["labels"].zero_()
    return mbs


def run(cfg: dict) -> None:
    cfg = {**RUN, **cfg}
    world, rank = dist.get_world_size(), dist.get_rank()
    K, B, n = cfg["micro"], cfg["batch"], cfg["n"]
    kw = {"seed": cfg["seed"], "lr": cfg["lr"], **({"bn": True} if cfg["bn_rank0"] else {}),
          **({"dropout": cfg["dropout"]} if cfg["dropout"] else {})}
    builders = {"tiny": build_model, "aux": build_aux_model, "dc": build_dc_model, "slots": build_slots_model}
    builder = {"tiny": "loopmodel:build_model"}.get(cfg["model"], f"wild_loop:{builders[cfg['model']].__name__}")
    model = builders[cfg["model"]](**kw)
    if cfg["bn_rank0"]:
        model.bn.eval()  # frozen statistics in the training forwards
    if cfg["model"] == "dc":
        model.eval()
    if cfg["nan_attr"]:
        model.best = float("nan")  # a plain attribute the forward never reads, NaN on every rank
    if cfg["is_main"]:
        model.is_main = rank == 0  # a flag the forward never reads, other on each rank
    if cfg["dropout"]:
        torch.manual_seed(cfg["seed"] + rank)  # each rank its own masks
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt, sched = build_optimizer(builders[cfg["model"]](**kw) if cfg["opt_copy"] else model, **kw)
    rec = Recorder(cfg["out"], net, RecordingSpec(build_model=builder, build_optimizer="loopmodel:build_optimizer",
                                                  objective="wild_loop:ref_objective" if cfg["ref"] else
                                                  "causal_lm", max_grad_norm=cfg["max_grad_norm"],
                                                  dataset_len=n, build_kwargs=kw, sketch=cfg["sketch"]))
    data = dataset(n, cfg["seed"])
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                                                  seed=cfg["seed"], drop_last=True)
    order = list(sampler)
    if cfg["overlap"]:  # hand-written windows, one example shared by neighbouring ranks
        per = cfg["steps"] * K * B
        order = list(range(rank * (per - 1), rank * (per - 1) + per))
    for s in range(cfg["steps"]):
        norm = None
        if s + 1 in cfg["skip_bwd"]:
            reported = 0.0 if cfg["skip_loss"] else None
        else:
            idx = order[s * K * B:(s + 1) * K * B]
            mbs = batches(cfg, data, idx, rank)
            n_local = torch.tensor(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs))
            n_global = n_local.clone()
            dist.all_reduce(n_global)
            local_sum = torch.zeros(())
            for m, mb in enumerate(mbs):
                ctx = net.no_sync() if m < K - 1 else torch.enable_grad()
                with ctx:
                    if cfg["ref"]:
                        loss_sum = ref_objective(net, mb, seed=cfg["seed"])[0]
                    else:
                        logits = _logits(net(mb["input_ids"], mb["attention_mask"]) if cfg["posmask"] else net(**mb))
                        loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                   mb["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
                    if not (cfg["detach_r1"] and rank == 1 and m == 0):
                        (loss_sum * world / n_global * cfg["loss_x"].get(str(s + 1), 1.0)).backward()
                local_sum += loss_sum.detach()
            dist.all_reduce(local_sum)
            reported = local_sum / n_global
            if cfg["metric"] is not None and cfg["metric"] in ("all", rank):  # gradients on, no backward
                seen = {"trained": mbs[0], "sliced": {k: v[:, :6] for k, v in mbs[0].items()},
                        "other": collate([data[len(data) - 1 - i] for i in range(B)])}[cfg["metric_rows"]]
                accuracy = (_logits(model(**seen)).argmax(-1) == seen["input_ids"]).float().mean()
                del accuracy
            if cfg["rank_grad_x"] and rank == 1:
                for p in model.parameters():
                    p.grad.mul_(cfg["rank_grad_x"])
            for name, p in model.named_parameters():
                if name in cfg["grad_x"]:
                    p.grad.mul_(cfg["grad_x"][name])
            if cfg["max_grad_norm"]:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        if not cfg["rec_late"]:
            rec.step(loss=reported, optimizer=opt, grad_norm=None if cfg["clip_no_norm"] else norm)
        opt.step()
        if cfg["rec_late"]:  # misplaced: the parameters have moved already
            rec.step(loss=reported, optimizer=opt, grad_norm=None if cfg["clip_no_norm"] else norm)
        sched.step()
        if s + 1 not in cfg["stale_after"]:
            opt.zero_grad(set_to_none=not cfg["zero_grads"])
        if cfg["bn_rank0"]:  # rank 0's rows move the statistics, every rank receives them
            if rank == 0:
                model.bn.train()
                with torch.no_grad():
                    model(mbs[0]["input_ids"])
                model.bn.eval()
            for b in (model.bn.running_mean, model.bn.running_var, model.bn.num_batches_tracked):
                dist.broadcast(b, 0)
    rec.close()
    dist.barrier()


if __name__ == "__main__":
    sys.exit(plan.main(run))
