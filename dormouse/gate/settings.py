"""The gate's settings: ONE frozen dataclass, `GateSettings`.

Everything else is derived from it: the command line (gate/cli.py: `add_arguments`,
`from_args`, `by_hand`), the notebooks' parameter check (`check`), a fleet's rank command
(`to_argv`), and the freshness of artifacts (`record`, which every artifact
carries). A field added here appears everywhere at once. The settings import
nothing of the running side (record) and no argparse: the fleet's plan and run
come from gate/fixtures.py, below both.

Conventions: 0 or "" means "off" or "the default named in the comment". The
comments are the command line's help and the notebooks' parameter comments,
so they hold no '=' or quotes (papermill's parameter parser reads them).
`validate()` returns a normalised copy, or raises ParameterError: one sentence
naming the setting, its value and what it may be.

Settings are validated ONCE, where they are made (check, from_args, by_hand,
from_dict, or an explicit validate()): the copy validate() returns is marked
`validated`, and validate() of a validated object returns it unchanged. A
changed copy (dataclasses.replace) is unmarked and checked again. The launcher
relies on the mark, and carries it to the ranks: to_argv (and the launcher's
plan file) add `--validated`, and a rank given it builds its settings from the
flags without checking them again. By hand, without the flag, a rank checks
its flags like every other mode (every bad-input message is validate()'s).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import dormouse
from dormouse.config import DATA_ORDERS, DIST_REDUCES, DIST_SHARDS, OPTIMIZERS, PRESETS
from dormouse.errors import ConfigError, PlanError

REPO_ROOT = Path(dormouse.__file__).resolve().parents[1]
ARTIFACTS = REPO_ROOT / "artifacts"
DEFAULT_OUT = ARTIFACTS / "gate"
DEVICES = ("cpu", "cuda")


class ParameterError(ConfigError):
    """A gate setting holds a value the gate cannot run with."""


@dataclass(frozen=True)
class GateSettings:
    """What one gate run is asked to do; recorded in every artifact it writes.

    The fleet's profile (`world`, `batch`, `profile`, `micro_batch`) is one
    FleetPlan (`plan`), which defines the global batch; the single process
    runs at that global batch, gradref reads the same bytes by its own
    arithmetic. `capacity` is the old name of `profile` (flag and notebook
    parameter alike); "capacity" otherwise means the MoE's capacity factor.
    """

    out: str = ""  # artifact directory (empty: <repository>/artifacts/gate; a relative path is from the repo root)
    steps: int = 20  # optimizer steps of the fleet's run (and of every reference)
    batch: int = 2  # windows per rank when profile is empty
    world: int = 2  # ranks in the fleet (torchrun's --nproc_per_node)
    profile: str = "4,2"  # the fleet's per-rank shapes, one B or BxT per rank, e.g. 4,2 (empty: batch on every rank)
    seed: int = 7  # seeds the model's initialisation and the data order, the same in every mode
    lr: float = 0.0  # peak learning rate (0: the configuration's own; the tiny fixture's is 1e-3)
    opt: str = "mix"  # mix (Muon + AdamW) | adamw
    shard: str = "none"  # none (replicated) | fsdp (FSDP2)
    reduce: str = "fp32"  # the fleet's gradient reduce: fp32 | bf16 (wire) | exact (fixed summation order)
    micro_batch: int = 0  # windows per forward/backward slice (0: the whole local batch; under reduce exact the gcd of the rank batches of every leg)
    data_order: str = "shuffle"  # which span each step reads: shuffle (seeded, per epoch) | sequential
    preset: str = ""  # the network by preset name, tiny or small, with the fixture recipe (empty: tiny)
    config: str = ""  # the network and recipe from a RunConfig JSON file, as dormouse train writes (empty: off)
    data: str = ""  # corpus file (empty: the fixture's seeded pseudo-random bytes, written into out)
    resume_world: int = 1  # the fleet stops at half its steps and resumes at this many ranks (0: no stop; 1-step runs never stop)
    resume_from: str = ""  # continue from this checkpoint, relative to out or absolute (empty: from the start)
    device: str = "cpu"  # cpu (gloo) or cuda (nccl, one GPU per rank); single and gradref run there too
    threads: int = 1  # torch CPU threads per process (bitwise results depend on it: recorded)
    bucket_mb: float = 4.0  # size of one flattened gradient all-reduce bucket (MiB)
    timeout_s: float = 300.0  # a fleet still running after this is killed (all ranks)
    produce: bool = True  # notebooks: produce missing or stale artifacts (False: only read them)

    # ------------------------------------------------------------------ derived

    @property
    def out_dir(self) -> Path:
        return resolve_out(self.out)

    @functools.cached_property
    def plan(self):
        """The fleet's FleetPlan (shapes per rank, slices, tokens, global
        batch), made once per settings object (fixtures.fleet_plan)."""
        from dormouse.gate.fixtures import fleet_plan

        return fleet_plan(self)

    def legs(self) -> list["GateSettings"]:
        """The fleet's launches: itself, or with resume_world the first half at
        `world` and the second at `resume_world` ranks over the same global
        batch, split evenly (FleetPlan.evenly; each leg's settings say its own
        world and profile)."""
        if not self.resume_world or self.steps < 2:
            return [self]
        even = self.plan.evenly(self.resume_world)
        return [self, dataclasses.replace(self, world=even.world, profile=even.profile)]

    def stop_step(self) -> int:
        """The step the first leg ends at (resume_world)."""
        return max(1, self.steps // 2)

    def record(self) -> dict:
        """What an artifact records (everything that changes the mathematics),
        with the fleet's global batch in windows (None: the profile mixes
        window lengths): what the judge needs to know which references apply
        (artifacts.references)."""
        d = dataclasses.asdict(self)
        for k in ("out", "timeout_s", "produce"):
            d.pop(k)
        d["global_batch"] = self.plan.global_batch
        return d

    @property
    def validated(self) -> bool:
        """Whether these settings came out of validate() (or were carried from such an object to a rank)."""
        return self.__dict__.get("_validated", False)

    def to_argv(self) -> list[str]:
        """These settings as `dormouse.gate` command-line arguments (a fleet's
        ranks), with VALIDATED_FLAG when they are validated."""
        argv = []
        for f in fields(self):
            if f.name in _NOT_FLAGS:
                continue
            v = str(self.out_dir) if f.name == "out" else getattr(self, f.name)
            argv.append(f"--{f.name.replace('_', '-')}={v!r}" if isinstance(v, float) else
                        f"--{f.name.replace('_', '-')}={v}")
        return argv + ([VALIDATED_FLAG] if self.validated else [])

    # ------------------------------------------------------------------ checking

    def validate(self) -> "GateSettings":
        """A normalised copy (profile '4, 2' -> '4,2'), marked validated, or
        ParameterError; a validated object itself (checked once)."""
        if self.validated:
            return self
        v = {}
        for name, low, eg in (("steps", 1, 20), ("batch", 1, 2), ("world", 1, 2), ("seed", 0, 7),
                              ("threads", 1, 1), ("micro_batch", 0, 1), ("resume_world", 0, 1)):
            v[name] = _whole(name, getattr(self, name), low, eg)
        for name, choices in (("opt", OPTIMIZERS), ("shard", DIST_SHARDS), ("reduce", DIST_REDUCES),
                              ("device", DEVICES), ("data_order", DATA_ORDERS)):
            v[name] = _choice(name, getattr(self, name), choices)
        lr = self.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr >= 0):
            raise _bad("lr", lr, "a finite learning rate > 0, or 0 for the configuration's own (e.g. 0.001)")
        v["lr"] = float(lr)
        for name, eg in (("bucket_mb", 4), ("timeout_s", 300)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
                raise _bad(name, x, f"a positive finite number (e.g. {eg})")
            v[name] = float(x)
        if not isinstance(self.produce, bool):
            raise _bad("produce", self.produce, "True (produce missing artifacts) or False (only read them)")
        if isinstance(self.profile, int) and not isinstance(self.profile, bool):
            v["profile"] = str(self.profile)  # papermill's -p profile 4 arrives as an int
        for name in ("profile", "preset", "config", "data", "out", "resume_from"):
            if not isinstance(v.get(name, getattr(self, name)), str):
                raise _bad(name, getattr(self, name), "a path (a string)" if name != "profile" else
                           "a string of one B or BxT entry per rank (e.g. '4,2'), or ''")
        s = dataclasses.replace(self, **v)
        if s.preset and s.preset not in PRESETS:
            raise _bad("preset", s.preset, "one of " + ", ".join(repr(p) for p in PRESETS) + ", or empty")
        if s.config and not Path(s.config).expanduser().is_file():
            raise ParameterError(f"config = {s.config!r} is not a file: pass a RunConfig JSON (the run.json "
                                 "that `dormouse train` writes), or use preset for a preset.")
        if s.config and s.preset:
            raise ParameterError(f"config = {s.config!r} and preset = {s.preset!r} both name the network: "
                                 "give one of them.")
        if s.data and not Path(s.data).expanduser().is_file():
            raise ParameterError(f"data = {s.data!r} is not a file: pass a corpus file of bytes, or '' for "
                                 "the fixture's corpus.")
        plan = _planned(lambda: s.plan)
        s = dataclasses.replace(s, profile=plan.profile)  # normalised: '4, 2' -> '4,2'
        if s.reduce == "exact" and not s.micro_batch:
            s = dataclasses.replace(s, micro_batch=_exact_micro_batch(s, plan))
            plan = _planned(lambda: s.plan)
            if s.shard == "fsdp" and s.world > 1 and max(plan.counts) > 1:
                raise ParameterError(
                    f"reduce = 'exact' with shard = 'fsdp' takes one slice per rank (FSDP2 adds a rank's slices "
                    f"before its reduce-scatter), but profile = {s.profile!r} gives a rank {max(plan.counts)} slices "
                    f"of {s.micro_batch} windows (the gcd of every leg's rank batches): give every rank the same "
                    "batch, or shard = 'none'.")
        # Every run the settings describe, checked by the trainer's own rules:
        # the single process's config, and the fleet's refusals (a fleet that
        # would train another network; exact with FSDP takes one slice per rank).
        _planned(lambda: s.run_config("single", dist=False, write_corpus=False).validate())
        _planned(lambda: refuse_fleet(s.run_config("fleet", dist=True, write_corpus=False), s.world))
        if s.reduce == "exact":
            _planned(plan.exact_slice)  # the exact reference computes the fleet's own slices
        if s.resume_world and s.steps >= 2:
            if s.resume_from:
                raise ParameterError(f"resume_world = {s.resume_world} is not allowed: it starts from resume_from; "
                                     "resume_world must be 0 (no stop and resume) with resume_from.")
            try:
                plan.evenly(s.resume_world)
            except PlanError as e:
                raise ParameterError(f"resume_world = {s.resume_world} is not allowed: {e.reason}; resume_world "
                                     "must split the global batch evenly, or be 0 (no stop and resume).") from None
        if s.device == "cuda":
            _cuda(max(s.world, s.resume_world))
        why = _unwritable(s.out_dir)
        if why:
            raise ParameterError(f"out = {s.out!r} cannot be written ({why}): out must be a writable "
                                 "directory, or '' for the repository's artifacts/gate.")
        return _trusted(s)

    def resume_path(self) -> str:
        if not self.resume_from:
            return ""
        p = Path(self.resume_from).expanduser()
        return str(p if p.is_absolute() else self.out_dir / p)

    def run_config(self, name: str, *, dist: bool, **over):
        """The RunConfig of one mode (fixtures.make_run)."""
        from dormouse.gate.fixtures import make_run

        return make_run(self, name=name, dist=dist, **over)


def _trusted(s: GateSettings) -> GateSettings:
    """`s` marked validated: only validate() and what carries its mark (to_argv, a plan file) call this."""
    s.__dict__["_validated"] = True
    return s


def _exact_micro_batch(s: GateSettings, plan) -> int:
    """Under the exact reduce the slices are the mathematics: the exact
    reference computes the slices the fleet sums, in every leg. With
    micro_batch 0 a rank's whole batch would be one slice, and the resume at
    another world size would change them (two slices of 3 become one of 6):
    the settings choose micro_batch = gcd of every leg's rank batches, the
    largest slice every leg shares (FleetPlan.evenly gives the second leg; a
    resume it cannot split is refused below). Under FSDP2 the fleet's own
    refusal (refuse_fleet) then names a profile that gives a rank of a fleet
    several slices."""
    batches = [sh.batch for sh in plan.shapes]
    if s.resume_world and s.steps >= 2 and not s.resume_from:
        try:
            batches += [sh.batch for sh in plan.evenly(s.resume_world).shapes]
        except PlanError:
            pass
    return math.gcd(*batches)


def _planned(make):
    """make() — the plan or a run the settings describe — with the trainer's
    errors stated as the settings' own: a PlanError names its setting (profile,
    micro_batch, world) and its reason, any other one is the run's."""
    try:
        return make()
    except ParameterError:
        raise
    except PlanError as e:
        raise ParameterError(f"{e.field} = {e.value!r} is not allowed: {e.reason}.") from None
    except dormouse.errors.DormouseError as e:
        raise ParameterError(f"the run these settings describe is not valid: {e}.") from None


