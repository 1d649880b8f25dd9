"""The fleet half of `python -m dormouse.bench`: one torchrun launch of 2 ranks
(gloo, one thread each) that times, side by side,

- ours: THE loop's step with our gradient synchroniser, FleetSync
  (backward of loss * t_r / T, then sync.reduce: bucketed SUM all-reduce);
- ddp:  torch's DistributedDataParallel on the same model, the same batches and
  the same MixOptimizer (backward of the rank's mean loss, DDP averages while
  backward runs, then one all-reduce of the loss and the expert loads, which
  balance_experts needs summed over the fleet, as FleetSync sums them);
- solo: rank 0 alone runs the single-process step (no collectives) while the
  other ranks wait in a barrier: the one-process rate, for scaling efficiency;
- both: every rank runs that single-process step at once, no collectives: what
  busy processes cost each other on this machine (cores, memory bandwidth),
  so that scaling efficiency = (solo / both) x (both / ours) splits into
  contention and communication.

The four alternate for several rounds (ours and ddp swap places every round);
a step's time is the slowest rank's, and each ratio is the median over rounds
of the ratio of the round's median step times (the ratio of the overall
medians is reported beside it).

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m dormouse.bench_fleet --mode compare --out /tmp/fleet.json
    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m dormouse.bench_fleet --mode rendezvous --out /tmp/rdzv.json

`rendezvous` only joins the fleet (init_process_group + barrier + destroy): the
fixed cost of a launch. The result JSON is written atomically by rank 0.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time

_T_START = time.perf_counter()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dormouse.bench_fleet", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", choices=("compare", "rendezvous"), default="compare")
    p.add_argument("--out", required=True, help="result JSON (written by rank 0)")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8, help="windows per rank (and for the solo process)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4, help="rounds of ours / ddp / both / solo")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each kind per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each kind before the rounds")
    p.add_argument("--seed", type=int, default=0)
    return p


def _rendezvous(args) -> int:
    import torch.distributed as dist

    from dormouse import atomic

    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    dist.barrier()
    t1 = time.perf_counter()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        atomic.write_text(args.out, json.dumps({
            "python_start_to_main_s": t0 - _T_START,
            "init_and_barrier_s": t1 - t0,
        }, indent=1))
    return 0


def _compare(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dormouse import atomic
    from dormouse.config import RunConfig, TrainConfig, preset
    from dormouse.train.data import RankShape
    from dormouse.train.distributed import FleetSync
    from dormouse.train.loop import build_model, make_optimizer

    torch.set_num_threads(1)
    t_import = time.perf_counter() - _T_START
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run = RunConfig(source="bench", model=preset(args.preset),
                    train=TrainConfig(seed=args.seed, batch=args.batch, seq_len=args.seq_len, dist=True))
    run.validate()
    shapes = [RankShape(args.batch, args.seq_len)] * world
    total = sum(s.tokens for s in shapes)
    share = shapes[rank].tokens / total
    lr = run.train.lr

    def batch(kind_seed: int, step: int, r: int):
        g = torch.Generator().manual_seed(((args.seed * 1000 + kind_seed) * 100_003 + step) * 64 + r)
        xy = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()

    phases: dict[str, list[dict[str, float]]] = {"ours": [], "ddp": [], "solo": [], "both": []}
    clock = time.perf_counter

    # ---- ours: FleetSync, exactly the loop's step ------------------------------------
    ours = build_model(run)
    ours_opt = make_optimizer(ours, run)
    sync = FleetSync(shapes, rank, world, reduce=run.train.dist_reduce, sharded=False,
                     bucket_mb=run.train.dist_bucket_mb)
    sync.attach(ours)  # as train_dist does: buckets start during backward
    state = {"ours": 0, "ddp": 0, "solo": 0}
    unused_seen: list[str] = []

    def forward_backward(model, opt, kind: str, kind_seed: int, scale: float):
        """The loop's step up to the synchroniser: fresh batch, zero_grad, backward of loss * scale."""
        x, y = batch(kind_seed, state[kind], rank)
        state[kind] += 1
        opt.set_lr(lr)
        opt.zero_grad()
        _, loss, aux = model(x, y)
        (loss * scale).backward()
        return loss, aux

    def ours_step(record=None):
        t0 = clock()
        loss, aux = forward_backward(ours, ours_opt, "ours", 0, share)
        t1 = clock()
        if not unused_seen and state["ours"] == 1:
            unused_seen.extend(n for n, p in ours.named_parameters() if p.grad is None)
            unused_seen.append("")  # marks "checked"
        loss_share = loss.detach().double() * share
        value, loads = sync.reduce(ours, loss_share, aux["loads"])
        t2 = clock()
        ours_opt.step()
        ours.balance_experts(loads)
        if record is not None:
            record.append({"forward_backward": t1 - t0, "sync_reduce": t2 - t1, "optimizer": clock() - t2})
        return value

    # ---- DDP on the same model, batches and optimizer ------------------------------
    ddp_inner = build_model(run)  # same seed: the same initial parameters as `ours`
    ddp_opt = make_optimizer(ddp_inner, run)
    ddp_holder: dict = {}

    def ddp_step(record=None):
        t0 = clock()
        x, y = batch(0, state["ddp"], rank)  # the same batch stream as ours
        state["ddp"] += 1
        ddp_opt.set_lr(lr)
        ddp_opt.zero_grad()
        _, loss, aux = ddp_holder["ddp"](x, y)
        loss.backward()  # DDP all-reduces AVG during backward: equal shares here, so = our SUM
        t1 = clock()
        stats = torch.cat([(loss.detach().double() * share).reshape(1), aux["loads"].reshape(-1).double()])
        dist.all_reduce(stats)
        t2 = clock()
        ddp_opt.step()
        ddp_inner.balance_experts(stats[1:].view_as(aux["loads"]).to(aux["loads"].dtype))
        if record is not None:
            record.append({"forward_backward_with_overlapped_allreduce": t1 - t0, "loss_loads_allreduce": t2 - t1,
                           "optimizer": clock() - t2})
        return float(stats[0])

    # ---- solo: one process, no collectives ------------------------------------------
    # Rank 0 alone ("solo"), and every rank at once without communication
    # ("both": what two busy processes cost each other on this machine).
    solo = build_model(run)
    solo_opt = make_optimizer(solo, run)

    def solo_step(record=None):
        t0 = clock()
        loss, aux = forward_backward(solo, solo_opt, "solo", 1, 1.0)
        t1 = clock()
        solo_opt.step()
        solo.balance_experts(aux["loads"])
        if record is not None:
            record.append({"forward_backward": t1 - t0, "optimizer": clock() - t1})
        return float(loss.detach())

    # Warm-up; ours first, so we know whether DDP must look for unused parameters.
    for _ in range(max(1, args.warmup)):  # at least one: it finds unused parameters
        ours_step()
    unused = [n for n in unused_seen if n]
    all_unused: list = [None] * world
    dist.all_gather_object(all_unused, unused)
    find_unused = any(all_unused)
    # The routing bias moves identically on every rank from the fleet's summed
    # loads (as with FleetSync): DDP need not broadcast buffers every forward.
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                      else {"broadcast_buffers": False})
    ddp_holder["ddp"] = DDP(ddp_inner, find_unused_parameters=find_unused, **no_buffer_sync)
    for _ in range(max(1, args.warmup)):
        ddp_step()
    for _ in range(max(1, args.warmup)):
        solo_step()
    dist.barrier()

    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"ours": [], "ddp": [], "solo": [], "both": []}
    waiter_cpu_s, waiter_wall_s = 0.0, 0.0
    fns = {"ours": ours_step, "ddp": ddp_step, "both": solo_step}
    for rnd in range(args.rounds):
        order = ("ours", "ddp") if rnd % 2 == 0 else ("ddp", "ours")
        for kind in (*order, "both"):
            dist.barrier()
            for _ in range(args.steps):
                t0 = clock()
                fns[kind](phases[kind])
                times[kind].append(clock() - t0)
        dist.barrier()
        if rank == 0:
            for _ in range(args.steps):
                t0 = clock()
                solo_step(phases["solo"])
                times["solo"].append(clock() - t0)
        else:
            c0, w0 = time.process_time(), clock()
        dist.barrier()  # the other ranks wait here while rank 0 runs alone
        if rank != 0:
            waiter_cpu_s += time.process_time() - c0
            waiter_wall_s += clock() - w0
    load_after = os.getloadavg()

    # Parameters of ours and DDP after the same steps on the same batches.
    with torch.no_grad():
        diffs = [float((a - b).abs().max()) for a, b in zip(ours.parameters(), ddp_inner.parameters())]
        buf_diff = float((ours.state_dict().get("block.moe.router_bias", torch.zeros(1))
                          - ddp_inner.state_dict().get("block.moe.router_bias", torch.zeros(1))).abs().max())
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"times": times, "phases": phases, "waiter_cpu_s": waiter_cpu_s,
                                      "waiter_wall_s": waiter_wall_s})
    del ddp_holder["ddp"]
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0

    def fleet_times(kind):  # a step lasts as long as its slowest rank
        return [max(g["times"][kind][i] for g in gathered) for i in range(len(times[kind]))]

    def phase_medians(kind):
        recs = [r for g in gathered for r in g["phases"][kind]]
        return {k: statistics.median(r[k] for r in recs) for k in recs[0]} if recs else {}

    def per_round(xs):
        return [xs[i:i + args.steps] for i in range(0, len(xs), args.steps)]

    def paired(a, b):  # median over rounds of (round's median of a) / (round's median of b)
        return statistics.median(statistics.median(x) / statistics.median(y)
                                 for x, y in zip(per_round(steps[a]), per_round(steps[b])))

    steps = {"ours": fleet_times("ours"), "ddp": fleet_times("ddp"), "solo": times["solo"],
             "both": fleet_times("both")}
    med = {k: statistics.median(v) for k, v in steps.items()}
    tokens_per_rank = shapes[0].tokens
    result = {
        "preset": args.preset, "world_size": world, "batch_per_rank": args.batch, "seq_len": args.seq_len,
        "tokens_per_rank_step": tokens_per_rank, "rounds": args.rounds, "steps_per_round": args.steps,
        "warmup": args.warmup, "threads_per_rank": torch.get_num_threads(),
        "step_s_median": med, "step_s_all": steps,
        "phase_s_median": {k: phase_medians(k) for k in steps},
        # Headline ratios: per round, the ratio of the round's medians (the two
        # kinds ran seconds apart), then the median over rounds. Robust to load
        # that drifts over tens of seconds on a shared machine, which a ratio
        # of the overall medians is not; both are reported.
        "fleet_vs_ddp": paired("ours", "ddp"),
        "scaling_efficiency": paired("solo", "ours"),
        "fleet_vs_ddp_ratio_of_medians": med["ours"] / med["ddp"],
        "scaling_efficiency_ratio_of_medians": med["solo"] / med["ours"],
        "fleet_tokens_per_s": world * tokens_per_rank / med["ours"],
        "ddp_tokens_per_s": world * tokens_per_rank / med["ddp"],
        "solo_tokens_per_s": tokens_per_rank / med["solo"],
        "ddp_scaling_efficiency": paired("solo", "ddp"),
        # scaling_efficiency ~ contention_efficiency * communication_efficiency
        "contention_efficiency": paired("solo", "both"),
        "communication_efficiency": paired("both", "ours"),
        "ddp_options": {"find_unused_parameters": find_unused, **no_buffer_sync,
                        "bucket_cap_mb": "default (25)", "gradient_as_bucket_view": False},
        "params_without_grad": sorted({n for u in all_unused for n in u}),
        "ours_vs_ddp_max_abs_param_diff": max(diffs) if diffs else 0.0,
        "ours_vs_ddp_router_bias_diff": buf_diff,
        "waiting_ranks_cpu_share_during_solo": [
            g["waiter_cpu_s"] / g["waiter_wall_s"] if g["waiter_wall_s"] else 0.0 for g in gathered[1:]],
        "loadavg_before_after": [load_before, load_after],
        "import_s_rank0": t_import,
    }
    atomic.write_text(args.out, json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run me under torchrun: python -m torch.distributed.run --standalone "
              "--nproc_per_node=2 -m dormouse.bench_fleet ...", file=sys.stderr)
        return 2
    return _rendezvous(args) if args.mode == "rendezvous" else _compare(args)


if __name__ == "__main__":
    sys.exit(main())
