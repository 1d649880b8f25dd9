"""The fleet half of `python -m dormouse.bench`: one torchrun launch (gloo, one
thread per rank) that times THE training loop, `train()`, step by step through
its `on_step` hook, under several synchronisers side by side:

- ours:  train_dist with FleetSync (fp32 bucketed all-reduce), as fleets train;
- ddp:   train() of the model wrapped in torch's DistributedDataParallel, with
         DDPSync: DDP sums gradients while backward runs (a SUM comm hook: the
         loop's backward of L_r t_r / T already carries the weights), and
         reduce() all-reduces the loss and the expert loads;
- solo:  rank 0 alone runs train() with LocalSync at the per-rank batch while
         the other ranks wait in a barrier: one process's rate, for scaling;
- both:  every rank runs that single-process train() at once, no collectives:
         what busy processes cost each other on this machine (cores, memory),
         so scaling = (solo / both) x (both / ours) splits into contention and
         communication;
- ring, exact: train_dist with dist_reduce fp32 and exact at --micro-batch M:
         the exact reduce's cost against the ring's over the same slices.

--kinds picks which. Each round runs every kind once, a fresh train() call of
--warmup untimed and --steps timed steps, in an order that rotates round by
round; a step's time is the slowest rank's. Each ratio is computed per round
(the round's medians, taken seconds apart) and reported as the median over
rounds with its spread (min and max over rounds); the ratio of the overall
medians is reported beside it.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m dormouse.bench.fleet --mode compare --out /tmp/fleet.json
    python -m torch.distributed.run --standalone --nproc_per_node=4 \\
        -m dormouse.bench.fleet --kinds ring,exact --micro-batch 4 --out /tmp/exact.json
    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m dormouse.bench.fleet --mode rendezvous --out /tmp/rdzv.json

`rendezvous` only joins the fleet (init_process_group + barrier + destroy): the
fixed cost of a launch. The result JSON is written atomically by rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

_T_START = time.perf_counter()
KINDS = ("ours", "ddp", "solo", "both", "ring", "exact")
# name: (numerator kind, denominator kind) of a ratio of step times.
RATIOS = {
    "fleet_vs_ddp": ("ours", "ddp"),
    "scaling_efficiency": ("solo", "ours"),
    "ddp_scaling_efficiency": ("solo", "ddp"),
    "contention_efficiency": ("solo", "both"),
    "communication_efficiency": ("both", "ours"),
    "exact_vs_ring": ("exact", "ring"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dormouse.bench.fleet", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", choices=("compare", "rendezvous"), default="compare")
    p.add_argument("--out", required=True, help="result JSON (written by rank 0)")
    p.add_argument("--kinds", default="ours,ddp,both,solo", help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8, help="windows per rank (and for the solo process)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=0, help="train.micro_batch of the ring and exact kinds")
    p.add_argument("--rounds", type=int, default=4, help="rounds of every kind")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each kind per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each train() call")
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


class DDPSync:
    """torch DDP as the loop's synchroniser (LocalSync's interface): the model
    the loop trains is DDP-wrapped, so gradients are summed by DDP's reducer
    during backward; reduce() all-reduces (SUM) the loss share and the loads.
    One slice per rank: DDP would reduce after every micro-batch's backward."""

    sharded = False

    def __init__(self, plan, rank: int):
        self.plan, self.mine = plan, [rank]
        self.rank, self.world_size, self.is_main = rank, plan.world, rank == 0

    def begin_step(self, step, hooks) -> None:
        pass

    def slice_done(self, model, index, loss_part, loads) -> None:
        pass

    def reduce(self, model, loss_share, loads):
        import torch.distributed as dist

        from dormouse.train.exact import split_stats, stats_row

        stats = stats_row(loss_share, loads)
        dist.all_reduce(stats)
        return split_stats(stats, loads)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def clip(self, params, max_norm: float):
        from dormouse.train.loop import clip_grad_norm

        return clip_grad_norm(params, max_norm)

    def agree_on_start(self, start: int) -> None:
        pass


def ddp_model(model, find_unused: bool):
    """`model` in DistributedDataParallel with a plain SUM of gradients, still
    answering the loop's and MixOptimizer's questions (balance_experts,
    hidden_matrices under DDP's "module." names)."""
    import inspect

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    class _DDP(DDP):
        def balance_experts(self, loads):
            self.module.balance_experts(loads)

        def hidden_matrices(self):
            return [f"module.{n}" for n in self.module.hidden_matrices()]

    def sum_hook(_state, bucket):
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])

    # The routing bias moves identically on every rank from the summed loads:
    # DDP need not broadcast buffers every forward.
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                      else {"broadcast_buffers": False})
    wrapped = _DDP(model, find_unused_parameters=find_unused, **no_buffer_sync)
    wrapped.register_comm_hook(None, sum_hook)
    return wrapped, no_buffer_sync


