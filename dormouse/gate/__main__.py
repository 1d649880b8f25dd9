"""`dormouse gate` (also `python -m dormouse.gate`): the distributed gate's
driver, runnable by hand -- how the owner checks a real box. Every flag is a
GateSettings field.

    python -m dormouse.gate --mode single --out G --steps 20 --batch 4
    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m dormouse.gate --mode rank --out G --steps 20 --batch 2
    python -m dormouse.gate gradref --out G
    python -m dormouse.gate reference --out G
    python -m dormouse.gate verdict --out G [--json]
    python -m dormouse.gate check --out DIR      # a recording of YOUR loop (dormouse.gate.Recorder)

The out dir is the fleet's recording (rank: one process per rank under
torchrun, recorded through the Recorder); single: one process at the fleet's
GLOBAL batch (the reference curve, its one-ulp floor and, under --reduce
exact, the exact reference), recorded into <out>/reference/; gradref: the
bytes of every step by the data rule's own arithmetic, and the eval losses;
reference: the recording's one-process reference (every step's gradient at
the global batch, the replay of the optimizer); verdict: judge what the out
dir holds; check: judge a recording made by dormouse.gate.Recorder
(making its one-process reference first when missing or stale), print the
verdict, write <out>/verdict.json. `--mode NAME` and the bare NAME are the same.

`--batch` is the batch of the process being launched: single's is the global
batch, a rank's its own (every rank's, unless --profile gives one per rank).
By hand the fleet runs in one launch; `--resume-world N` stops it at half its
steps and resumes it at N ranks (then launch it twice, --leg 1 and --leg 2,
as the pipeline does). gradref, reference and verdict take their settings
from the fleet's recording in --out; a flag given to them overrides its value.

Exit status: 0 the gate passed (or a mode ran), 1 the gate failed, 2 bad
input, 3 a run crashed.
"""

from __future__ import annotations

import argparse
import sys

from dormouse.errors import EXIT_BAD_INPUT, DormouseError, OneLineParser, command_status, end_rank_process

MODES = ("single", "rank", "gradref", "reference", "verdict")