def refuse_fleet(run, world: int) -> None:
    """The trainer's refusals of a fleet that its settings decide (dormouse.train.plan.refuse_config,
    which distributed.refuse_incompatible applies too): no torch, so a fleet is launched before it."""
    from dormouse.train.plan import refuse_config

    refuse_config(run, world)


_NOT_FLAGS = ("timeout_s", "produce")
# The launcher's mark on a rank's command line: the flags (or --plan file) come
# from validated settings (GateSettings.validated), so the rank does not check them again.
VALIDATED_FLAG = "--validated"
ALIASES = {"capacity": "profile"}  # old name -> field: flags, notebook parameters and plan files
DEFAULTS = GateSettings()
FIELDS = tuple(f.name for f in fields(GateSettings))


def _unwritable(d: Path) -> str | None:
    """Why directory `d` could not be made or written, without creating anything."""
    p = d
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def resolve_out(out) -> Path:
    """'' or None -> <repository>/artifacts/gate; a relative path is taken from
    the repository root (papermill and nbmake run in different working
    directories, and both must find the same artifacts)."""
    if out is None or (isinstance(out, str) and not out.strip()):
        return DEFAULT_OUT
    p = Path(out).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p




def from_dict(d: dict, *, validated: bool = False) -> GateSettings:
    """Settings from a dict of fields (a plan file, an artifact's record), old
    names read as new ones; `validated`: the dict holds validated settings
    (the launcher's plan file), taken as they are."""
    if validated:
        return _trusted(GateSettings(**_unalias(d)))
    return GateSettings(**_unalias(d)).validate()