def _compare(args) -> int:
    import torch
    import torch.distributed as dist

    from dormouse import atomic
    from dormouse.config import RunConfig, TrainConfig, preset
    from dormouse.train.data import FleetPlan
    from dormouse.train.distributed import train_dist
    from dormouse.train.loop import LocalSync, build_model, train

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        print(f"error: --kinds {bad} unknown; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t_import = time.perf_counter() - _T_START
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Path(args.out).resolve().parent / f"bench_fleet_w{world}"
    steps = args.warmup + args.steps
    base = RunConfig(source="bench", model=preset(args.preset), train=TrainConfig(
        seed=args.seed, steps=steps, batch=args.batch, seq_len=args.seq_len, log_every=10**6, ckpt_every=0))
    base.validate()
    plan = FleetPlan.make("", world=world, batch=args.batch, seq_len=args.seq_len)

    def run_of(kind: str):
        # Each rank its own out dir: processes that run alone ("both", "solo") each write metrics.
        t = dict(out_dir=str(work / f"{kind}_rank{rank}"), ckpt_name=kind)
        if kind in ("ours", "ring", "exact"):
            t.update(dist=True, dist_reduce="exact" if kind == "exact" else "fp32")
        if kind in ("ring", "exact"):
            t.update(micro_batch=args.micro_batch)
        return dataclasses.replace(base, train=dataclasses.replace(base.train, **t))

    models = {k: build_model(base) for k in kinds if k not in ("solo", "both")}  # the same initial parameters
    models["single"] = build_model(base)
    find_unused = False
    ddp_opts: dict = {}
    if "ddp" in kinds:  # DDP must be told whether some parameter can go without a gradient
        probe = build_model(base)
        _, loss, _ = probe(*(t[:, :args.seq_len] for t in (torch.randint(0, 256, (args.batch, args.seq_len + 1)),) * 2))
        loss.backward()
        flags = [None] * world
        dist.all_gather_object(flags, any(p.grad is None for p in probe.parameters()))
        find_unused = any(flags)
        models["ddp"], ddp_opts = ddp_model(models["ddp"], find_unused)

    times: dict[str, list[list[float]]] = {k: [] for k in kinds}  # per round, this rank's timed steps
    clock = time.perf_counter

    def timed(kind: str) -> list[float]:
        stamps = [clock()]
        on_step = lambda step, model, info: stamps.append(clock())  # noqa: E731
        quiet = lambda line: None  # noqa: E731
        run = run_of(kind)
        if kind in ("ours", "ring", "exact"):
            train_dist(run, log=quiet, model=models[kind], close=False, on_step=on_step)
        elif kind == "ddp":
            train(models["ddp"], run, log=quiet, sync=DDPSync(plan, rank), on_step=on_step)
        else:
            train(models["single"], run, log=quiet, sync=LocalSync(run), on_step=on_step)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return gaps[args.warmup:]

    load_before = os.getloadavg()
    for rnd in range(args.rounds):
        order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
        for kind in order:
            dist.barrier()
            if kind != "solo":
                times[kind].append(timed(kind))
            elif rank == 0:
                times[kind].append(timed(kind))  # the other ranks wait in the barrier below
            dist.barrier()
    load_after = os.getloadavg()

    diffs = {}
    with torch.no_grad():
        if "ours" in kinds and "ddp" in kinds:  # the same calls on the same batches from the same init
            inner = models["ddp"].module
            diffs["ours_vs_ddp_max_abs_param_diff"] = max(
                float((a - b).abs().max()) for a, b in zip(models["ours"].state_dict().values(),
                                                           inner.state_dict().values()))
        if "ring" in kinds and "exact" in kinds:
            diffs["exact_vs_ring_max_abs_param_diff"] = max(
                float((a - b).abs().max()) for a, b in zip(models["ring"].state_dict().values(),
                                                           models["exact"].state_dict().values()))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, times)
    models.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0

    def fleet_rounds(kind):  # a step lasts as long as its slowest rank (solo: rank 0 alone)
        ranks = [gathered[0]] if kind == "solo" else gathered
        return [[max(g[kind][r][i] for g in ranks) for i in range(len(gathered[0][kind][r]))]
                for r in range(args.rounds)]

    rounds = {k: fleet_rounds(k) for k in kinds}
    med = {k: statistics.median(x for rnd in v for x in rnd) for k, v in rounds.items()}
    result = {
        "preset": args.preset, "world_size": world, "batch_per_rank": args.batch, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "kinds": kinds, "tokens_per_rank_step": plan.shapes[0].tokens,
        "rounds": args.rounds, "steps_per_round": args.steps, "warmup": args.warmup,
        "threads_per_rank": torch.get_num_threads(), "timed": "train() steps, between on_step calls",
        "step_s_median": med, "step_s_rounds": rounds,
        "ratios": {},
        "ddp_options": {"find_unused_parameters": find_unused, **ddp_opts, "comm_hook": "SUM all_reduce",
                        "bucket_cap_mb": "default (25)"} if "ddp" in kinds else None,
        **diffs,
        "loadavg_before_after": [load_before, load_after],
        "import_s_rank0": t_import,
    }
    for name, (a, b) in RATIOS.items():
        if a in kinds and b in kinds:
            per_round = [statistics.median(x) / statistics.median(y) for x, y in zip(rounds[a], rounds[b])]
            result[name] = statistics.median(per_round)
            result["ratios"][name] = {"median": statistics.median(per_round), "min": min(per_round),
                                      "max": max(per_round), "per_round": per_round,
                                      "ratio_of_medians": med[a] / med[b]}
    if "ours" in kinds:
        result["fleet_tokens_per_s"] = plan.tokens / med["ours"]
    if "ddp" in kinds:
        result["ddp_tokens_per_s"] = plan.tokens / med["ddp"]
    if "solo" in kinds:
        result["solo_tokens_per_s"] = plan.shapes[0].tokens / med["solo"]
    atomic.write_text(args.out, json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run me under torchrun: python -m torch.distributed.run --standalone "
              "--nproc_per_node=2 -m dormouse.bench.fleet ...", file=sys.stderr)
        return 2
    return _rendezvous(args) if args.mode == "rendezvous" else _compare(args)


if __name__ == "__main__":
    sys.exit(main())