def parser() -> argparse.ArgumentParser:
    from dormouse.gate.cli import BY_HAND_RESUME_WORLD, add_arguments
    from dormouse.gate.settings import _NOT_FLAGS, VALIDATED_FLAG

    p = OneLineParser(prog="dormouse gate", description=__doc__.splitlines()[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("mode", nargs="?", choices=MODES, help="what to run")
    p.add_argument("--mode", dest="mode_flag", choices=MODES, help=argparse.SUPPRESS)
    # Only the flags given reach the namespace: a default never overrides one (cli.by_hand).
    add_arguments(p, skip=_NOT_FLAGS, given_only=True,
                  shown={"resume_world": f"{BY_HAND_RESUME_WORLD} by hand, one launch",
                         "world": "torchrun's WORLD_SIZE for rank, else 2",
                         "profile": "'4,2' unless --batch or --world is given"})
    p.add_argument("--plan", default="", help="rank mode: the launcher's JSON list of {leg, settings}, run one after another")
    p.add_argument("--leg", type=int, choices=(0, 1, 2), default=0,
                   help="rank mode, a fleet that stops and resumes (resume_world): which launch this is")
    # The launcher's mark: the rank's flags (or --plan) come from validated settings (settings.VALIDATED_FLAG).
    p.add_argument(VALIDATED_FLAG, dest="validated", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="verdict: also write <out>/verdict.json")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="verdict: also write the per-step divergences and bounds as TensorBoard scalars")
    return p


def settings_for(mode: str, args: argparse.Namespace):
    """The GateSettings this launch runs with (cli.by_hand): the flags
    given, then the fleet's recorded settings for the modes that check it,
    then the by-hand defaults."""
    import os

    from dormouse.gate.artifacts import RecordingSet, recording_path
    from dormouse.gate.cli import REFERENCE_MODES, by_hand
    from dormouse.gate.settings import FIELDS, resolve_out

    given = {k: getattr(args, k) for k in FIELDS if hasattr(args, k)}
    recorded = None
    out = resolve_out(given.get("out", ""))
    if mode in REFERENCE_MODES and recording_path(out).exists():
        recorded = RecordingSet(out).extra.get("settings")
    world = int(os.environ["WORLD_SIZE"]) if mode == "rank" and "WORLD_SIZE" in os.environ else None
    return by_hand(mode, given, recorded=recorded, world_size=world, validated=args.validated)


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


def huge_pages() -> None:
    """Ask torch's CPU allocator for transparent huge pages (its THP_MEM_ALLOC_ENABLE, read at its first
    allocation: a no-op once torch has allocated, or where the user set it). The check allocates and frees
    gradient-sized tensors step after step, and at size its time went to the kernel: at a 125M Llama
    recording 44 million page faults and 70% of its CPU time; on huge pages, with the heap's freed blocks
    reused (budget.return_freed_memory), 2 million, and the check 160 s -> 78 s with 2 threads (289 s with
    one, before either; `python -m dormouse.bench --scale` measures it against the run)."""
    import os

    from dormouse.gate.budget import HUGE_PAGES

    if "torch" not in sys.modules:  # afterwards it would not take, and return_freed_memory reads it as taken
        os.environ.setdefault(HUGE_PAGES, "1")


def check_main(argv: list[str]) -> int:
    """`dormouse gate check --out DIR`: reference (if missing or stale), judge, show."""
    p = OneLineParser(prog="dormouse gate check", description="judge a recording of your own training loop")
    p.add_argument("--out", required=True, help="the directory the Recorder wrote")
    p.add_argument("--force", action="store_true", help="remake the one-process reference even if current")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the reference")
    p.add_argument("--follow", action="store_true",
                   help="beside a running fleet (or after it): judge each step with the checks that need no reference "
                        "as its ranks write it, one line a step; exit 1 at the first failing step; once the run "
                        "closes its recording, the full check")
    p.add_argument("--from", dest="start", type=int, default=1, metavar="K", help="--follow: the first step judged")
    p.add_argument("--every", type=int, default=1, metavar="N", help="--follow: judge every N-th step")
    p.add_argument("--wait", type=float, default=600.0, metavar="S",
                   help="--follow: seconds with nothing new from the run before it is taken for gone (exit 2)")
    p.add_argument("--memory", type=float, default=None, metavar="GB",
                   help="the memory the check may hold, in GB (default: 80%% of what the machine has available; "
                        "0: no limit); past it the verdict says 'not judged: needs N GB'")
    args = p.parse_args(argv)
    if args.memory is not None and args.memory < 0:
        p.error(f"--memory {args.memory:g}: give the GB the check may hold (0: no limit)")
    # the user's builders are imported as `python -m` imports a module: from the working directory first
    # (the console script's sys.path starts at its own folder, not the one it is run from)
    import os

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    huge_pages()
    if not args.follow and (args.start != 1 or args.every != 1):
        p.error("--from and --every go with --follow")
    return command_status("gate check", lambda: _follow(args) if args.follow else _check(args), traceback=True)


def _follow(args) -> int:
    """`gate check --follow`: the steps as they come (judge/follow.py), then the full check once closed."""
    import torch

    from dormouse.gate.judge.follow import follow

    torch.set_num_threads(args.threads)
    got = follow(args.out, start=args.start, every=args.every, wait=args.wait,
                 log=lambda line: print(line, flush=True))
    if got.failed is not None:
        print(f"FAIL at step {got.failed}: {got.reason}", flush=True)
        return 1
    print(f"the run closed its recording; {got.steps} step(s) judged while it trained, none failing what a step "
          "is judged by without a reference; the full check against the one-process reference decides:",
          flush=True)
    return _check(args)


def _check(args) -> int:
    import torch

    from dormouse.gate.pipeline import check_recording, check_sharded, sharded_launch
    from dormouse.gate.show.text import format_verdict

    torch.set_num_threads(args.threads)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if sharded_launch():  # under torchrun: the reference sharded over the ranks; rank 0 shows the verdict
        v = check_sharded(args.out, force=args.force, log=log)
        if v is None:
            return 0
    else:
        v = check_recording(args.out, force=args.force, log=log,
                            memory=None if args.memory is None else int(args.memory * (1 << 30)))
    status = 0 if v.passed else 1
    try:
        print(format_verdict(v), flush=True)
        try:  # the figures, where matplotlib is installed (the [notebooks] extra)
            import matplotlib  # noqa: F401
        except ImportError:
            pass
        else:
            from dormouse.gate.show.plots import render_recording

            for path in render_recording(v, args.out):
                print(f"  figure: {path}", flush=True)
    except BrokenPipeError:  # `dormouse gate check ... | head -1`: the reader has what it wanted
        quiet_stdout()
    return status


def quiet_stdout() -> None:
    """stdout to /dev/null: the pipe it wrote to is closed, and Python's flush at exit must not complain."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    argv = _argv(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] == "check":
        return check_main(argv[1:])
    args = parser().parse_args(argv)
    mode = args.mode or args.mode_flag
    if mode is None or (args.mode and args.mode_flag and args.mode != args.mode_flag):
        print("error: name one mode: single, rank, gradref, reference or verdict (see dormouse gate --help)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    return command_status("gate", lambda: _run(mode, args), traceback=True)


def _run(mode: str, args) -> int:
    import torch

    s = settings_for(mode, args)
    torch.set_num_threads(s.threads)
    if mode == "verdict":
        from dormouse.gate.judge.entry import judge
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

    if mode == "rank":
        import os

        from dormouse.gate.record.launcher import hold_for_go

        hold_for_go()  # a launch started before the one it follows ended: wait for that one to succeed
        prefix = f"[rank{os.environ.get('RANK', '?')}] "
        log = lambda line: print(prefix + line, flush=True)  # noqa: E731
        if args.plan:
            plan, legs = modes.load_plan(args.plan, validated=args.validated)
            modes.run_rank_plan(plan, log=log, leg=legs)
        else:
            modes.run_rank(s, log=log, leg=args.leg)
        return 0
    if args.plan:
        raise DormouseError("--plan is for the rank mode only")
    if mode == "reference":
        from dormouse.gate.record.reference import make_reference

        make_reference(s.out_dir, log=print)
        return 0
    modes.MODES[mode](s, log=print)
    return 0


if __name__ == "__main__":
    status = main()
    if sys.argv[1:2] == ["rank"] or "--mode=rank" in sys.argv or sys.argv[1:3] == ["--mode", "rank"]:
        end_rank_process(status)  # a rank in an interpreter of its own ends without module teardown
    sys.exit(status)
