"""`python -m dormouse train ...` (also the `dormouse` console script).

    python -m dormouse train --preset tiny --steps 200
    python -m dormouse train --preset small --data corpus.txt --steps 1000 --resume

Without --data the built-in corpus (dormouse's own source) is used. Every
TrainConfig field can be set with --set field=value; errors in the input are
reported in one line (exit status 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from dormouse.config import PRESETS, RunConfig, TrainConfig, preset
from dormouse.errors import ConfigError, DormouseError


def _parse_value(field: dataclasses.Field, text: str):
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
        raise ConfigError(f"--set {field.name}={text!r}: expected a {kind}") from None


def _overrides(pairs: list[str], cls) -> dict:
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in by_name:
            raise ConfigError(f"--set {pair!r}: use field=value with one of {', '.join(sorted(by_name))}")
        out[name] = _parse_value(by_name[name], value)
    return out


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line starting with "error:" (status 2),
    like every other input error of this command."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="python -m dormouse", description=__doc__.splitlines()[0],
                       epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model in one process",
                       description="Train a dormouse model in one process, logging one line per log step.")
    t.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (default: tiny)")
    t.add_argument("--data", default="", help="corpus file of bytes (default: the built-in corpus)")
    t.add_argument("--steps", type=int, default=TrainConfig.steps, help="optimizer steps")
    t.add_argument("--batch", type=int, default=TrainConfig.batch, help="windows per step")
    t.add_argument("--seq-len", type=int, default=TrainConfig.seq_len, help="tokens per window")
    t.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate")
    t.add_argument("--seed", type=int, default=TrainConfig.seed, help="initialisation seed")
    t.add_argument("--out-dir", default=TrainConfig.out_dir, help="checkpoints and metrics go here")
    t.add_argument("--log-every", type=int, default=TrainConfig.log_every, help="steps between log lines")
    t.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints (0 = none)")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out-dir")
    t.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    t.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other TrainConfig field, e.g. --set opt=adamw --set eval_frac=0.1")
    return p


def run_from_args(args) -> RunConfig:
    fields = dict(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                  out_dir=args.out_dir, log_every=args.log_every, ckpt_every=args.ckpt_every,
                  data=args.data, resume=args.resume)
    fields.update(_overrides(args.set, TrainConfig))
    return RunConfig(source=f"cli:{args.preset}", model=preset(args.preset), train=TrainConfig(**fields)).validate()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import torch

        from dormouse.train.loop import build_model, train

        torch.set_num_threads(args.threads)
        run = run_from_args(args)
        model = build_model(run)
        n = sum(p.numel() for p in model.parameters())
        print(f"dormouse: preset={args.preset} params={n:,} data={run.train.data or 'built-in'} "
              f"steps={run.train.steps} out_dir={run.train.out_dir}", flush=True)
        report = train(model, run, log=lambda line: print(line, flush=True))
        if report["final_loss"] is None:
            print(f"done: nothing to train, the checkpoint is already at step {report['start_step']} "
                  f"(--steps {run.train.steps}); raise --steps to continue")
            return 0
        print(f"done: final loss {report['final_loss']:.4f}, {report['tokens_per_s']:.0f} tokens/s, "
              f"checkpoint {report['checkpoint']}")
        return 0
    except DormouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
