"""`dormouse gate` (also `python -m dormouse.gate`): the distributed gate's
driver, runnable by hand. Every flag is a GateSettings field.

    python -m dormouse.gate single --out /tmp/g
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m dormouse.gate rank --out /tmp/g --leg 1
    python -m torch.distributed.run --standalone --nproc_per_node=1 -m dormouse.gate rank --out /tmp/g --leg 2
    python -m dormouse.gate gradref --out /tmp/g
    python -m dormouse.gate replay --out /tmp/g
    python -m dormouse.gate verdict --out /tmp/g [--json]
    python -m dormouse.gate check --out DIR      # a recording of YOUR loop (dormouse.gate.Recorder)

single: one process at the fleet's GLOBAL batch (the reference curve, its
one-ulp floor and, under --reduce exact, the exact reference); rank: one
process per rank under torchrun (the fleet; by default it stops at half its
steps and resumes at --resume-world ranks, so it is launched twice, --leg 1
and --leg 2; with --resume-world 0 once); gradref: the hand-computed
token-weighted gradient at every step of the fleet's run; replay: the fleet's
run replayed in one process from its recorded gradients; verdict: judge what
the out dir holds; check: judge a recording made by dormouse.gate.Recorder
(making its one-process reference first when missing or stale), print the
verdict, write <out>/verdict.json. (`--mode NAME` is accepted for the mode as well.)

Exit status: 0 the gate passed (or a mode ran), 1 the gate failed, 2 bad
input, 3 a run crashed.
"""

from __future__ import annotations

import argparse
import sys

from dormouse.errors import DormouseError

MODES = ("single", "rank", "gradref", "replay", "verdict")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from dormouse.gate.settings import add_arguments

    p = _Parser(prog="dormouse gate", description=__doc__.splitlines()[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("mode", nargs="?", choices=MODES, help="what to run")
    p.add_argument("--mode", dest="mode_flag", choices=MODES, help=argparse.SUPPRESS)
    add_arguments(p)
    p.add_argument("--plan", default="", help="rank mode: a JSON list of settings, run one after another")
    p.add_argument("--leg", type=int, choices=(0, 1, 2), default=0,
                   help="rank mode, a fleet that stops and resumes (resume_world): which launch this is")
    p.add_argument("--json", action="store_true", help="verdict: also write <out>/verdict.json")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="verdict: also write the per-step divergences and bounds as TensorBoard scalars")
    return p


def _argv(argv: list[str]) -> list[str]:
    """A value that starts with '-' ('--profile -1,2') is still that flag's
    value, so its error names the setting rather than argparse's syntax."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" not in a and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--") and len(argv[i + 1]) > 1:
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def check_main(argv: list[str]) -> int:
    """`dormouse gate check --out DIR`: reference (if missing or stale), judge, show."""
    p = _Parser(prog="dormouse gate check", description="judge a recording of your own training loop")
    p.add_argument("--out", required=True, help="the directory the Recorder wrote")
    p.add_argument("--force", action="store_true", help="remake the one-process reference even if current")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the reference")
    args = p.parse_args(argv)
    try:
        import torch

        from dormouse.gate.judge.recording import judge_recording
        from dormouse.gate.record.reference import make_reference
        from dormouse.gate.show.text import format_verdict, write_verdict

        torch.set_num_threads(args.threads)
        make_reference(args.out, force=args.force, log=lambda line: print(line, file=sys.stderr, flush=True))
        v = judge_recording(args.out)
        write_verdict(v, args.out)
        print(format_verdict(v))
        try:  # the figure, where matplotlib is installed (the [notebooks] extra)
            import matplotlib  # noqa: F401
        except ImportError:
            pass
        else:
            from dormouse.gate.show.plots import render

            for path in render(v, args.out):
                print(f"  figure: {path}")
        return 0 if v.passed else 1
    except DormouseError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # a bug, not bad input: its traceback, then one line
        import traceback

        traceback.print_exc()
        print(f"crashed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3


def main(argv: list[str] | None = None) -> int:
    argv = _argv(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] == "check":
        return check_main(argv[1:])
    args = parser().parse_args(argv)
    mode = args.mode or args.mode_flag
    if mode is None or (args.mode and args.mode_flag and args.mode != args.mode_flag):
        print("error: name one mode: single, rank, gradref, replay or verdict (see dormouse gate --help)",
              file=sys.stderr)
        return 2
    try:
        import torch

        from dormouse.gate.settings import explicit_fields, from_args

        s = from_args(args, explicit_fields(argv))
        torch.set_num_threads(s.threads)
        if mode == "verdict":
            from dormouse.gate.judge.checks import judge
            from dormouse.gate.show.text import format_verdict, write_verdict

            v = judge(s.out_dir, s)
            if args.json:
                write_verdict(v, s.out_dir)
            if args.tensorboard:
                from dormouse.gate.show.text import write_tensorboard

                write_tensorboard(v, args.tensorboard)
            print(format_verdict(v))
            return 0 if v.passed else 1
        from dormouse.gate.record import modes

        log = print
        if mode == "rank":
            import os

            prefix = f"[rank{os.environ.get('RANK', '?')}] "
            log = lambda line: print(prefix + line, flush=True)  # noqa: E731
            if args.plan:
                modes.run_rank_plan(modes.load_plan(args.plan), log=log, leg=args.leg)
            else:
                modes.run_rank(s, log=log, leg=args.leg)
            return 0
        elif args.plan:
            raise DormouseError("--plan is for the rank mode only")
        modes.MODES[mode](s, log=log)
        return 0
    except DormouseError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # a run crashed (a bug, not bad input): its traceback, then one line
        import traceback

        traceback.print_exc()
        print(f"crashed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
