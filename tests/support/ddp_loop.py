"""A researcher's plain data-parallel loop, recorded for the gate: DDP (or
FSDP2) with gradient accumulation over variable-length padded sequences,
AdamW with an lr schedule, clipping, checkpoint and resume. Run under torchrun
(gloo): `torchrun --standalone --nproc_per_node=2 ddp_loop.py --plan PLAN.json`
where PLAN is a JSON list of runs, each a dict (see RUN), run one after another
in the same process group.

The gate's lines are the three `rec.` calls. Faults enter through the explicit
hooks below (`loss_of`, `scale_of`, `after_sync`, ...) selected by each run's "fault":
  clean            the global token mean: loss_sum * W / N_global (DDP averages over ranks)
  micro_mean       the mean of per-micro-batch token means (HF, 2024)
  comp_twice       world-size compensation applied twice (loss * W * W / N)
  comp_none        ... and not at all (loss / N)
  local_count      each rank normalises by its own token count
  same_data        every rank reads the same data (no DistributedSampler)
  bn               BatchNorm without SyncBN
  dropout          dropout active, each rank its own RNG
  clip_local       clipping by each rank's local norm (DDP: before a hand-written all-reduce;
                   FSDP2: by the norm of this rank's gradient shards alone)
  unused_zero      zero gradients written for an unused parameter, with weight decay
  resume_drop_sched  the resume drops the lr scheduler's state
  resume_noopt     the resume loads the scheduler's state and not the optimizer's
  resume_nomoments the same, the lr put right by hand: only Adam's moments and step count dropped
  loss_rank_mean   the logged loss is a mean of rank means (the gradient is right)
  resume_data      the resume restarts the epoch's data order from its beginning
  rank_lr          rank 1's optimizer has another lr (the ranks drift apart)
  rank_sched       rank 1's scheduler stepped once more after step 1 (its lr a step ahead from step 2 on)
  double_step      at step 2 the optimizer stepped twice (the second with no backward, on the same gradients)
  noclip_declared  the Recorder is told max_grad_norm, the loop never clips (and reports no norm)
  clip_half        the loop clips at half the declared max_grad_norm (and reports its norm)
  clip_tenth       the loop clips at a tenth of the declared max_grad_norm (and reports its norm)
  sched_before_step  the scheduler stepped after rec.step() and before optimizer.step() (each step taken at
                   the next step's lr)
  group_lr         ln1.bias in a param group of its own at twice the lr (build_optimizer's has one group)
The reviewer's faults (tests/gate/catches/test_ddp_loops_written_from_the_docs.py):
  rank1_eps        rank 1 scales its loss by 1 + eps (cfg "eps")
  bias_x2          after the all-reduce, one small tensor's gradient (ln1.bias) doubled on every rank
  bias_eps         ... ln1.bias's gradient scaled by 1 + eps (cfg "eps") on every rank
  row_x2           after the all-reduce, one row of tok.weight's gradient doubled on every rank
  no_shift         the loop's loss compares logits with UNshifted labels (objective declared causal_lm)
  double_shift     ... with labels shifted by two
  sched_twice      the scheduler stepped twice per optimizer step
  wd_wrong         the loop's optimizer has weight decay x1.001 (build_optimizer's not)
  fwd_no_bwd       the last micro-batch is forwarded but its loss is never backpropagated
  late_x15         at step 2 only, every rank scales its loss by 1.5 (non-tensor step when every > 1)
  rank1_growing    rank 1 scales its loss by 1 + eps (k - 1) at step k: right at step 1, worse every step after
  dup_data         a clean loop over a dataset with duplicate rows (data[2j+1] == data[2j])
  nograd_log       a clean loop that also runs a no_grad forward in train mode to log a probe loss
  rank1_fp32       (with autocast) rank 1 runs its forward without the autocast the others run under
The second reviewer's knobs (tests/gate/catches/test_reduced_precision_loops.py), cfg keys, not faults:
  "model"          {"kind": ...}: loopmodel:build_review_model with those kwargs (FlatLM, HeadAutocastLM, AmpLM)
  "ac_dtype"       the autocast dtype ("bfloat16"; "float16")
  "loss_outside"   the cross-entropy computed outside the autocast (on the forward's bfloat16 logits)
  "patch_forward"  the loop runs no autocast; the inner model's forward is wrapped in one (accelerate's way)
  "ac_steps"       the steps (1-based) autocast is on, every rank alike (None: all)
  "ac_micro"       the micro-batches (0-based) autocast is on, every rank and step alike (None: all)
A third review's knob:
  "eval_modules"   submodules the loop puts in eval mode (["bn"]: a frozen BatchNorm; ["drop"]: dropout off)
  "eval_rank"      only this rank applies "eval_modules" (None: every rank); "" is the model (model.eval())
  "rank1_p"        rank 1 sets its dropout's p to this before the Recorder starts (None: not)
  "dropout"        TinyLM's dropout at this p, each rank its own RNG (the fault "dropout" at p 0.1), beside any fault
  "freeze"         parameters the script freezes (requires_grad False) after build_model
  "fsdp_layers"    (with fsdp) qkv, fc and out sharded as modules of their own, reshard_after_forward=False
  "left_pad"       rows padded on the left (attention_mask 0 there); TinyLM's positions are absolute
  "position_ids"   the loop passes each row's positions as the forward's position_ids (not a Recorder input)
The judge's cause-naming knobs (tests/gate/catches/test_named_causes.py), cfg keys:
  "nan"            {"step": s, "rank": r, "where": "grad" | "loss"}: at step s rank r writes a NaN into
                   one element of ln1.bias's synchronised gradient ("grad"), or multiplies its loss by NaN
                   ("loss": the all-reduce spreads it, and the logged loss is NaN)
  "count"          how the loop counts the step's tokens it divides by: "targets" (right), "padding"
                   (every label position, padding counted), "unshifted" (labels != -100 before the shift:
                   one extra target per row), "rank0" (rank 0's own count x W, broadcast and used by all),
                   "previous" (the previous step's global count, kept; the first step its own)
  "no_sync_all"    DDP's no_sync on every micro-batch: the gradients are never all-reduced
  "bf16_hook"      a line-for-line copy of torch's bf16_compress_hook (gloo refuses torch's own)
  "rank_seed"      (FSDP2) each rank builds the model from seed + rank: no broadcast, other parameters
  "rank_ids"       (with "ids") the example ids passed are the sampler's + rank x n (distinct per rank)
  "pad_to"         every micro-batch right-padded to this length (labels -100, attention_mask 0 there):
                   the same padded length on every rank (with "count": "padding", equal padding)
  "fixed_len"      every row cut to this many tokens (every row holds at least 3): no padding, every
                   micro-batch the same token count
  "short_last"     the run's last step reads K - 1 micro-batches (an epoch's short end); the loop's
                   normalisation is left as it is (micro_mean still divides by K there)
  "wire"           RecordingSpec(wire=...): "bf16" declares the bf16 wire (with "bf16_hook")
fault "wire_decay": (with "bf16_hook") the hook folds an extra weight decay into each rank's gradient before
                   compressing it, g_r += 0.05 W u |g_r| sign(p) (u = 2^-8): a bias inside the wire's bound
and the fault
  last_k_twice     the last micro-batch's loss divided by K once more (the accumulation's 1/K applied twice
                   to it, on top of the step's normalisation the others get)
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
from loopmodel import VOCAB, build_model, build_optimizer, collate, dataset  # noqa: E402
from loopmodel import T as TLEN  # noqa: E402  the position table's length

from dormouse.gate import Recorder, RecordingSpec  # noqa: E402

RUN = {"out": "", "fault": "clean", "seed": 0, "steps": 6, "stop_at": 0, "leg": 0, "fsdp": False,
       "micro": 3, "batch": 2, "n": 48, "max_grad_norm": 1.0, "sketch": 0, "every": 1, "lr": 1e-2, "eps": 0.0,
       "ids": False, "epoch": False,  # ids / epoch: pass rec.step(example_ids=...) / rec.step(epoch=...)
       "autocast": False,  # the forward and the loss under torch.autocast("cpu", torch.bfloat16)
       "model": None, "ac_dtype": "bfloat16", "loss_outside": False, "patch_forward": False, "ac_steps": None,
       "ac_micro": None, "eval_modules": [], "freeze": [],
       "position_ids": False, "fsdp_layers": False, "left_pad": False,
       "eval_rank": None, "nan": None, "count": "targets", "no_sync_all": False, "bf16_hook": False,
       "rank_seed": False, "rank_ids": False, "wire": "fp32", "pad_to": 0,
       "fixed_len": 0, "short_last": False, "dropout": 0.0, "rank1_p": None}  # the forward and the loss under torch.autocast("cpu", torch.bfloat16)


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


def shift_of(fault: str) -> int:
    """How far the loop shifts the labels against the logits (causal LM: 1)."""
    return {"no_shift": 0, "double_shift": 2}.get(fault, 1)


def scale_of(fault: str, rank: int, step: int, eps: float) -> float:
    """A factor on this rank's loss at this step (1: none)."""
    if fault == "rank1_eps" and rank == 1:
        return 1.0 + eps
    if fault == "late_x15" and step == 2:
        return 1.5
    if fault == "rank1_growing" and rank == 1:
        return 1.0 + eps * (step - 1)
    return 1.0


