"""The gate notebooks' parameters: `Params`, validated by `check`, and where
their artifacts go (`resolve_out`).

Layout under `out` (by default <repository>/artifacts/gate, never the cwd):

    curve/         single (one process at the global batch) + rank0..rank{W-1}
                   (the fleet, `steps` steps): the loss-curve comparison
    step/          gradref + init + rank0..rank{W-1} (the fleet, ONE step, same
                   capacity profile): the one-step gradient reference
    verdict.json   the combined verdict of both (04 writes it)
    *.png          04's figures
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import dormouse
from dormouse import atomic
from dormouse.errors import ConfigError, FleetError
from dormouse.gate.fixtures import TINY, rank_shapes, single_batch
from dormouse.train.data import RankShape

REPO_ROOT = Path(dormouse.__file__).resolve().parents[1]
ARTIFACTS = REPO_ROOT / "artifacts"
DEFAULT_OUT = ARTIFACTS / "gate"
CURVE, STEP = "curve", "step"

OPTS, SHARDS, REDUCES, DEVICES = ("mix", "adamw"), ("none", "fsdp"), ("fp32", "bf16"), ("cpu", "cuda")


class ParameterError(ConfigError):
    """A notebook or pipeline parameter holds a value the gate cannot run with."""


@dataclass(frozen=True)
class Params:
    """Every parameter a gate notebook takes, validated (see `check`).

    batch is the config's batch: 01's single process runs at it (its GLOBAL
    batch); a fleet runs it on every rank unless `capacity` gives a profile.
    """

    out: Path = DEFAULT_OUT
    steps: int = 20
    batch: int = 2
    seed: int = 7
    lr: float = 1e-3
    opt: str = "mix"
    world: int = 2
    capacity: str = "4,2"
    shard: str = "none"
    reduce: str = "fp32"
    device: str = "cpu"
    timeout_s: float = 300.0
    produce: bool = True

    @property
    def curve_dir(self) -> Path:
        return self.out / CURVE

    @property
    def step_dir(self) -> Path:
        return self.out / STEP

    def shapes(self) -> list[RankShape]:
        """The fleet's shape per rank (dormouse.train.distributed.parse_capacity)."""
        return rank_shapes(self.capacity, world=self.world, batch=self.batch)

    def global_batch(self) -> int | None:
        """The single process's batch that reads exactly the fleet's bytes, or
        None when the profile mixes window lengths (no one batch holds it)."""
        return single_batch(self.shapes())

    def gate_settings(self, d: Path, **over):
        from dormouse.gate.modes import GateSettings

        s = GateSettings(out=str(d), steps=self.steps, batch=self.batch, capacity=self.capacity,
                         seed=self.seed, lr=self.lr, shard=self.shard, device=self.device, opt=self.opt,
                         reduce=self.reduce, world=self.world)
        return replace(s, **over)

    def record(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


DEFAULTS = Params()


def _bad(name: str, value, allowed: str) -> ParameterError:
    return ParameterError(f"{name} = {value!r} is not allowed: {name} must be {allowed}.")


def _whole(name: str, value, low: int, allowed: str) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(name, value, allowed)
    return value


def _choice(name: str, value, choices) -> str:
    if value not in choices:
        raise _bad(name, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def _positive(name: str, value, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise _bad(name, value, allowed)
    return float(value)


def _cuda(world: int) -> None:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ParameterError("device = 'cuda' is not allowed here: no CUDA device is visible, "
                             "so device must be 'cpu'.")
    if world > n:
        raise ParameterError(f"world = {world} is not allowed with device = 'cuda': {n} GPU(s) visible "
                             f"and one rank per GPU, so world must be at most {n}.")


def resolve_out(out) -> Path:
    """None -> <repository>/artifacts/gate; a relative path is taken from the
    repository root (papermill and nbmake run in different working
    directories, and both must find the same artifacts)."""
    if out is None:
        return DEFAULT_OUT
    if not isinstance(out, (str, os.PathLike)) or not str(out).strip():
        raise _bad("out", out, "a writable directory path, or None for the repository's artifacts/gate")
    p = Path(out).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def _capacity(value, world: int) -> str:
    """The profile, normalised ('4, 2' -> '4,2'); its entries are checked by
    parse_capacity, whose FleetError becomes one sentence about `capacity`."""
    how = ("'' (the batch on every rank) or one comma-separated entry per rank, each 'B' or 'BxT' "
           f"with positive whole numbers and T at most {TINY['max_seq_len']} (e.g. '4,2')")
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # papermill's -p capacity 4 arrives as an int
    if not isinstance(value, str):
        raise _bad("capacity", value, how)
    text = ",".join(e.strip() for e in value.split(",")) if value.strip() else ""
    if not text:
        return ""
    entries = len(text.split(","))
    try:
        rank_shapes(text, world=entries, batch=1)  # the entries alone; the count is judged next
    except FleetError:
        raise _bad("capacity", value, how) from None
    if entries != world:
        raise ParameterError(f"capacity = {value!r} has {entries} entries but world = {world}: "
                             f"capacity must be {how}.")
    return text


def check(**given) -> Params:
    """Validate the parameters a notebook was given; the rest keep their
    defaults. Raises ParameterError, one sentence naming the parameter and
    what it may be."""
    unknown = sorted(set(given) - set(Params.__dataclass_fields__))
    if unknown:
        raise ParameterError(f"unknown parameter {unknown[0]!r}: use "
                             + ", ".join(Params.__dataclass_fields__) + ".")
    v: dict = {}
    if "steps" in given:
        v["steps"] = _whole("steps", given["steps"], 1, "a whole number of optimizer steps, 1 or more (e.g. 20)")
    if "batch" in given:
        v["batch"] = _whole("batch", given["batch"], 1, "a whole number of windows, 1 or more (e.g. 2)")
    if "seed" in given:
        v["seed"] = _whole("seed", given["seed"], 0, "a whole number, 0 or more (e.g. 7)")
    if "lr" in given:
        v["lr"] = _positive("lr", given["lr"], "a positive finite learning rate (e.g. 0.001)")
    if "opt" in given:
        v["opt"] = _choice("opt", given["opt"], OPTS)
    if "world" in given:
        v["world"] = _whole("world", given["world"], 1, "a whole number of ranks, 1 or more (e.g. 2)")
    world = v.get("world", DEFAULTS.world)
    if "capacity" in given:
        v["capacity"] = _capacity(given["capacity"], world)
    elif "world" in given and world != DEFAULTS.world:
        # The default profile is for the default world; another world without
        # a profile runs the batch on every rank.
        v["capacity"] = ""
    if "shard" in given:
        v["shard"] = _choice("shard", given["shard"], SHARDS)
    if "reduce" in given:
        v["reduce"] = _choice("reduce", given["reduce"], REDUCES)
    if "device" in given:
        v["device"] = _choice("device", given["device"], DEVICES)
        if v["device"] == "cuda":
            _cuda(world if "world" in given else 1)  # 01 runs one process
    if "timeout_s" in given:
        v["timeout_s"] = _positive("timeout_s", given["timeout_s"], "a positive number of seconds (e.g. 300)")
    if "produce" in given:
        if not isinstance(given["produce"], bool):
            raise _bad("produce", given["produce"], "True (produce missing artifacts) or False (only read them)")
        v["produce"] = given["produce"]
    out = resolve_out(given.get("out"))
    try:
        atomic.check_writable(out)
    except OSError as e:
        raise ParameterError(
            f"out = {str(given.get('out', out))!r} cannot be written ({e.strerror or e}): out must be a "
            "writable directory, or None for the repository's artifacts/gate.") from None
    return replace(DEFAULTS, out=out, **v)
