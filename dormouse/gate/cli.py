"""The gate's command line over its settings (settings.GateSettings): one flag per field, typed, with the
field's comment as its help (add_arguments, from_args), and the settings of a mode launched by hand
(by_hand: a default never overrides a flag given). The settings themselves know nothing of argparse."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

from dormouse.gate.settings import (
    _NOT_FLAGS,
    ALIASES,
    FIELDS,
    GateSettings,
    ParameterError,
    _defaults_follow,
    _field_comments,
    _trusted,
    _unalias,
)


def add_arguments(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = (), given_only: bool = False,
                  shown: dict | None = None) -> None:
    """One flag per field (--micro-batch for micro_batch), typed, with the
    field's comment as help and its default shown (`shown`: other words for
    some defaults). given_only: flags not given are absent from the
    namespace (to pass on only what was said)."""
    comments = _field_comments()
    for f in fields(GateSettings):
        if f.name in skip or (f.name in _NOT_FLAGS and not given_only):
            continue
        kind = {"int": _int_arg, "float": _float_arg, "str": str, "bool": _bool_arg}[f.type]
        default = (shown or {}).get(f.name, repr(f.default))
        old = [f"--{a.replace('_', '-')}" for a, new in ALIASES.items() if new == f.name]
        p.add_argument(f"--{f.name.replace('_', '-')}", *old, dest=f.name, type=kind,
                       default=argparse.SUPPRESS if given_only else f.default,
                       help=comments.get(f.name, "") + f" (default: {default})"
                       + "".join(f"; {o} is its old name" for o in old))


def from_args(args: argparse.Namespace, explicit: set[str] | None = None) -> GateSettings:
    """Settings from parsed flags; `explicit`: the fields the command line named."""
    given = {k: getattr(args, k) for k in FIELDS if hasattr(args, k)}
    if getattr(args, "validated", False):
        return _trusted(GateSettings(**given))
    return GateSettings(**_defaults_follow(given, explicit if explicit is not None else set())).validate()


# By hand (`dormouse gate MODE`), a fleet runs in one launch unless the user
# asks for the stop and resume; the pipeline and the notebooks keep
# GateSettings' own default (the richer gate).
BY_HAND_RESUME_WORLD = 0


REFERENCE_MODES = ("gradref", "reference", "verdict")  # modes that follow the fleet they check


def by_hand(mode: str, given: dict, *, recorded: dict | None = None, world_size: int | None = None,
            validated: bool = False) -> GateSettings:
    """The settings of one mode launched by hand, from the flags the user gave
    (`given`: only those) -- a default never overrides a flag:

    - `--batch` is the batch of the process being launched: a rank's own
      (the profile then is `batch` on every rank, not the default profile),
      the single process's GLOBAL batch (alone it is one rank of `batch`
      windows; with `--world W`, W ranks of batch / W each; with `--profile`,
      the profile given, `--batch` then each rank's as for rank). The verdict
      compares a single and a fleet through their global batch, so
      `single --batch 4` and a 2-rank `rank --batch 2` are the same gate.
    - under torchrun, `world` is torchrun's WORLD_SIZE (`world_size`) unless given;
    - the fleet runs in one launch (resume_world 0) unless --resume-world is given;
    - gradref, reference and verdict start from the settings the fleet recorded
      (`recorded`: its recording's), so `--out` alone names the gate they check;
    - `validated` (the launcher's VALIDATED_FLAG on a rank): `given` is every
      flag of validated settings (to_argv), taken as they are.
    """
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ParameterError(f"unknown setting {unknown[0]!r}: use {', '.join(FIELDS)}.")
    if validated and mode == "rank" and set(given) >= set(FIELDS) - set(_NOT_FLAGS):
        return _trusted(GateSettings(**given))
    if mode in REFERENCE_MODES and recorded:
        base = {k: v for k, v in _unalias(recorded).items() if k in FIELDS}
        return GateSettings(**{**base, **given}).validate()
    g = {"resume_world": BY_HAND_RESUME_WORLD, **given}
    if mode == "rank" and "world" not in given and world_size:
        g["world"] = world_size
    if mode == "single" and "batch" in given and "profile" not in given:
        world = g.get("world", 1)
        if isinstance(world, int) and world >= 1 and isinstance(given["batch"], int):
            if given["batch"] % world:
                raise ParameterError(f"batch = {given['batch']} is not allowed with world = {world}: single's "
                                     f"batch is the global batch, so batch must be a multiple of world, "
                                     f"or give profile.")
            g.update(world=world, batch=given["batch"] // world)
            if g.get("reduce") == "exact" and not g.get("micro_batch") and "world" not in given:
                raise ParameterError("micro_batch = 0 is not allowed for single with reduce = 'exact' and no "
                                     "world: the exact reference computes the fleet's slices, so give "
                                     "micro_batch (e.g. 1) or the fleet's world.")
    return GateSettings(**_defaults_follow(g, set(given) | {"world"} if "world" in g else set(given))).validate()


def explicit_fields(argv: list[str]) -> set[str]:
    """The GateSettings fields a command line names (--micro-batch=1 and --micro-batch 1 alike,
    --capacity as profile)."""
    named = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    return {ALIASES.get(n, n) for n in named} & set(FIELDS)


def _int_arg(text: str) -> int:
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(text)


def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _bool_arg(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1")
