"""Producing the gate notebooks' artifact sets, once, under a lock.

Artifacts record the settings that made them; an artifact set that is missing
or was made by another configuration is produced again through the library.
Producing a set is serialised by an flock on `.<set>.lock` in its directory, so
two notebooks running at once never produce (or read) a half-written set.

Sets (see dormouse.gate.params for the layout): `single` and `fleet` in
curve/ (01, 02), `gradref` and `fleet` in step/ (03); 04 ensures all four.
"""

from __future__ import annotations

import fcntl
import json
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from dormouse.errors import DormouseError
from dormouse.gate import modes
from dormouse.gate.artifacts import load_meta
from dormouse.gate.launcher import launch_fleet
from dormouse.gate.params import Params
from dormouse.gate.verdict import rank_names

Log = Callable[[str], None]


class MissingArtifactError(DormouseError):
    """An artifact the verdict needs is missing and may not be produced here."""


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


def single_status(d: Path, p: Params, global_batch: int) -> str | None:
    m = _meta(d, "single")
    why = _differs(m, {"steps": p.steps, "seed": p.seed, "lr": p.lr, "opt": p.opt, "device": p.device})
    if why is None and m.get("global_batch") != global_batch:
        why = f"made at global batch {m.get('global_batch')} (want {global_batch})"
    return why


def fleet_status(d: Path, p: Params, steps: int) -> str | None:
    want = {"steps": steps, "batch": p.batch, "capacity": p.capacity, "seed": p.seed, "lr": p.lr,
            "shard": p.shard, "device": p.device, "opt": p.opt, "reduce": p.reduce}
    names = rank_names(d)
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
    want = {"steps": 1, "batch": p.batch, "capacity": p.capacity, "seed": p.seed, "lr": p.lr, "opt": p.opt,
            "world": p.world, "device": p.device}
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
            make: Callable[[], None], *, p: Params, force: bool, log: Log, hint: str):
    """Produce artifact set `lock` in `d` unless it is there and fits. Returns
    ("produced" or "reused", the set's metadata), the metadata read while the
    lock is still held (so a concurrent producer cannot swap the set between
    the check and the read).

    force: produce even if it fits, unless it was written while we waited for
    the lock (two notebooks asked for the same set at once: one run is enough)."""
    since = time.time()
    with locked(d, lock):
        why = status()
        if why is None and (not force or _fresh(d, names(), since)):
            log(f"{what}: using {d} (same settings)")
            return "reused", [load_meta(d, n) for n in names()]
        if why is not None and not force and not p.produce:
            raise MissingArtifactError(
                f"the {what} artifacts in {str(d)!r} are {why if why == 'missing' else 'unusable: ' + why} "
                f"and produce = False: run {hint} with these parameters first, or set produce = True.")
        log(f"{what}: producing in {d} ({'forced' if why is None else why})")
        make()
        after = status()
        if after is not None:
            raise DormouseError(f"the {what} run finished but its artifacts in {str(d)!r} are {after}")
        return "produced", [load_meta(d, n) for n in names()]


@contextmanager
def _threads(n: int = 1):
    """In-process runs use one thread: the fleet's ranks do, and the machine may be shared."""
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
    gb = p.batch if global_batch is None else global_batch
    d = p.curve_dir

    def make():
        with _threads():
            modes.run_single(p.gate_settings(d, batch=gb, capacity=""), log=log)

    return _ensure(d, "single", "single-process", lambda: single_status(d, p, gb), lambda: ["single"], make,
                   p=p, force=force, log=log, hint="01_single.ipynb")[1][0]


def _launch(p: Params, d: Path, steps: int, stream: Log) -> None:
    _drop(d, [f.name.split("_")[0].split(".")[0] for f in d.glob("rank*")
              if re.match(r"rank\d+(_grad|_trace)?\.(json|safetensors)$", f.name)])  # never two launches' ranks
    launch_fleet(p.gate_settings(d, steps=steps), timeout_s=p.timeout_s, stream=stream)


def _fleet(p: Params, d: Path, steps: int, what: str, hint: str, *, force: bool, stream: Log) -> list[dict]:
    """The fleet for `steps` steps in `d` (rank output streamed); its ranks' metadata."""
    return _ensure(d, "fleet", what, lambda: fleet_status(d, p, steps), lambda: rank_names(d),
                   lambda: _launch(p, d, steps, stream), p=p, force=force, log=stream, hint=hint)[1]


def run_fleet(p: Params, *, force: bool = True, stream: Log = print) -> list[dict]:
    """02: the fleet for `p.steps` steps in curve/ (rank output streamed)."""
    return _fleet(p, p.curve_dir, p.steps, "fleet", "02_fleet_launcher.ipynb", force=force, stream=stream)


def run_gradref(p: Params, *, force: bool = True, log: Log = print) -> dict:
    """03, first half: the hand-computed one-step reference (and init) in step/."""
    d = p.step_dir

    def make():
        with _threads():
            modes.run_gradref(p.gate_settings(d), log=log)

    return _ensure(d, "gradref", "gradref", lambda: gradref_status(d, p), lambda: ["gradref", "init"], make,
                   p=p, force=force, log=log, hint="03_gradref.ipynb")[1][0]


def run_step_fleet(p: Params, *, force: bool = True, stream: Log = print) -> list[dict]:
    """03, second half: the fleet's ONE step under the same profile in step/."""
    return _fleet(p, p.step_dir, 1, "one-step fleet", "03_gradref.ipynb", force=force, stream=stream)


def run_step(p: Params, *, force: bool = True, stream: Log = print) -> dict:
    """03: gradref and the one-step fleet; returns both artifacts' metadata."""
    return {"gradref": run_gradref(p, force=force, log=stream),
            "ranks": run_step_fleet(p, force=force, stream=stream)}


def changed_since_ensured(p: Params) -> str | None:
    """Call with curve/ and step/ locked: None if their artifacts are still
    those `p` asks for, else what changed (another notebook replaced them)."""
    gb = p.global_batch()
    checks = [("curve", lambda: fleet_status(p.curve_dir, p, p.steps)),
              ("step", lambda: gradref_status(p.step_dir, p) or fleet_status(p.step_dir, p, 1))]
    if gb is not None:
        checks.insert(0, ("curve", lambda: single_status(p.curve_dir, p, gb)))
    for where, status in checks:
        why = status()
        if why:
            return f"{where}: {why}"
    return None


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
