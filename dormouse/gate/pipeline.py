"""The gate's notebook pipeline as a library: parameters, artifact layout,
producing artifacts (once, under a lock), the combined verdict, and the
papermill runner `python -m dormouse.gate.pipeline`.

The notebooks in notebooks/ hold parameters, a call or two into this module, a
table and a plot; every decision lives here where tests reach it.

Layout (under `out`, by default <repository>/artifacts/gate, never the cwd):

    curve/         single (one process at the global batch) + rank0..rank{W-1}
                   (the fleet, `steps` steps): the loss-curve comparison
    step/          gradref + init + rank0..rank{W-1} (the fleet, ONE step, same
                   capacity profile): the one-step gradient reference
    verdict.json   the combined verdict of both (04 writes it)
    *.png          04's figures

Artifacts record the settings that made them; an artifact set that is missing
or was made by another configuration is produced again through the library.
Producing a set is serialised by an flock on `.<set>.lock` in its directory, so
two notebooks running at once never produce (or read) a half-written set.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import dormouse
from dormouse import atomic
from dormouse.errors import ConfigError, DormouseError

REPO_ROOT = Path(dormouse.__file__).resolve().parents[1]
ARTIFACTS = REPO_ROOT / "artifacts"
DEFAULT_OUT = ARTIFACTS / "gate"
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
EXECUTED_DIR = ARTIFACTS / "notebooks"
NOTEBOOKS = ("01_single.ipynb", "02_fleet_launcher.ipynb", "03_gradref.ipynb", "04_compare_plots.ipynb")
CURVE, STEP = "curve", "step"
VERDICT_FILE = "verdict.json"

# The fixture's window length and model limit (dormouse.gate.fixtures), kept
# here as plain numbers so validating parameters does not import torch.
SEQ, MAX_SEQ_LEN = 64, 64
OPTS, SHARDS, REDUCES, DEVICES = ("mix", "adamw"), ("none", "fsdp"), ("fp32", "bf16"), ("cpu", "cuda")
_ENTRY = re.compile(r"^(\d+)(?:x(\d+))?$")

Log = Callable[[str], None]


# --------------------------------------------------------------------------- errors


class _OneMessage:
    """In a notebook, show the message, not a traceback: IPython calls
    `_render_traceback_` for the lines of an exception's report."""

    def _render_traceback_(self) -> list[str]:
        lines = str(self).splitlines() or [""]
        return [f"{type(self).__name__}: {lines[0]}", *lines[1:]]


class ParameterError(_OneMessage, ConfigError):
    """A notebook or pipeline parameter holds a value the gate cannot run with."""


class MissingArtifactError(_OneMessage, DormouseError):
    """An artifact the verdict needs is missing and may not be produced here."""


class GateFailed(_OneMessage, DormouseError):
    """The gate ran and found the fleet does not compute the single process's mathematics."""


@contextmanager
def briefly():
    """Let any DormouseError raised inside render as its message alone in a
    notebook (the fleet's own output is already in the cell above it)."""
    try:
        yield
    except DormouseError as e:
        if not hasattr(e, "_render_traceback_"):
            e._render_traceback_ = lambda e=e: [f"{type(e).__name__}: {e}"]
        raise


