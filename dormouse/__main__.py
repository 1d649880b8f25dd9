"""dormouse: train a byte-level model (one process or a fleet), sample from it, evaluate it, gate it.

    dormouse train --preset tiny --steps 200 --out runs/a
    dormouse train --config runs/a/run.json --set train.steps=400 --resume
    torchrun --standalone --nproc_per_node=2 -m dormouse train --dist --capacity 4,2 --out runs/f
    dormouse sample --ckpt runs/a/dormouse.pt --prompt "def " --tokens 200 --seed 0
    dormouse eval --ckpt runs/a/dormouse.pt --data held_out.txt
    dormouse gate ... | pipeline ... | bench ... | soak ...   (their own --help)

`python -m dormouse ...` is the same command. Exit status: 0 done (or the gate
passed), 1 the gate failed, 2 bad input (one line starting "error:"), 3 a run
crashed (one line naming the exception).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import traceback
from pathlib import Path
from unittest import mock

from dormouse import __version__
from dormouse.config import DATA_ORDERS, DIST_REDUCES, DIST_SHARDS, PRESETS, ModelConfig, RunConfig, TrainConfig, preset
from dormouse.errors import ConfigError, DormouseError, FleetError

# Subcommands that hand the rest of the command line, unchanged, to their own main(argv).
FORWARDED = {
    "gate": ("dormouse.gate.__main__", "the distributed gate: single | rank | gradref | replay | verdict"),
    "pipeline": ("dormouse.gate.pipeline", "the whole gate: notebooks 01-04 and verdict.json"),
    "bench": ("dormouse.bench.core", "measured speed: tokens/s, fleet vs DDP, scaling"),
    "soak": ("dormouse.gate.record.soak", "launch gate fleets back to back and count failures"),
}
EXIT_OK, EXIT_BAD_INPUT, EXIT_CRASHED = 0, 2, 3
CLI_CKPT_EVERY = 50  # `dormouse train` checkpoints by default (TrainConfig's own default is never)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line starting with "error:" (status 2),
    like every other input error of this command."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; descriptions keep their line breaks.
    An empty default (a switch that is off, an unset path) is left unsaid: the
    help text says what leaving it out means."""

    def _get_help_string(self, action):
        if action.default in ("", None, False, []):
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


# ---------------------------------------------------------------- train

# The flags that set a TrainConfig field: (flag, field, type, choices, help). They
# default to "not given", so a --config file's value stands unless a flag says
# otherwise; the help shows the value used without --config.
TRAIN_FLAGS = [
    ("--data", "data", str, None, "corpus file of bytes ('' = the built-in corpus: dormouse's own source)"),
    ("--steps", "steps", int, None, "optimizer steps in all (a resumed run continues up to this)"),
    ("--batch", "batch", int, None, "windows per step (per rank in a fleet without --capacity)"),
    ("--seq-len", "seq_len", int, None, "tokens per window (at most the model's max_seq_len)"),
    ("--lr", "lr", float, None, "peak learning rate"),
    ("--seed", "seed", int, None, "seeds the initial parameters and the shuffled data order"),
    ("--data-order", "data_order", str, DATA_ORDERS, "span order per epoch (see dormouse/train/data.py)"),
    ("--out", "out_dir", str, None, "checkpoints, metrics and run.json go here"),
    ("--log-every", "log_every", int, None, "steps between log lines"),
    ("--ckpt-every", "ckpt_every", int, None, "steps between checkpoints, and one at the end (0 = none)"),
    ("--capacity", "dist_capacity", str, None,
     "fleet: per-rank shapes in rank order, 'B' or 'BxT' each, e.g. 4,2 ('' = --batch on every rank)"),
    ("--shard", "dist_shard", str, DIST_SHARDS, "fleet: none = replicated parameters, fsdp = FSDP2 shards"),
    ("--reduce", "dist_reduce", str, DIST_REDUCES, "fleet: how gradients are summed across ranks"),
    ("--micro-batch", "micro_batch", positive_int, None,
     "windows per micro-batch: the step's batch is accumulated in slices of this many"),
]


def _cli_train_defaults() -> TrainConfig:
    """The TrainConfig `dormouse train` starts from without --config."""
    return TrainConfig(ckpt_every=CLI_CKPT_EVERY)