def after_sync(fault: str, model, eps: float) -> None:
    """What the loop does to the synchronised gradients, before clipping."""
    if fault == "bias_x2":
        model.ln1.bias.grad *= 2
    if fault == "bias_eps":
        model.ln1.bias.grad *= 1 + eps
    if fault == "row_x2":
        model.tok.weight.grad[3] *= 2
    if fault == "unused_zero":
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)


def data_of(fault: str, n: int, seed: int) -> list[torch.Tensor]:
    """The dataset the loop reads."""
    d = dataset(n, seed)
    if fault == "dup_data":
        d = [d[2 * (i // 2)] for i in range(n)]
    return d


def clip_local(model, mgn: float, fsdp: bool, world: int):
    """Clip by this rank's own norm: DDP, before the hand-written all-reduce
    (then averaged); FSDP2, by the norm of this rank's gradient shards."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not fsdp:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), mgn)
        for g in grads:
            dist.all_reduce(g)
            g /= world
        return norm
    norm = torch.sqrt(sum((g.to_local().double() ** 2).sum() for g in grads)).float()
    coef = min(1.0, mgn / (float(norm) + 1e-6))
    for g in grads:
        g.mul_(coef)
    return norm


def bf16_wire_hook(process_group, bucket):
    """torch's bf16_compress_hook (default_hooks._compress_hook), line for line, under another name (DDP refuses
    that name without NCCL)."""
    group_to_use = process_group if process_group is not None else dist.group.WORLD
    world_size = group_to_use.size()
    buffer = bucket.buffer()
    compressed_tensor = buffer.to(torch.bfloat16).div_(world_size)

    def decompress(fut):
        decompressed_tensor = buffer
        value = fut if isinstance(fut, torch.Tensor) else fut.value()[0]
        decompressed_tensor.copy_(value)
        return decompressed_tensor

    fut = dist.all_reduce(compressed_tensor, group=group_to_use, async_op=True).get_future()
    return fut.then(decompress)


def bf16_wire_decay_hook(process_group, bucket):
    """bf16_wire_hook after adding 0.05 W u |g| sign(p) to this rank's gradient (an extra weight decay
    folded into the compress step): the result stays bfloat16-valued, inside the wire's bound, and biased."""
    world = (process_group if process_group is not None else dist.group.WORLD).size()
    with torch.no_grad():
        for q, g in zip(bucket.parameters(), bucket.gradients()):
            g.add_(0.05 * world * 2.0**-8 * g.abs() * torch.sign(q))
    return bf16_wire_hook(process_group, bucket)


def count_of(how: str, mb: dict, sh: int) -> int:
    """The tokens the loop counts in one micro-batch (the right count: the shifted labels' targets)."""
    if how == "padding":
        return int(mb["labels"][:, sh:].numel())
    if how == "unshifted":
        return int((mb["labels"] != -100).sum())
    return int((mb["labels"][:, sh:] != -100).sum())


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
    kw = {"seed": cfg["seed"] + (rank if cfg["rank_seed"] else 0), "bn": fault == "bn",
          "dropout": 0.1 if fault == "dropout" else cfg["dropout"],
          "unused": fault == "unused_zero", "lr": cfg["lr"]}
    builder = "loopmodel:build_model"
    if cfg["model"]:
        from loopmodel import build_review_model

        kw.update(cfg["model"])
        builder = "loopmodel:build_review_model"
        model = build_review_model(**kw)
    else:
        model = build_model(**kw)
    for name in cfg["freeze"]:  # frozen in the training script, not by build_model
        model.get_submodule(name.rpartition(".")[0]).get_parameter(name.rpartition(".")[2]).requires_grad_(False)
    for name in cfg["eval_modules"] if cfg["eval_rank"] in (None, rank) else ():  # the loop's own modes
        model.get_submodule(name).eval()  # a frozen BatchNorm, a dropout switched off
    if cfg["patch_forward"]:  # accelerate's convert_outputs/autocast: the module's own forward enters autocast
        model.forward = torch.autocast("cpu", dtype=getattr(torch, cfg["ac_dtype"]))(model.forward)
    if cfg["fsdp"]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mp = {}
        if cfg.get("fsdp_mp"):  # FSDP2's mixed precision: bfloat16 compute, float32 reduce and master weights
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        mesh = init_device_mesh("cpu", (world,))
        if cfg["fsdp_layers"]:  # each linear layer its own FSDP2 module, kept unsharded after its forward
            for sub in (model.qkv, model.fc, model.out):
                fully_shard(sub, mesh=mesh, reshard_after_forward=False, **mp)
        fully_shard(model, mesh=mesh, **mp)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=kw["unused"])
        if cfg["bf16_hook"]:
            net.register_comm_hook(None, bf16_wire_decay_hook if fault == "wire_decay" else bf16_wire_hook)
    opt, sched = build_optimizer(model, **kw)
    if fault == "wd_wrong":
        for group in opt.param_groups:
            group["weight_decay"] *= 1.001
    if fault == "group_lr":  # the loop's own optimizer: ln1.bias's group at twice the lr
        from loopmodel import lr_factor

        split = [[p for n, p in model.named_parameters() if (n == "ln1.bias") == own] for own in (False, True)]
        opt = torch.optim.AdamW([{"params": split[0]}, {"params": split[1], "lr": 2 * cfg["lr"]}], lr=cfg["lr"],
                                weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    start, stop = 0, cfg["steps"]
    if cfg["leg"] == 1:
        stop = cfg["stop_at"]
    elif cfg["leg"] == 2:
        ck = torch.load(out / "ckpt.pt", weights_only=False)
        model.load_state_dict(ck["model"])
        if fault not in ("resume_noopt", "resume_nomoments"):
            opt.load_state_dict(ck["opt"])
        if fault != "resume_drop_sched":
            sched.load_state_dict(ck["sched"])
        if fault == "resume_nomoments":  # the lr put right by hand; Adam's moments start afresh
            for group, lr in zip(opt.param_groups, sched.get_last_lr()):
                group["lr"] = lr
        start = ck["step"]
    if cfg["rank1_p"] is not None and rank == 1:  # a module attribute one rank set before the Recorder
        model.drop.p = cfg["rank1_p"]
    if kw["dropout"]:  # each rank its own masks
        torch.manual_seed(1234 + rank)
    if fault == "rank_lr" and rank == 1:
        for group in opt.param_groups:
            group["lr"] *= 1.01
    rec = Recorder(out, net, RecordingSpec(build_model=builder, build_optimizer="loopmodel:build_optimizer",
                                           objective="causal_lm", max_grad_norm=mgn, dataset_len=n, build_kwargs=kw,
                                           sketch=cfg["sketch"], every=cfg["every"],
                                           start=start if cfg["leg"] == 2 else 0, wire=cfg["wire"]))
    data = data_of(fault, n, cfg["seed"])
    if cfg["fixed_len"]:
        data = [r[:cfg["fixed_len"]] for r in data]
    per_epoch = n // (world * K * B)  # DistributedSampler and DataLoader with drop_last
    sh = shift_of(fault)
    kept = None  # "previous": the step before's global count
    for s in range(start, stop):
        epoch, j = divmod(s - start if fault == "resume_data" else s, per_epoch)
        idx = order_of(fault, n, world, rank, cfg["seed"], epoch)[j * K * B:(j + 1) * K * B]
        k_s = K - 1 if cfg["short_last"] and s == stop - 1 else K  # the micro-batches this step reads
        mbs = [collate([data[i] for i in idx[m * B:(m + 1) * B]]) for m in range(k_s)]
        if cfg["left_pad"]:  # each row's padding moved before it (its tokens at the right end)
            for mb in mbs:
                shift = (mb["attention_mask"] == 0).sum(1).tolist()
                for key in ("input_ids", "attention_mask", "labels"):
                    mb[key] = torch.stack([row.roll(sh) for row, sh in zip(mb[key], shift)])
        if cfg["pad_to"]:  # padded to one fixed length on every rank
            for mb in mbs:
                extra = cfg["pad_to"] - mb["input_ids"].shape[1]
                for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
                    mb[key] = F.pad(mb[key], (0, extra), value=fill)
        if cfg["position_ids"]:  # each row's positions start at its length mod 3 (a forward keyword the gate
            for mb in mbs:       # must record without being told: it is not among RecordingSpec(inputs=...))
                t = mb["input_ids"].shape[1]
                start = mb["attention_mask"].sum(1, keepdim=True) % 3
                mb["position_ids"] = (torch.arange(t) + start).clamp(max=TLEN - 1)
        counts = [count_of(cfg["count"], mb, sh) for mb in mbs]
        n_local = sum(counts)
        n_global = torch.tensor(n_local)
        if cfg["count"] == "rank0":  # rank 0's count, broadcast, taken for every rank's
            dist.broadcast(n_global, 0)
            n_global *= world
        else:
            dist.all_reduce(n_global)
        n_global = int(n_global)
        if cfg["count"] == "previous":  # the count of the step before divides this step's loss
            n_global, kept = kept or n_global, n_global
        manual = fault == "clip_local"
        c = scale_of(fault, rank, s + 1, cfg["eps"])
        local_sum = torch.zeros(())
        for m, mb in enumerate(mbs):
            last = m == k_s - 1
            if cfg["fsdp"]:
                model.set_requires_gradient_sync(last)
                ctx = contextlib.nullcontext()
            else:
                ctx = net.no_sync() if (manual or not last or cfg["no_sync_all"]) else contextlib.nullcontext()
            with ctx:
                precision = cfg["autocast"] and not (fault == "rank1_fp32" and rank == 1)
                precision = precision and (cfg["ac_steps"] is None or s + 1 in cfg["ac_steps"])
                precision = precision and (cfg["ac_micro"] is None or m in cfg["ac_micro"])
                with torch.autocast("cpu", dtype=getattr(torch, cfg["ac_dtype"]), enabled=precision):
                    logits = net(**mb)
                with torch.autocast("cpu", dtype=getattr(torch, cfg["ac_dtype"]),
                                    enabled=precision and not cfg["loss_outside"]):
                    T = logits.shape[1]
                    loss_sum = F.cross_entropy(logits[:, :T - sh].reshape(-1, VOCAB),
                                               mb["labels"][:, sh:].reshape(-1), ignore_index=-100, reduction="sum")
                nan = cfg["nan"] or {}
                if nan.get("where") == "loss" and (s + 1, rank) == (nan["step"], nan["rank"]):
                    loss_sum = loss_sum * float("nan")  # backpropagated and logged: the all-reduce spreads it
                if fault == "fwd_no_bwd" and last:  # its backward is lost, but DDP must still sync: a zero one
                    (logits.sum() * 0).backward()
                else:
                    loss = loss_of(fault, loss_sum, counts[m], n_local, n_global, world, K) * c
                    if fault == "last_k_twice" and last:
                        loss = loss / K
                    loss.backward()
            local_sum += loss_sum.detach()
        if fault == "nograd_log":  # a probe loss for the log: a train-mode forward without gradients
            with torch.no_grad():
                net(**mbs[0])
        reported = reported_of(fault, local_sum, n_local, n_global, world)
        after_sync(fault, model, cfg["eps"])
        if cfg["nan"] and cfg["nan"]["where"] == "grad" and (s + 1, rank) == (cfg["nan"]["step"], cfg["nan"]["rank"]):
            model.ln1.bias.grad[0] = float("nan")
        norm = None
        if manual:
            norm = clip_local(model, mgn, cfg["fsdp"], world)
        elif mgn and fault != "noclip_declared":  # clip_half, clip_tenth: another threshold than the declared one
            at = mgn / 2 if fault == "clip_half" else mgn / 10 if fault == "clip_tenth" else mgn
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), at)
        ids = torch.tensor(idx) + (rank * n if cfg["rank_ids"] else 0)  # rank_ids: distinct whatever was read
        rec.step(loss=reported, optimizer=opt, grad_norm=norm, example_ids=ids if cfg["ids"] else None,
                 epoch=epoch if cfg["epoch"] else None)
        if fault == "sched_before_step":
            sched.step()
        opt.step()
        if fault == "double_step" and s + 1 == 2:
            opt.step()  # a second optimizer step, no backward between: on the same gradients
        if fault != "sched_before_step":
            sched.step()
        if fault == "sched_twice" or (fault == "rank_sched" and rank == 1 and s + 1 == 1):
            sched.step()
        opt.zero_grad(set_to_none=True)
    if cfg["leg"] == 1 and rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "step": stop}, out / "ckpt.pt")
    rec.close()
    dist.barrier()


if __name__ == "__main__":
    sys.exit(plan.main(run))