# --------------------------------------------------------------------------- parameters


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

    def shapes(self) -> list[tuple[int, int]]:
        """(batch, seq_len) per rank."""
        if not self.capacity:
            return [(self.batch, SEQ)] * self.world
        out = []
        for e in self.capacity.split(","):
            m = _ENTRY.match(e)
            out.append((int(m.group(1)), int(m.group(2) or SEQ)))
        return out

    def global_batch(self) -> int | None:
        """The single process's batch that reads exactly the fleet's bytes, or
        None when the profile mixes window lengths (no one batch holds it)."""
        shapes = self.shapes()
        if any(t != SEQ for _, t in shapes):
            return None
        return sum(b for b, _ in shapes)

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
    how = ("'' (the batch on every rank) or one comma-separated entry per rank, each 'B' or 'BxT' "
           f"with positive whole numbers and T at most {MAX_SEQ_LEN} (e.g. '4,2')")
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # papermill's -p capacity 4 arrives as an int
    if not isinstance(value, str):
        raise _bad("capacity", value, how)
    text = ",".join(e.strip() for e in value.split(",")) if value.strip() else ""
    if not text:
        return ""
    entries = text.split(",")
    for e in entries:
        m = _ENTRY.match(e)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and not 1 <= int(m.group(2)) <= MAX_SEQ_LEN):
            raise _bad("capacity", value, how)
    if len(entries) != world:
        raise ParameterError(f"capacity = {value!r} has {len(entries)} entries but world = {world}: "
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


# --------------------------------------------------------------------------- locks and freshness


@contextmanager
def locked(directory: Path, *sets: str):
    """Hold the lock of each named artifact set in `directory` (sorted, so two
    holders never wait on each other)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    held = []
    try:
        for name in sorted(set(sets)):
            f = open(directory / f".{name}.lock", "a+")
            held.append(f)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield
    finally:
        for f in reversed(held):
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()


def _meta(d: Path, name: str) -> dict | None:
    try:
        return json.loads((d / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _differs(meta: dict | None, want: dict) -> str | None:
    """None when `meta` was made with the wanted settings, else why not."""
    if meta is None:
        return "missing"
    have = meta.get("settings", {})
    diff = [f"{k}={have.get(k)!r} (want {v!r})" for k, v in want.items() if have.get(k) != v]
    return "made with " + ", ".join(diff) if diff else None


def _rank_names(d: Path) -> list[str]:
    return sorted((p.stem for p in d.glob("rank*.json") if p.stem[4:].isdigit()), key=lambda n: int(n[4:]))


def single_status(d: Path, p: Params, global_batch: int) -> str | None:
    m = _meta(d, "single")
    why = _differs(m, {"steps": p.steps, "seed": p.seed, "lr": p.lr, "opt": p.opt, "device": p.device})
    if why is None and m.get("global_batch") != global_batch:
        why = f"made at global batch {m.get('global_batch')} (want {global_batch})"
    return why


def fleet_status(d: Path, p: Params, steps: int) -> str | None:
    want = {"steps": steps, "batch": p.batch, "capacity": p.capacity, "seed": p.seed, "lr": p.lr,
            "shard": p.shard, "device": p.device, "opt": p.opt, "reduce": p.reduce}
    names = _rank_names(d)
    if names != [f"rank{r}" for r in range(p.world)]:
        return f"found {names or 'no ranks'} for a world of {p.world}"
    for n in names:
        m = _meta(d, n)
        why = _differs(m, want)
        if why is None and m.get("world_size") != p.world:
            why = f"made by a world of {m.get('world_size')}"
        if why:
            return f"{n} {why}"
    return None


def gradref_status(d: Path, p: Params) -> str | None:
    want = {"batch": p.batch, "capacity": p.capacity, "seed": p.seed, "lr": p.lr, "opt": p.opt, "world": p.world,
            "device": p.device}
    for n in ("gradref", "init"):
        why = _differs(_meta(d, n), want)
        if why:
            return f"{n} {why}"
    return None


def _fresh(d: Path, names: list[str], since: float) -> bool:
    """Every named JSON was written after `since` (by someone we waited for)."""
    try:
        return all((d / f"{n}.json").stat().st_mtime >= since for n in names)
    except OSError:
        return False


def _ensure(d: Path, lock: str, what: str, status: Callable[[], str | None], names: Callable[[], list[str]],
            make: Callable[[], None], *, p: Params, force: bool, log: Log, hint: str) -> str:
    """Produce artifact set `lock` in `d` unless it is there and fits.

    force: produce even if it fits, unless it was written while we waited for
    the lock (two notebooks asked for the same set at once: one run is enough).
    Returns "produced" or "reused"."""
    since = time.time()
    with locked(d, lock):
        why = status()
        if why is None and (not force or _fresh(d, names(), since)):
            log(f"{what}: using {d} (same settings)")
            return "reused"
        if why is not None and not force and not p.produce:
            raise MissingArtifactError(
                f"the {what} artifacts in {str(d)!r} are {why if why == 'missing' else 'unusable: ' + why} "
                f"and produce = False: run {hint} with these parameters first, or set produce = True.")
        log(f"{what}: producing in {d} ({'forced' if why is None else why})")
        make()
        after = status()
        if after is not None:
            raise DormouseError(f"the {what} run finished but its artifacts in {str(d)!r} are {after}")
        return "produced"


@contextmanager
def _threads(n: int = 1):
    """In-process runs use one thread: the fleet's ranks do, and the machine may be shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_PARTS = ("", "_grad", "_trace")  # an artifact's files: <name>, <name>_grad, <name>_trace


def _drop(d: Path, names: list[str]) -> None:
    """Remove named artifacts, their gradients and traces (JSON last-written, so first removed)."""
    for n in names:
        for part in _PARTS:
            for suffix in (".json", ".safetensors"):
                (d / f"{n}{part}{suffix}").unlink(missing_ok=True)


# --------------------------------------------------------------------------- producing artifacts


def run_single(p: Params, *, global_batch: int | None = None, force: bool = True, log: Log = print) -> dict:
    """01: one process at the global batch (`p.batch` unless given) in curve/."""
    from dormouse.gate import modes

    gb = p.batch if global_batch is None else global_batch
    d = p.curve_dir

    def make():
        with _threads(), briefly():
            modes.run_single(p.gate_settings(d, batch=gb, capacity=""), log=log)

    _ensure(d, "single", "single-process", lambda: single_status(d, p, gb), lambda: ["single"], make,
            p=p, force=force, log=log, hint="01_single.ipynb")
    return _load(d, "single")


def _launch(p: Params, d: Path, steps: int, stream: Log) -> None:
    from dormouse.gate.launcher import launch_fleet

    _drop(d, [f.name.split("_")[0].split(".")[0] for f in d.glob("rank*")
              if re.match(r"rank\d+(_grad|_trace)?\.(json|safetensors)$", f.name)])  # never two launches' ranks
    with briefly():
        launch_fleet(p.gate_settings(d, steps=steps), timeout_s=p.timeout_s, stream=stream)


def run_fleet(p: Params, *, force: bool = True, stream: Log = print) -> list[dict]:
    """02: the fleet for `p.steps` steps in curve/ (rank output streamed)."""
    d = p.curve_dir
    _ensure(d, "fleet", "fleet", lambda: fleet_status(d, p, p.steps), lambda: _rank_names(d),
            lambda: _launch(p, d, p.steps, stream), p=p, force=force, log=stream, hint="02_fleet_launcher.ipynb")
    return [_load(d, f"rank{r}") for r in range(p.world)]


def run_gradref(p: Params, *, force: bool = True, log: Log = print) -> dict:
    """03, first half: the hand-computed one-step reference (and init) in step/."""
    from dormouse.gate import modes

    d = p.step_dir

    def make():
        with _threads(), briefly():
            modes.run_gradref(p.gate_settings(d, steps=1), log=log)

    _ensure(d, "gradref", "gradref", lambda: gradref_status(d, p), lambda: ["gradref", "init"], make,
            p=p, force=force, log=log, hint="03_gradref.ipynb")
    return _load(d, "gradref")


def run_step_fleet(p: Params, *, force: bool = True, stream: Log = print) -> list[dict]:
    """03, second half: the fleet's ONE step under the same profile in step/."""
    d = p.step_dir
    _ensure(d, "fleet", "one-step fleet", lambda: fleet_status(d, p, 1), lambda: _rank_names(d),
            lambda: _launch(p, d, 1, stream), p=p, force=force, log=stream, hint="03_gradref.ipynb")
    return [_load(d, f"rank{r}") for r in range(p.world)]


def run_step(p: Params, *, force: bool = True, stream: Log = print) -> dict:
    """03: gradref and the one-step fleet; returns both artifacts' metadata."""
    return {"gradref": run_gradref(p, force=force, log=stream),
            "ranks": run_step_fleet(p, force=force, stream=stream)}


def ensure_all(p: Params, *, log: Log = print) -> dict:
    """04: every artifact set the verdict needs, produced only where missing or
    made by another configuration (or refused when p.produce is False)."""
    gb = p.global_batch()
    if gb is None:
        # A profile mixing window lengths has no single-process equivalent: the
        # curve check does not apply (gradref still does); drop a stale one.
        with locked(p.curve_dir, "single"):
            _drop(p.curve_dir, ["single"])
        log(f"capacity {p.capacity!r} mixes window lengths: no single-process curve; gradref is the reference")
    else:
        run_single(p, global_batch=gb, force=False, log=log)
    run_fleet(p, force=False, stream=log)
    run_gradref(p, force=False, log=log)
    run_step_fleet(p, force=False, stream=log)
    return {"single": gb is not None}


def _load(d: Path, name: str) -> dict:
    from dormouse.gate.artifacts import load_meta

    with briefly():
        return load_meta(d, name)


# --------------------------------------------------------------------------- the verdict


def curve_params(d: Path) -> dict | None:
    """Per tensor, max |fleet - single| / max |single| after the curve run
    (informational: the curve check judges the losses)."""
    from dormouse.gate.artifacts import load_tensors
    from dormouse.gate.verdict import _rel

    if not (d / "single.json").exists() or not (d / "rank0.json").exists():
        return None
    single, fleet = load_tensors(d, "single"), load_tensors(d, "rank0")
    return {"per_tensor": {k: _rel(fleet[k], single[k]) for k in single if k in fleet},
            "note": "fleet (rank0) vs single after the curve run, max|diff|/max|single| per tensor"}


def verdict(p: Params) -> dict:
    """Compare curve/ and step/ (each under its locks) into one verdict.

    `parts` holds dormouse.gate.verdict.compare() of each directory whole;
    `checks` merges their checks (the step run's checks that share a name with
    the curve run's get a `step_` prefix: `step_ranks`)."""
    from dormouse.gate.verdict import compare

    parts, extra = {}, {}
    with briefly():
        with locked(p.curve_dir, "single", "fleet"):
            parts[CURVE] = compare(p.curve_dir)
            extra["curve_params"] = curve_params(p.curve_dir)
        with locked(p.step_dir, "gradref", "fleet"):
            parts[STEP] = compare(p.step_dir)
    checks = dict(parts[CURVE]["checks"])
    for k, c in parts[STEP]["checks"].items():
        checks[f"step_{k}" if k in checks else k] = c
    ok = all(part["pass"] for part in parts.values())
    return {"pass": ok, "out": str(p.out), "checks": checks,
            "reasons": [f"{k}: {c.get('reason', '')}" for k, c in checks.items()],
            "parts": {k: {"pass": v_["pass"], "out": v_["out"], "checks": list(v_["checks"])} for k, v_ in parts.items()},
            "params": p.record(), **{k: v for k, v in extra.items() if v is not None}}


def write_verdict(v: dict, out: Path) -> Path:
    return atomic.write_text(Path(out) / VERDICT_FILE, json.dumps(v, indent=1, default=str))


def gate(p: Params, *, log: Log = print) -> dict:
    """04: ensure the artifacts, compare, write verdict.json; returns the verdict."""
    ensure_all(p, log=log)
    v = verdict(p)
    write_verdict(v, p.out)
    return v


def format_verdict(v: dict) -> str:
    lines = [f"gate verdict for {v['out']}: {'PASS' if v['pass'] else 'FAIL'}"]
    for k, c in v["checks"].items():
        lines.append(f"  [{'ok' if c.get('pass') else 'FAIL'}] {k}: {c.get('reason', '')}")
    return "\n".join(lines)


def raise_if_failed(v: dict) -> None:
    """Raise GateFailed (so papermill and nbmake fail) unless the gate passed."""
    if not v["pass"]:
        raise GateFailed(format_verdict(v))


# --------------------------------------------------------------------------- tables


class Table:
    """A small table that renders as HTML in a notebook and as text elsewhere."""

    def __init__(self, columns: list[str], rows: list[list], title: str = ""):
        self.columns, self.rows, self.title = list(columns), [list(r) for r in rows], title

    @staticmethod
    def _cell(x) -> str:
        if isinstance(x, float):
            return f"{x:.3e}" if x and (abs(x) < 1e-3 or abs(x) >= 1e5) else f"{x:.7g}"
        return str(x)

    def __str__(self) -> str:
        cells = [self.columns] + [[self._cell(x) for x in r] for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(([self.title] if self.title else []) + lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(self._cell(x))}</td>" for x in r) + "</tr>"
                       for r in self.rows)
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def params_table(p: Params, names: list[str] | None = None) -> Table:
    rec = p.record()
    return Table(["parameter", "value"], [[k, rec[k]] for k in (names or rec)], "parameters")


def loss_table(meta: dict, every: int = 5) -> Table:
    losses = meta["losses"]
    rows = [[i + 1, l] for i, l in enumerate(losses) if (i + 1) % every == 0 or i in (0, len(losses) - 1)]
    return Table(["step", "loss"], rows, f"{meta['name']}: global batch {meta.get('global_batch', '?')}")


def ranks_table(d: Path) -> Table:
    """One row per rank: shape, final loss, fingerprint, and whether it is
    bitwise equal to rank0 (dormouse.gate.verdict.compare_ranks)."""
    from dormouse.gate.verdict import compare_ranks

    with briefly(), locked(d, "fleet"):
        names = _rank_names(d)
        metas = [_load(d, n) for n in names]
        c = compare_ranks(d)
    per = c.get("per_rank", {})
    rows = []
    for r, (n, m) in enumerate(zip(names, metas)):
        q = per.get(n, {})
        equal = "reference" if r == 0 else ("yes" if q.get("fingerprint_equal") and not q.get("unequal_tensors")
                                            and q.get("losses_equal") else "NO")
        shape = (m.get("shapes") or ["?"] * len(names))[r]
        rows.append([n, shape, m["losses"][-1] if m["losses"] else None, m["fingerprint"][:16], equal])
    return Table(["rank", "shape", "final loss", "fingerprint", "bitwise = rank0"], rows,
                 f"{d}: {c['reason']}")


def compare_step(p: Params) -> dict:
    """03: dormouse.gate.verdict.compare of step/ (gradref vs the one-step fleet, ranks)."""
    from dormouse.gate.verdict import compare

    with briefly(), locked(p.step_dir, "gradref", "fleet"):
        return compare(p.step_dir)


def gradref_table(v: dict, top: int | None = None) -> Table:
    """Per tensor: the fleet's one-step parameters against gradref, largest
    difference first. `v`: a verdict (compare's or the pipeline's) or its gradref check."""
    c = v.get("checks", {}).get("gradref", {}) if "checks" in v else v
    per = c.get("per_tensor", {})
    names = sorted(per, key=lambda k: -per[k]["param_rel"])[:top]
    cols = ["param_rel", "step_rel"] + [c_ for c_ in ("grad_rel",) if any(c_ in per[k] for k in names)]
    rows = [[k, *(per[k].get(c_, "") for c_ in cols)] for k in names]
    title = f"gradref [{'ok' if c.get('pass') else 'FAIL'}]: {c.get('reason', 'no gradref check')}"
    if top is not None and len(per) > top:
        title += f" (largest {top} of {len(per)} tensors)"
    return Table(["tensor", *cols], rows, title)


def verdict_table(v: dict) -> Table:
    return Table(["check", "result", "reason"],
                 [[k, "ok" if c.get("pass") else "FAIL", c.get("reason", "")] for k, c in v["checks"].items()],
                 f"gate verdict for {v['out']}: {'PASS' if v['pass'] else 'FAIL'}")


# --------------------------------------------------------------------------- the papermill runner


def parse_value(text: str):
    """papermill's -p conversion: int, float, True/False/None, else the string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def notebook_parameters(path: Path) -> list[str]:
    """The names a notebook's `parameters` cell assigns."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            return re.findall(r"^([A-Za-z_]\w*)\s*(?::[^=]*)?=", cell.source, re.M)
    return []


def run_pipeline(overrides: dict, *, executed: Path | None = None, notebooks=NOTEBOOKS,
                 log: Log = print, log_output: bool = True) -> dict | None:
    """Run the notebooks in order under papermill (the kernel in the caller's
    working directory); returns the verdict (None when 04 was not among
    them). Each override goes only to the
    notebooks whose parameters cell names it; 01 is given the global batch of
    the fleet the others describe. Raises ParameterError before running
    anything when an override is bad, GateFailed when the gate fails."""
    p = check(**overrides)  # before anything runs (or papermill is imported)
    import papermill as pm

    # The validated values (capacity normalised, out absolute); a world given
    # without a profile runs the batch on every rank, in every notebook.
    given = {k: getattr(p, k) for k in overrides}
    if "world" in overrides and "capacity" not in overrides:
        given["capacity"] = p.capacity
    if "out" in given:
        given["out"] = str(p.out)
    if executed is None:
        executed = EXECUTED_DIR if p.out == DEFAULT_OUT else p.out / "notebooks"
    executed = Path(executed)
    executed.mkdir(parents=True, exist_ok=True)
    for name in notebooks:
        src = NOTEBOOK_DIR / name
        declared = notebook_parameters(src)
        params = {k: v for k, v in given.items() if k in declared}
        if name.startswith("01"):
            gb = p.global_batch()
            if gb is None:
                log(f"== {name}: skipped (capacity {p.capacity!r} mixes window lengths: no single-process curve)")
                continue
            params["batch"] = gb
        log(f"== {name} {' '.join(f'-p {k} {v}' for k, v in params.items())}".rstrip())
        try:
            pm.execute_notebook(str(src), str(executed / name), parameters=params, kernel_name="python3",
                                progress_bar=False, log_output=log_output)
        except pm.PapermillExecutionError as e:
            if e.ename == GateFailed.__name__:
                v = json.loads((p.out / VERDICT_FILE).read_text())
                raise GateFailed(format_verdict(v)) from None
            raise NotebookFailed(f"{name} failed ({e.ename}: {e.evalue}); executed copy: "
                                 f"{executed / name}") from None
    if not any(n.startswith("04") for n in notebooks):
        return None  # no verdict without 04
    return json.loads((p.out / VERDICT_FILE).read_text())


class NotebookFailed(_OneMessage, DormouseError):
    """A pipeline notebook failed for a reason other than the gate's verdict."""


def _cli() -> argparse.ArgumentParser:
    a = argparse.ArgumentParser(
        prog="python -m dormouse.gate.pipeline",
        description="Run notebooks 01-04 under papermill; executed copies, figures and verdict.json "
                    "go to artifacts/. Exit 0 when the gate passes, 1 when it fails, 2 on bad input.")
    a.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="a notebook parameter (papermill's conversion), e.g. -p world 3 -p capacity 4,2,1")
    a.add_argument("-r", "--raw", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="a parameter kept as a string")
    a.add_argument("--executed", default=None,
                   help="where executed notebooks go (default artifacts/notebooks, or <out>/notebooks)")
    a.add_argument("--only", default="",
                   help="run only these notebooks, by number: e.g. 04 (re-judge artifacts already there)")
    a.add_argument("--quiet", action="store_true", help="do not echo the notebooks' output")
    return a


def main(argv: list[str] | None = None) -> int:
    args = _cli().parse_args(argv)
    overrides = {k: parse_value(v) for k, v in args.parameter}
    overrides.update({k: v for k, v in args.raw})
    if not args.quiet:
        import logging

        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        # papermill logs each cell's output at INFO, between its own markers
        handler.addFilter(lambda r: not re.match(r"(Executing|Ending) Cell \d+-+$", r.getMessage()))
        log = logging.getLogger("papermill")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    chosen = tuple(n for n in NOTEBOOKS if not only or n[:2] in only)
    if not chosen or (only and len(set(only)) != len(chosen)):
        print(f"error: --only {args.only!r}: name notebooks by number, among "
              f"{', '.join(n[:2] for n in NOTEBOOKS)}", file=sys.stderr)
        return 2
    try:
        v = run_pipeline(overrides, executed=args.executed and Path(args.executed), notebooks=chosen,
                         log_output=not args.quiet)
    except ParameterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GateFailed as e:
        print(e)
        return 1
    except DormouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the running notebook's kernel (and any fleet it launched) was stopped",
              file=sys.stderr)
        return 130
    if v is None:
        print(f"ran {', '.join(chosen)}; no verdict without 04")
        return 0
    print(format_verdict(v))
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
