"""Producing a gate run's artifact sets, once, under a lock (the running side
the notebooks and the pipeline call).

One out dir holds every set: `single` (the reference, its floors and, under
reduce="exact", the exact reference), `fleet` (rank0..rank{W-1} and init),
`gradref` and `replay` (both computed from the fleet's recorded run). A set
is produced again when it is missing, was made with other settings, by other
code (the source hash in its provenance), or from another fleet run. Each set
is produced under an flock on `.<set>.lock`, so two notebooks running at once
never produce (or read) a half-written set.
"""

from __future__ import annotations

import fcntl
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from dormouse.errors import DormouseError
from dormouse.gate.artifacts import LEG1, ArtifactSet, load_meta, source_hash
from dormouse.gate.artifacts.layout import (
    INIT,
    is_fleet_file,
    is_one_process_file,
    rank_name,
    rank_names,
)
from dormouse.gate.record import modes
from dormouse.gate.record.launcher import launch_fleet
from dormouse.gate.settings import GateSettings

Log = Callable[[str], None]
SETS = ("single", "fleet", "gradref", "replay")


class MissingArtifactError(DormouseError):
    """An artifact the verdict needs is missing and may not be produced here."""


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


def stale(d: Path, name: str, s: GateSettings) -> str | None:
    """None when artifact `name` was made by this code with settings `s`, else why not."""
    m = _meta(d, name)
    if m is None:
        return f"{name} missing"
    have = m.get("settings", {})
    want = s.record()
    diff = [f"{k}={have.get(k)!r} (want {v!r})" for k, v in want.items() if have.get(k) != v]
    if diff:
        return f"{name} made with " + ", ".join(diff)
    if m.get("provenance", {}).get("source") != source_hash():
        return f"{name} made by other code"
    return None


def status(set_name: str, s: GateSettings) -> str | None:
    """Why artifact set `set_name` must be produced again (None: it fits)."""
    d = s.out_dir
    if set_name == "single":
        why = stale(d, "single", s)
        if why is None and s.reduce == "exact":
            why = stale(d, "exact", s)
        return why
    if set_name == "fleet":
        names, world = ArtifactSet(d).ranks(), s.legs()[-1].world
        if names != rank_names(world):
            return f"found {names or 'no ranks'} for a world of {world}"
        return next((w for w in (stale(d, n, s) for n in [INIT, *names]) if w), None)
    # gradref and replay are computed from one fleet run: they must name it.
    why = stale(d, set_name, s)
    fleet = _meta(d, rank_name(0))
    if why is None and (fleet is None or _meta(d, set_name).get("fleet") != fleet.get("fingerprint")):
        why = f"{set_name} was computed from another fleet run"
    return why


def _ensure(s: GateSettings, set_name: str, make: Callable[[], None], *, force: bool, log: Log,
            hint: str) -> str:
    """Produce `set_name` unless it is there and fits (or was produced while
    we waited for its lock). Returns "produced" or "reused"."""
    since = time.time()
    d = s.out_dir
    with locked(d, set_name):
        why = status(set_name, s)
        fresh = why is None and all(p.stat().st_mtime >= since for p in d.glob("*.json")
                                    if p.stem in _members(set_name, s))
        if why is None and (not force or fresh):
            log(f"{set_name}: using {d} (same settings, same code)")
            return "reused"
        if why is not None and not force and not s.produce:
            raise MissingArtifactError(f"the {set_name} artifacts in {str(d)!r} are unusable ({why}) and "
                                       f"produce = False: run {hint} with these parameters first, or set "
                                       "produce = True.")
        log(f"{set_name}: producing in {d} ({'forced' if why is None else why})")
        make()
        after = status(set_name, s)
        if after is not None:
            raise DormouseError(f"the {set_name} run finished but its artifacts in {str(d)!r} are unusable: {after}")
        return "produced"


def _members(set_name: str, s: GateSettings) -> list[str]:
    return {"single": ["single"] + (["exact"] if s.reduce == "exact" else []),
            "fleet": [INIT, *rank_names(s.legs()[-1].world)]}.get(set_name, [set_name])


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _drop(d: Path, belongs: Callable[[str], bool]) -> None:
    """Remove the artifacts whose file names `belongs` (JSON first: it is what says complete)."""
    files = [p for p in d.iterdir() if belongs(p.name)]
    for p in sorted(files, key=lambda p: p.suffix != ".json"):
        p.unlink(missing_ok=True)


def run_single(s: GateSettings, *, force: bool = True, log: Log = print) -> str:
    """01: the single process at the global batch (and its floors, and the exact reference)."""
    def make():
        with _threads(s.threads):
            modes.run_single(s, log=log)

    return _ensure(s, "single", make, force=force, log=log, hint="01_single.ipynb")


def run_fleet(s: GateSettings, *, force: bool = True, stream: Log = print) -> str:
    """02: the fleet under torchrun (rank output streamed)."""
    def make():
        _drop(s.out_dir, is_fleet_file)  # never two launches' ranks
        launch_fleet(s, timeout_s=s.timeout_s, stream=stream)

    return _ensure(s, "fleet", make, force=force, log=stream, hint="02_fleet_launcher.ipynb")


def run_references(s: GateSettings, *, force: bool = True, log: Log = print) -> dict[str, str]:
    """03: gradref and the replay, from the fleet's recorded run."""
    def make(mode):
        def run():
            with _threads(s.threads):
                modes.MODES[mode](s, log=log)
        return run

    with locked(s.out_dir, "fleet"):
        if status("fleet", s) is not None:
            raise MissingArtifactError(f"no fleet run with these settings in {str(s.out_dir)!r} "
                                       f"({status('fleet', s)}): run 02_fleet_launcher.ipynb first")
        return {m: _ensure(s, m, make(m), force=force, log=log, hint="03_gradref.ipynb")
                for m in ("gradref", "replay")}


def ensure_all(s: GateSettings, *, log: Log = print) -> None:
    """04: every set the verdict needs, produced only where missing or stale."""
    if s.plan.global_batch is None:
        log(f"profile {s.profile!r} mixes window lengths: no single-process curve; gradref and the "
            "replay are the references")
        with locked(s.out_dir, "single"):
            _drop(s.out_dir, is_one_process_file)
        run_fleet(s, force=False, stream=log)
    else:
        # The fleet (torchrun's processes) runs while this process computes the
        # single run and its floors: they share nothing but the corpus file.
        import threading
        from concurrent.futures import ThreadPoolExecutor

        lock = threading.Lock()

        def said(line: str) -> None:  # one line at a time from both (print writes a line and its end apart)
            with lock:
                log(line)

        with ThreadPoolExecutor(max_workers=1) as pool:
            fleet = pool.submit(run_fleet, s, force=False, stream=said)
            run_single(s, force=False, log=said)
            fleet.result()
    run_references(s, force=False, log=log)


def fleet_set(s: GateSettings) -> ArtifactSet:
    """The fleet's artifacts (every leg's ranks), read whole under the fleet's
    lock, so no producer replaces them while they are shown."""
    with locked(s.out_dir, "fleet"):
        a = ArtifactSet(s.out_dir)
        for n in a.ranks(LEG1) + a.ranks():
            a.meta(n), a.tensors(n)
    return a


def fleet_metas(s: GateSettings) -> list[dict]:
    return [load_meta(s.out_dir, n) for n in rank_names(s.legs()[-1].world)]
