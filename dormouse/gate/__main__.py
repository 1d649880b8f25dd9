"""`python -m dormouse.gate`: the distributed gate's driver, runnable by hand.

    python -m dormouse.gate --mode single --out /tmp/g --steps 20 --batch 4
    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m dormouse.gate --mode rank --out /tmp/g --steps 20 --batch 2
    python -m dormouse.gate --mode verdict --out /tmp/g

single: one process at the GLOBAL batch (the reference curve); rank: one
process per rank under torchrun (the fleet); gradref: the hand-computed
token-weighted one-step reference; verdict: compare what the out dir holds.
"""

from __future__ import annotations

import argparse
import sys

from dormouse.__main__ import positive_int
from dormouse.errors import DormouseError


def parser() -> argparse.ArgumentParser:
    from dormouse.gate.fixtures import LR, STEPS, WORLD

    p = argparse.ArgumentParser(prog="python -m dormouse.gate", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", required=True, choices=("single", "rank", "gradref", "verdict"))
    p.add_argument("--out", required=True, help="artifact directory (shared by all modes)")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (gradref: always 1)")
    p.add_argument("--batch", type=int, default=2,
                   help="the config's batch: global for single, per rank for rank/gradref")
    p.add_argument("--capacity", default="", help="per-rank profile, 'B' or 'BxT' per rank: '4,2'")
    p.add_argument("--seed", type=int, default=7, help="model initialisation seed")
    p.add_argument("--lr", type=float, default=LR, help="learning rate")
    p.add_argument("--shard", default="none", choices=("none", "fsdp"), help="FSDP2 sharding of the fleet")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="the rank's device; the gate is cpu (gloo), the owner's check is cuda (nccl)")
    p.add_argument("--opt", default="mix", choices=("mix", "adamw"))
    p.add_argument("--reduce", default="fp32", choices=("fp32", "bf16"), help="gradient all-reduce dtype")
    p.add_argument("--world", type=int, default=WORLD,
                   help="ranks: gradref's profile; recorded by rank mode (torchrun sets the fleet's)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per process")
    p.add_argument("--resume-from", default="", help="checkpoint to continue from (relative to --out, or absolute)")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="gradient all-reduce bucket size (MiB)")
    p.add_argument("--plan", default="", help="rank mode: a JSON list of settings, run one after another")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import torch

        torch.set_num_threads(args.threads)
        if args.mode == "verdict":
            from dormouse.gate.verdict import compare, format_verdict

            verdict = compare(args.out)
            print(format_verdict(verdict))
            return 0 if verdict["pass"] else 1
        from dormouse.gate.modes import MODES, GateSettings

        settings = GateSettings(
            out=args.out, steps=args.steps, batch=args.batch, capacity=args.capacity, seed=args.seed,
            lr=args.lr, shard=args.shard, device=args.device, opt=args.opt, reduce=args.reduce,
            world=args.world, resume_from=args.resume_from, bucket_mb=args.bucket_mb,
        )
        log = print
        if args.mode == "rank":
            import os

            prefix = f"[rank{os.environ.get('RANK', '?')}] "
            log = lambda line: print(prefix + line, flush=True)  # noqa: E731
        if args.plan:
            if args.mode != "rank":
                raise DormouseError("--plan is for --mode rank only")
            from dormouse.gate.modes import load_plan, run_rank_plan

            run_rank_plan(load_plan(args.plan), log=log)
        else:
            MODES[args.mode](settings, log=log)
        return 0
    except DormouseError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