def from_record(record: dict, **over) -> GateSettings:
    """The settings an artifact recorded (GateSettings.record(), its derived
    global_batch dropped), with `over` on top; not validated."""
    return GateSettings(**{**{k: v for k, v in _unalias(record).items() if k in FIELDS}, **over})


def _unalias(given: dict) -> dict:
    """Old names (ALIASES) as their new ones. The old name, when given, wins over
    the new one at its default (a notebook passes every parameter); both given
    with different values is an error."""
    given = dict(given)
    for old, new in ALIASES.items():
        if old not in given:
            continue
        value = given.pop(old)
        if value is None:
            continue
        if new in given and given[new] != getattr(DEFAULTS, new) and given[new] != value:
            raise ParameterError(f"{old} = {value!r} and {new} = {given[new]!r} both set the fleet's profile: "
                                 f"give one of them ({old} is the old name of {new}).")
        given[new] = value
    return given


def check(**given) -> GateSettings:
    """The notebooks' check: the given parameters (papermill's conversions
    undone where harmless), the rest defaults; validated."""
    unknown = sorted(set(given) - set(FIELDS) - set(ALIASES))
    if unknown:
        raise ParameterError(f"unknown parameter {unknown[0]!r}: use {', '.join(FIELDS)}.")
    given = _unalias(given)
    if given.get("out") is None:
        given["out"] = ""
    elif isinstance(given["out"], os.PathLike):
        given["out"] = str(given["out"])
    for k in ("profile", "preset", "config", "data", "resume_from"):
        if k in given and given[k] is None:
            given[k] = ""
        elif isinstance(given.get(k), int) and not isinstance(given[k], bool):
            given[k] = str(given[k])  # papermill's -p profile 4 arrives as an int
    return GateSettings(**_defaults_follow(given)).validate()


