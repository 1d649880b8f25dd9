"""dormouse: train a byte-level model (one process or a fleet), sample from it, evaluate it, gate it.

    dormouse train --preset tiny --steps 200 --out runs/a
    dormouse train --config runs/a/run.json --set train.steps=400 --resume
    torchrun --standalone --nproc_per_node=2 -m dormouse train --profile 4,2 --out runs/f
    dormouse sample --ckpt runs/a/dormouse.pt --prompt "def " --tokens 200 --seed 0
    dormouse eval --ckpt runs/a/dormouse.pt --data held_out.txt
    dormouse gate ... | pipeline ... | bench ... | soak ...   (their own --help)

`python -m dormouse ...` is the same command. Exit status: 0 done (or the gate
passed), 1 the gate failed, 2 bad input (one line starting "error:"), 3 a run
crashed (one line naming the exception).

This module is the command line only: its parsers and one call per command;
the run is composed by config.build_run and trained by dormouse.train.run;
errors become exit statuses in one place (errors.command_status).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dormouse import __version__
from dormouse.config import DATA_ORDERS, DIST_REDUCES, DIST_SHARDS, PRESETS, TrainConfig, build_run
from dormouse.argtypes import Help, finite_float, non_negative_int, positive_int
from dormouse.errors import EXIT_OK, OneLineParser, command_status

# Subcommands that hand the rest of the command line, unchanged, to their own main(argv).
FORWARDED = {
    "gate": ("dormouse.gate.__main__", "the distributed gate: single | rank | gradref | reference | verdict | check (your own loop)"),
    "pipeline": ("dormouse.gate.pipeline", "the whole gate: notebooks 01-04 and verdict.json"),
    "bench": ("dormouse.bench.core", "measured speed: tokens/s, fleet vs DDP, scaling"),
    "soak": ("dormouse.gate.record.soak", "launch gate fleets back to back and count failures"),
}
CLI_CKPT_EVERY = 50  # `dormouse train` checkpoints by default (TrainConfig's own default is never)
CLI_DATA_ORDER = "shuffle"  # `dormouse train` shuffles the spans per epoch (TrainConfig's own default is sequential)


# ---------------------------------------------------------------- train

# The flags that set a TrainConfig field: (flag, field, type, choices, help). They
# default to "not given", so a --config file's value stands unless a flag says
# otherwise; the help shows the value used without --config.
TRAIN_FLAGS = [
    ("--data", "data", str, None, "corpus file of bytes ('' = the built-in corpus: dormouse's own source)"),
    ("--steps", "steps", int, None, "optimizer steps in all (a resumed run continues up to this)"),
    ("--batch", "batch", int, None, "windows per step (per rank in a fleet without --profile)"),
    ("--seq-len", "seq_len", int, None, "tokens per window (at most the model's max_seq_len)"),
    ("--lr", "lr", float, None, "peak learning rate"),
    ("--seed", "seed", int, None, "seeds the initial parameters and the shuffled data order"),
    ("--data-order", "data_order", str, DATA_ORDERS, "span order per epoch (see dormouse/train/data.py)"),
    ("--out", "out_dir", str, None, "checkpoints, metrics and run.json go here"),
    ("--log-every", "log_every", int, None, "steps between log lines"),
    ("--ckpt-every", "ckpt_every", int, None, "steps between checkpoints, and one at the end (0 = none)"),
    ("--profile", "dist_profile", str, None,
     "fleet: per-rank shapes in rank order, 'B' or 'BxT' each, e.g. 4,2 ('' = --batch on every rank)"),
    ("--shard", "dist_shard", str, DIST_SHARDS, "fleet: none = replicated parameters, fsdp = FSDP2 shards"),
    ("--reduce", "dist_reduce", str, DIST_REDUCES, "fleet: how gradients are summed across ranks"),
    ("--micro-batch", "micro_batch", non_negative_int, None,
     "windows per micro-batch: the step's batch is accumulated in slices of this many (0 = the whole local batch)"),
]


def _cli_train_defaults() -> TrainConfig:
    """The TrainConfig `dormouse train` starts from without --config."""
    return TrainConfig(ckpt_every=CLI_CKPT_EVERY, data_order=CLI_DATA_ORDER)


def _add_train_parser(sub) -> None:
    t = sub.add_parser(
        "train", formatter_class=Help, help="train a model: one process, or a fleet under torchrun",
        description="Train a dormouse model. Alone: `dormouse train ...`. A fleet (data-parallel, "
                    "the same loop): `torchrun --nproc_per_node=N -m dormouse train ...` (a process "
                    "torchrun starts trains as one rank of the fleet; --dist says so explicitly). "
                    "Writes <out>/run.json (the resolved RunConfig, usable as --config; without "
                    "--resume, which belongs to one launch), "
                    "<out>/<ckpt_name>.pt (.dcp sharded) and <out>/<ckpt_name>.metrics.jsonl.")
    t.add_argument("--config", default="", metavar="FILE",
                   help="a RunConfig JSON (e.g. a run's run.json); flags and --set override it")
    t.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="model size, when no --config names the model (default: tiny)")
    defaults = _cli_train_defaults()
    for flag, field, kind, choices, text in TRAIN_FLAGS:
        shown = getattr(defaults, field, None)
        shown = "the built-in corpus" if field == "data" else "''" if shown == "" else shown
        t.add_argument(flag, dest=field, type=kind, choices=choices, default=argparse.SUPPRESS,
                       metavar=None if choices else flag[2:].upper().replace("-", "_"),
                       help=f"{text} (default: {shown!s}; with --config, the file's)"
                       if shown is not None else f"{text} (default: the config's)")
    t.add_argument("--out-dir", dest="out_dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old name
    t.add_argument("--capacity", dest="dist_profile", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old name
    resume = t.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", default=False,
                        help="continue from <out>'s checkpoint if there is one (any world size or sharding; under "
                             "torchrun --max-restarts a restart then continues from the newest checkpoint)")
    resume.add_argument("--resume-from", default="", metavar="CKPT",
                        help="continue from that .pt file or .dcp directory instead, on every launch (the name "
                             "`dormouse gate` gives it too)")
    t.add_argument("--dist", action="store_true", default=argparse.SUPPRESS,
                   help="train as one rank of a fleet: only under torchrun, which it requires (under "
                        "torchrun a fleet is the default: a process torchrun starts is one rank of it)")
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu (a fleet uses gloo) or cuda (one GPU per rank, nccl)")
    t.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per process")
    t.add_argument("--log-dir", default="", metavar="DIR",
                   help="also write every rank's log lines, errors and crash tracebacks to DIR/rank<r>.log "
                        "(default: none; rank 0 prints to stdout and stderr)")
    t.add_argument("--tensorboard", default="", metavar="DIR",
                   help="write loss, lr, tokens/s and eval loss per step as TensorBoard events to DIR "
                        "(rank 0; needs the tracking extra; default: none)")
    t.add_argument("--record", action="store_true",
                   help="record every step for the gate into --out (dormouse.gate.Recorder: micro-batches, "
                        "parameters, gradients, lr, loss; every rank into OUT/rank<r>/); judge it with "
                        "`dormouse gate check --out OUT`, the same directory (default: no recording)")
    t.add_argument("--set", action="append", default=[], metavar="[model.|train.]FIELD=VALUE",
                   help="any ModelConfig or TrainConfig field, e.g. --set model.max_iter=3 "
                        "--set train.opt=adamw (a bare FIELD is a TrainConfig field)")


def run_from_args(args):
    """The run a `train` command line describes (config.build_run: --config or
    --preset, then the flags, then --set; the last word wins)."""
    flags = {field: getattr(args, field) for _, field, *_ in TRAIN_FLAGS if hasattr(args, field)}
    if getattr(args, "dist", False):
        flags["dist"] = True
    if args.resume:
        flags["resume"] = True
    elif args.resume_from:
        flags["resume_from"] = args.resume_from
    return build_run(file=args.config, preset_name=args.preset, flags=flags, sets=args.set,
                     defaults=_cli_train_defaults())


def _train(args) -> int:
    import torch

    from dormouse.train import run

    torch.set_num_threads(args.threads)
    describe = f"config={args.config}" if args.config else f"preset={args.preset or 'tiny'}"
    config = run_from_args(args)
    hooks = None
    if args.record:
        from dormouse.gate.record.dormouse_loop import LoopRecorder

        hooks = LoopRecorder(config.train.out_dir).hooks()
    report = run(config, device=args.device, log_dir=args.log_dir, tensorboard=args.tensorboard,
                 describe=describe, hooks=hooks)
    if args.record and report.get("rank", 0) == 0 and report["final_loss"] is not None:
        out = config.train.out_dir
        print(f"recording in {out}: judge it with `dormouse gate check --out {out}`", flush=True)
    return EXIT_OK


# ---------------------------------------------------------------- sample, eval

def _add_sample_parser(sub) -> None:
    s = sub.add_parser("sample", formatter_class=Help, help="continue a prompt with a trained model",
                       description="Print the continuation of --prompt (bytes decoded as UTF-8, invalid "
                                   "sequences replaced). The same arguments print the same text.")
    s.add_argument("--ckpt", required=True, help="a checkpoint: .pt file (any run) or .dcp directory (sharded)")
    s.add_argument("--prompt", required=True, help="the text to continue (encoded as UTF-8 bytes)")
    s.add_argument("--tokens", type=positive_int, default=200, help="bytes to generate")
    s.add_argument("--temperature", type=finite_float, default=1.0, help="softmax temperature (0 = greedy)")
    s.add_argument("--top-k", type=non_negative_int, default=0, help="draw among the k most likely bytes (0 = all)")
    s.add_argument("--seed", type=int, default=0, help="seeds the draws")
    s.add_argument("--samples", type=positive_int, default=1,
                   help="continuations drawn together as one batch (a step reads the weights once for all of them)")
    s.add_argument("--no-cache", action="store_true", help="recompute the whole text every byte (the reference: much slower; same text)")
    s.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")


def _sample(args) -> int:
    import torch

    from dormouse.infer import sample_text

    torch.set_num_threads(args.threads)
    text = sample_text(args.ckpt, args.prompt, tokens=args.tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed, use_cache=not args.no_cache, samples=args.samples)
    sys.stdout.write(text + "\n")
    return EXIT_OK


def _add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", formatter_class=Help, help="held-out loss of a trained model on a file",
                       description="Print the mean next-byte loss over --data in nats and in bits per byte "
                                   "(bits = nats / ln 2). By default the WHOLE file is scored, as a held-out "
                                   "file should be; --part tail scores only its last train.eval_frac, the "
                                   "tail the checkpoint's run held out of the same corpus. The part is cut "
                                   "into consecutive windows of seq_len + 1 bytes, each predicting its last "
                                   "seq_len bytes; a remainder shorter than a window is not scored.")
    e.add_argument("--ckpt", required=True, help="a checkpoint: .pt file (any run) or .dcp directory (sharded)")
    e.add_argument("--data", required=True, help="file of bytes to score")
    e.add_argument("--part", default="whole", choices=("whole", "tail"),
                   help="whole file, or the eval tail the run held out (its train.eval_frac)")
    e.add_argument("--seq-len", type=positive_int, default=None,
                   help="window length (default: the checkpoint's train.seq_len)")
    e.add_argument("--batch", type=positive_int, default=16, help="windows per forward")
    e.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")


def _eval(args) -> int:
    import torch

    from dormouse.infer import score_file

    torch.set_num_threads(args.threads)
    print(score_file(args.ckpt, args.data, part=args.part, seq_len=args.seq_len, batch=args.batch))
    return EXIT_OK


# ---------------------------------------------------------------- the command

COMMANDS = {"train": _train, "sample": _sample, "eval": _eval}


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dormouse", description=__doc__.splitlines()[0], epilog=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dormouse {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="command",
                           parser_class=OneLineParser)
    _add_train_parser(sub)
    _add_sample_parser(sub)
    _add_eval_parser(sub)
    for name, (_, text) in FORWARDED.items():
        f = sub.add_parser(name, help=f"{text} (see dormouse {name} --help)", add_help=False)
        f.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:  # they parse their own command lines
        forwarded = importlib.import_module(FORWARDED[argv[0]][0]).main
        return command_status(argv[0], lambda: forwarded(argv[1:]))
    args = parser().parse_args(argv)
    return command_status(args.command, lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