def _add_train_parser(sub) -> None:
    t = sub.add_parser(
        "train", formatter_class=_Help, help="train a model: one process, or a fleet under torchrun",
        description="Train a dormouse model. Alone: `dormouse train ...`. A fleet (data-parallel, "
                    "the same loop): `torchrun --nproc_per_node=N -m dormouse train --dist ...`. "
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
    t.add_argument("--resume", nargs="?", const=True, default=False, metavar="CKPT",
                   help="continue from <out>'s checkpoint if there is one (any world size or sharding); "
                        "--resume CKPT continues from that .pt file or .dcp directory instead, on every "
                        "launch (under torchrun --max-restarts use plain --resume: a restart then continues "
                        "from the newest checkpoint)")
    t.add_argument("--dist", action="store_true", default=argparse.SUPPRESS,
                   help="train as one rank of a fleet: only under torchrun, which it requires "
                        "(default: off, or the config's train.dist)")
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu (a fleet uses gloo) or cuda (one GPU per rank, nccl)")
    t.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per process")
    t.add_argument("--log-dir", default="", metavar="DIR",
                   help="also write every rank's log lines, errors and crash tracebacks to DIR/rank<r>.log "
                        "(default: none; rank 0 prints to stdout and stderr)")
    t.add_argument("--tensorboard", default="", metavar="DIR",
                   help="write loss, lr, tokens/s and eval loss per step as TensorBoard events to DIR "
                        "(rank 0; needs the tracking extra; default: none)")
    t.add_argument("--set", action="append", default=[], metavar="[model.|train.]FIELD=VALUE",
                   help="any ModelConfig or TrainConfig field, e.g. --set model.max_iter=3 "
                        "--set train.opt=adamw (a bare FIELD is a TrainConfig field)")


def _parse_value(field: dataclasses.Field, text: str, pair: str):
    kind = field.type
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"--set {pair!r}: expected a {kind} for {field.name}") from None


def _overrides(pairs: list[str]) -> tuple[dict, dict]:
    """--set pairs as ({model field: value}, {train field: value})."""
    sections = {"model": ModelConfig, "train": TrainConfig}
    out: dict[str, dict] = {"model": {}, "train": {}}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        section, dot, field = name.partition(".")
        if not dot:
            section, field = "train", name
        cls = sections.get(section)
        by_name = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
        if not sep or field not in by_name:
            fields = ", ".join(sorted(by_name)) if cls else "model.FIELD or train.FIELD"
            raise ConfigError(
                f"--set {pair!r}: use field=value (a TrainConfig field) or model.field=value / "
                f"train.field=value; {section} fields: {fields}")
        out[section][field] = _parse_value(by_name[field], value, pair)
    return out["model"], out["train"]