def _defaults_follow(given: dict, explicit: set[str] | None = None) -> dict:
    """Defaults that follow what was given (a default never overrides a given value):

    - the default profile is the default fleet's: with another world, or a
      batch given, and no profile given, every rank runs `batch` windows;
    - the default resume_world stops and resumes the fleet where it can: a
      profile that mixes window lengths (no one global batch to split evenly
      at another world) runs in one launch (resume_world 0).

    A notebook passes every parameter (`explicit` None), so there a value
    equal to its default counts as not given."""
    def said(name: str) -> bool:
        if explicit is not None:
            return name in explicit
        return name in given and given[name] != getattr(DEFAULTS, name)

    world = given.get("world", DEFAULTS.world)
    if (world != DEFAULTS.world or said("batch")) and not said("profile"):
        given = {**given, "profile": ""}
    if not said("resume_world") and given.get("resume_world", DEFAULTS.resume_world):
        try:
            mixed = dataclasses.replace(DEFAULTS, **{k: v for k, v in given.items() if k in FIELDS}).plan.mixed_lengths
        except Exception:  # noqa: BLE001 -- malformed settings: validate() says what is wrong
            mixed = False
        if mixed:
            given = {**given, "resume_world": 0}
    return given


def _field_comments() -> dict[str, str]:
    """Each field's trailing comment in this file: the help text. (The file
    is read as text: inspect.getsource parses the whole module, a quarter of
    a second in every process that builds the parser, each rank included.)"""
    text = Path(__file__).read_text(encoding="utf-8")
    start = text.index("\nclass GateSettings")
    src = text[start:text.index("\n    def ", start)]  # the fields come before the first method
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\w+): [^=]+=[^#\n]+#(.*)$", src, re.M)}


def _bad(name: str, value, allowed: str) -> ParameterError:
    return ParameterError(f"{name} = {value!r} is not allowed: {name} must be {allowed}.")


def _whole(name: str, value, low: int, eg) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(name, value, f"a whole number, {low} or more (e.g. {eg})")
    return value


def _choice(name: str, value, choices) -> str:
    if value not in choices:
        raise _bad(name, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def _cuda(world: int) -> None:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ParameterError("device = 'cuda' is not allowed here: no CUDA device is visible, "
                             "so device must be 'cpu'.")
    if world > n:
        raise ParameterError(f"world = {world} is not allowed with device = 'cuda': {n} GPU(s) visible "
                             f"and one rank per GPU, so world must be at most {n}.")