def read_config(path: str) -> RunConfig:
    """A RunConfig from a JSON file, or one clear ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path!r} is not a file: give a RunConfig JSON such as a run's run.json")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--config {path!r} is not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--config {path!r} holds a JSON {type(d).__name__}, not an object with model/train")
    try:
        return RunConfig.from_dict(d)
    except TypeError as e:  # a section that is not an object
        raise ConfigError(f"--config {path!r}: {e}") from None


def run_from_args(args) -> RunConfig:
    """The run a `train` command line describes: --config or --preset, then the
    flags, then --set (the last word wins)."""
    if args.config and args.preset:
        raise ConfigError("--config and --preset both name a model: give one of them")
    if args.config:
        run = read_config(args.config)
    else:
        name = args.preset or "tiny"
        run = RunConfig(source=f"cli:{name}", model=preset(name), train=_cli_train_defaults())
    fields = {field: getattr(args, field) for _, field, *_ in TRAIN_FLAGS if hasattr(args, field)}
    if hasattr(args, "out_dir"):
        fields["out_dir"] = args.out_dir
    if getattr(args, "dist", False):
        fields["dist"] = True
    if args.resume is True:
        fields["resume"] = True
    elif args.resume:
        fields["resume_from"] = args.resume
    model_set, train_set = _overrides(args.set)
    fields.update(train_set)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    if "micro_batch" in fields and "micro_batch" not in known:
        raise ConfigError("--micro-batch needs train.micro_batch, which this version of dormouse lacks")
    try:
        model = dataclasses.replace(run.model, **model_set)
        train = dataclasses.replace(run.train, **fields)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    return RunConfig(source=run.source, model=model, train=train).validate()


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_fleet_request(run: RunConfig) -> None:
    """A fleet runs under torchrun and torchrun runs a fleet: anything else is one error."""
    if run.train.dist and not in_torchrun():
        raise FleetError(
            "a fleet (--dist or train.dist=true) runs under torchrun, which sets RANK and WORLD_SIZE: "
            "torchrun --standalone --nproc_per_node=2 -m dormouse train --dist ...; "
            "or drop --dist to train in one process")
    if in_torchrun() and not run.train.dist:
        raise FleetError(
            f"started by torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']}) without a fleet: add --dist to "
            "train a fleet, or run `dormouse train` without torchrun for one process")


class RankLog:
    """Where a process's log lines go: stdout on rank 0, and DIR/rank<r>.log on
    every rank when a log directory is given."""

    def __init__(self, rank: int, log_dir: str):
        self.rank = rank
        self.file = None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(log_dir) / f"rank{rank}.log", "a", buffering=1)

    def __call__(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _train(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    run = run_from_args(args)
    check_fleet_request(run)
    if run.train.data:  # a missing or empty corpus is said before any rank joins a fleet
        from dormouse.train.data import ByteCorpus

        ByteCorpus(run.train.data, run.train.eval_frac)
    tokens_per_step = _tokens_per_step(run)  # checks a fleet's --capacity on every rank
    if args.tensorboard:
        from dormouse.train.tracking import require_tensorboard

        require_tensorboard()  # on every rank, before any collective
    rank = int(os.environ.get("RANK", "0")) if run.train.dist else 0
    log = RankLog(rank, args.log_dir)
    tracker = None
    try:
        if args.tensorboard and rank == 0:
            from dormouse.train.tracking import TensorBoardTracker

            tracker = TensorBoardTracker(args.tensorboard, tokens_per_step=tokens_per_step, run=run)
        return _run_training(run, args, log, tracker)
    except DormouseError as e:
        if log.file is not None:  # a rank other than 0 says it here (rank 0 on stderr too)
            log.file.write(f"error: {_one_line(e)}\n")
        raise
    except Exception as e:
        if log.file is not None:
            log.file.write(traceback.format_exc())
        _abandon_fleet()
        where = f"rank {rank}: " if run.train.dist else ""
        print(f"error: {where}the run crashed: {type(e).__name__}: {_first_line(e)}", file=sys.stderr, flush=True)
        return EXIT_CRASHED
    finally:
        if tracker is not None:
            tracker.close()
        log.close()


def _tokens_per_step(run: RunConfig) -> int:
    """Tokens of one global step (a fleet's from its capacity profile)."""
    if not run.train.dist:
        return run.train.batch * run.train.seq_len
    from dormouse.train.distributed import parse_capacity

    world = int(os.environ["WORLD_SIZE"])
    shapes = parse_capacity(run.train.dist_capacity, world_size=world, cfg=run.train,
                            max_seq_len=run.model.max_seq_len)
    return sum(s.tokens for s in shapes)


def _run_training(run: RunConfig, args, log: RankLog, tracker) -> int:
    from dormouse import atomic
    from dormouse.model import DormouseModel

    source = f"config={args.config}" if args.config else f"preset={args.preset or 'tiny'}"
    n_params = sum(p.numel() for p in DormouseModel(run.model).parameters())
    fleet = f"fleet of {os.environ['WORLD_SIZE']} ranks " if run.train.dist else ""
    log(f"dormouse: {fleet}{source} params={n_params:,} data={run.train.data or 'built-in'} "
        f"steps={run.train.steps} out={run.train.out_dir}")
    written = []
    # The run as --config should replay it: resuming is a property of one launch, not of the run.
    replay = dataclasses.replace(run, train=dataclasses.replace(run.train, resume=False, resume_from=""))

    def on_step(step, model, info):
        # run.json once a step has trained (bad input never leaves one behind)
        if not written and log.rank == 0:
            atomic.write_text(Path(run.train.out_dir) / "run.json", replay.to_json() + "\n")
            written.append(True)
        if tracker is not None:
            tracker.on_step(step, model, info)

    line_log = tracker.wrap_log(log) if tracker is not None else log
    if run.train.dist:
        from dormouse.train.distributed import close_fleet, train_dist

        report = train_dist(run, log=line_log, device_type=args.device, on_step=on_step, close=False)
        del report["model"]  # the last holder of a sharded model: gone before the group is destroyed
        close_fleet()
    else:
        from dormouse.train.loop import build_model, train

        model = build_model(run).to(args.device)
        report = train(model, run, log=line_log, on_step=on_step)
    if report["final_loss"] is None:
        log(f"done: nothing to train, the checkpoint is already at step {report['start_step']} "
            f"(--steps {run.train.steps}); raise --steps to continue")
    else:
        log(f"done: final loss {report['final_loss']:.4f}, {report['tokens_per_s']:.0f} tokens/s, "
            f"checkpoint {report['checkpoint']}")
    return EXIT_OK


def _abandon_fleet() -> None:
    """After a crash: leave the process group without waiting for peers that
    may be gone (a barrier would hang), so the process exits cleanly."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # already broken: nothing more to release
        pass


# ---------------------------------------------------------------- sample, eval

def _add_sample_parser(sub) -> None:
    s = sub.add_parser("sample", formatter_class=_Help, help="continue a prompt with a trained model",
                       description="Print the continuation of --prompt (bytes decoded as UTF-8, invalid "
                                   "sequences replaced). The same arguments print the same text.")
    s.add_argument("--ckpt", required=True, help="a checkpoint: .pt file (any run) or .dcp directory (sharded)")
    s.add_argument("--prompt", required=True, help="the text to continue (encoded as UTF-8 bytes)")
    s.add_argument("--tokens", type=positive_int, default=200, help="bytes to generate")
    s.add_argument("--temperature", type=finite_float, default=1.0, help="softmax temperature (0 = greedy)")
    s.add_argument("--top-k", type=non_negative_int, default=0, help="draw among the k most likely bytes (0 = all)")
    s.add_argument("--seed", type=int, default=0, help="seeds the draws")
    s.add_argument("--no-cache", action="store_true", help="recompute the whole window every byte (slower; same text)")
    s.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")


def _sample(args) -> int:
    import torch

    from dormouse.infer import generate, load_trained

    torch.set_num_threads(args.threads)
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    model, _, _ = load_trained(args.ckpt)
    out = generate(model, args.prompt.encode(), tokens=args.tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, use_cache=not args.no_cache)
    sys.stdout.write(out.decode("utf-8", errors="replace") + "\n")
    return EXIT_OK


def _add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", formatter_class=_Help, help="held-out loss of a trained model on a file",
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

    from dormouse.infer import file_loss, load_trained

    torch.set_num_threads(args.threads)
    model, run, step = load_trained(args.ckpt)
    seq_len = args.seq_len or run.train.seq_len
    if seq_len > run.model.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len {run.model.max_seq_len}")
    tail = 0.0
    if args.part == "tail":
        tail = run.train.eval_frac
        if not tail:
            raise ConfigError("--part tail: the checkpoint's run held nothing out (train.eval_frac = 0); "
                              "score the whole file instead")
    nats, count = file_loss(model, args.data, seq_len=seq_len, batch=args.batch, tail_frac=tail)
    part = "whole file" if args.part == "whole" else f"last {tail:g} of the file"
    print(f"loss {nats:.6f} nats/byte, {nats / math.log(2):.6f} bits/byte over {count:,} bytes of "
          f"{args.data} ({part}, windows of {seq_len}; checkpoint at step {step})")
    return EXIT_OK


# ---------------------------------------------------------------- the command

def _first_line(e: BaseException) -> str:
    """An unexpected exception's message, cut to its first line."""
    return (str(e).strip().splitlines() or [""])[0]


def _one_line(e: BaseException) -> str:
    """A DormouseError's message on one line (its parts joined, nothing dropped)."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


COMMANDS = {"train": _train, "sample": _sample, "eval": _eval}


def parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="dormouse", description=__doc__.splitlines()[0], epilog=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dormouse {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="command",
                           parser_class=_OneLineParser)
    _add_train_parser(sub)
    _add_sample_parser(sub)
    _add_eval_parser(sub)
    for name, (_, text) in FORWARDED.items():
        f = sub.add_parser(name, help=f"{text} (see dormouse {name} --help)", add_help=False)
        f.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        forwarded = importlib.import_module(FORWARDED[argv[0]][0]).main
        # Their usage errors read like ours: one "error:" line, status 2.
        with mock.patch.object(argparse.ArgumentParser, "error", _OneLineParser.error):
            return forwarded(argv[1:])
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except DormouseError as e:
        # In a fleet every rank meets the same bad input: rank 0 alone says so.
        if os.environ.get("RANK", "0") == "0" or not in_torchrun():
            print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
        _abandon_fleet()
        return EXIT_BAD_INPUT
    except Exception as e:  # a bug or a broken environment: one line, and a status of its own
        print(f"error: dormouse {args.command} crashed: {type(e).__name__}: {_first_line(e)}",
              file=sys.stderr, flush=True)
        return EXIT_CRASHED


if __name__ == "__main__":
    sys.exit(main())
