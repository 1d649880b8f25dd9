"""Producing a gate run's artifacts, once, under a lock (the running side
the notebooks and the pipeline call).

One out dir is the fleet's recording and holds every set (artifacts/layout.py):
`fleet` (the recording itself), `single` (reference/single/, its floor and,
under reduce="exact", reference/exact/), `gradref` (reference/gradref.json)
and `reference` (the one-process reference every recording gets, made from
the fleet's recording). A set is produced again when it is missing, was made
with other settings, by other code (the source hash in its provenance), or
from another fleet run. Each set is produced under an flock on
`.<set>.lock`, so two notebooks running at once never produce (or read) a
half-written set.
"""

from __future__ import annotations

import fcntl
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import (
    FLOOR,
    GRADREF,
    ONE_PROCESS,
    SINGLE,
    references,
    source_hash,
)
from dormouse.gate.record.launcher import launch_fleet
from dormouse.gate.settings import GateSettings

Log = Callable[[str], None]
FLEET, REFERENCE = "fleet", "reference"
SETS = (SINGLE, FLEET, GRADREF, REFERENCE)


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


def _recorded(d: Path) -> dict | None:
    """The extra (settings, provenance) of the recording in `d`, None when there is none to read."""
    if not A.recording_path(d).exists():  # a fresh out dir's fleet is launched before anything imports torch
        return None
    try:
        rec = A.RecordingSet(d)
        return {**rec.extra, "run": rec.run, "world": rec.world_at(rec.steps[-1]), "closed": rec.recorded.closed}
    except DormouseError:
        return None


def _gate_json(d: Path, name: str) -> dict | None:
    try:
        return A.GateReferences(d).meta(name)
    except DormouseError:
        return None


def stale(made: dict | None, name: str, want: dict) -> str | None:
    """None when `made` (a set's recorded settings and provenance) was made by this code with the
    settings recorded as `want` (GateSettings.record())."""
    if made is None:
        return f"{name} missing"
    have = made.get("settings") or {}
    diff = [f"{k}={have.get(k)!r} (want {v!r})" for k, v in want.items() if have.get(k) != v]
    if diff:
        return f"{name} made with " + ", ".join(diff)
    if (made.get("provenance") or {}).get("source") != source_hash():
        return f"{name} made by other code"
    return None


def status(set_name: str, s: GateSettings) -> str | None:
    """Why artifact set `set_name` must be produced again (None: it fits)."""
    d, want = s.out_dir, s.record()
    if set_name == SINGLE:  # the one-process references that apply (artifacts.references)
        parts = [n for n in references(want) if n in ONE_PROCESS]
        want = {k: v for k, v in want.items() if k not in A.FLEET_LAUNCH_FIELDS}  # none of them reads these
        return next((w for w in (stale(_recorded(A.gate_reference_dir(d, n)) if n != FLOOR else _gate_json(d, n),
                                       n, want) for n in parts) if w), None)
    fleet = _recorded(d)
    if set_name == FLEET:
        why = stale(fleet, FLEET, want)
        if why is None and (not fleet["closed"] or fleet["world"] != s.legs()[-1].world):
            why = f"the fleet's recording is unfinished or of {fleet['world']} ranks, not {s.legs()[-1].world}"
        return why
    if fleet is None:
        return f"{set_name}: no fleet recording"
    if set_name == REFERENCE:
        from dormouse.gate.record.reference import is_current

        return None if is_current(d) else "the recording's one-process reference is missing or stale"
    g = _gate_json(d, GRADREF)  # computed from one fleet run: it must name it
    why = stale(g, GRADREF, want)
    return why or (None if g.get("run") == fleet["run"] else "gradref was computed from another fleet run")


def _ensure(s: GateSettings, set_name: str, make: Callable[[], None], *, force: bool, log: Log,
            hint: str) -> str:
    """Produce `set_name` unless it is there and fits (or was produced while
    we waited for its lock). Returns "produced" or "reused"."""
    since = time.time()
    d = s.out_dir
    with locked(d, set_name):
        why = status(set_name, s)
        fresh = why is None and all(p.stat().st_mtime >= since for p in _members(set_name, s) if p.exists())
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


def _members(set_name: str, s: GateSettings) -> list[Path]:
    """The file whose writing completes each of the set's parts."""
    d = s.out_dir
    one = [n for n in references(s.record()) if n in ONE_PROCESS]
    return {SINGLE: [A.gate_reference_path(d, n) if n == FLOOR else A.recording_path(A.gate_reference_dir(d, n))
                     for n in one],
            FLEET: [A.recording_path(d)], GRADREF: [A.gate_reference_path(d, GRADREF)],
            REFERENCE: [A.reference_meta_path(d)]}[set_name]


@contextmanager
def _threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _drop_fleet(d: Path) -> None:
    """A new fleet's recording starts in an emptied out dir: the old recording
    (its JSON first: it is what says complete), every rank's folder."""
    A.recording_path(d).unlink(missing_ok=True)
    for p in d.glob(f"{A.RANK}[0-9]*"):
        if p.is_dir():
            shutil.rmtree(p)


def run_single(s: GateSettings, *, force: bool = True, log: Log = print) -> str:
    """01: the single process at the global batch (and its floors, and the exact reference)."""
    def make():
        from dormouse.gate.record import modes

        with _threads(s.threads):
            modes.run_single(s, log=log)

    return _ensure(s, SINGLE, make, force=force, log=log, hint="01_single.ipynb")


def run_fleet(s: GateSettings, *, force: bool = True, stream: Log = print) -> str:
    """02: the fleet under torchrun (rank output streamed)."""
    def make():
        _drop_fleet(s.out_dir)  # never two launches' ranks
        launch_fleet(s, timeout_s=s.timeout_s, stream=stream)

    return _ensure(s, FLEET, make, force=force, log=stream, hint="02_fleet_launcher.ipynb")


def run_references(s: GateSettings, *, force: bool = True, log: Log = print) -> dict[str, str]:
    """03: gradref and the recording's one-process reference, from the fleet's recording."""
    def gradref():
        from dormouse.gate.record import modes

        with _threads(s.threads):
            modes.run_gradref(s, log=log)

    def reference():
        from dormouse.gate.record.reference import make_reference

        with _threads(s.threads):
            make_reference(s.out_dir, log=log, force=True)

    with locked(s.out_dir, FLEET):
        if status(FLEET, s) is not None:
            raise MissingArtifactError(f"no fleet run with these settings in {str(s.out_dir)!r} "
                                       f"({status(FLEET, s)}): run 02_fleet_launcher.ipynb first")
        return {n: _ensure(s, n, make, force=force, log=log, hint="03_gradref.ipynb")
                for n, make in ((GRADREF, gradref), (REFERENCE, reference))}


def ensure_all(s: GateSettings, *, log: Log = print) -> None:
    """04: every set the verdict needs, produced only where missing or stale."""
    if s.plan.global_batch is None:
        log(f"profile {s.profile!r} mixes window lengths: no single-process curve; gradref and the "
            "replay are the references")
        with locked(s.out_dir, SINGLE):
            for n in ONE_PROCESS:  # none applies: none may linger from another profile
                shutil.rmtree(A.gate_reference_dir(s.out_dir, n), ignore_errors=True)
                A.gate_reference_path(s.out_dir, n).unlink(missing_ok=True)
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


def fleet_recording(s: GateSettings) -> A.RecordingSet:
    """The fleet's recording, checked complete under the fleet's lock, so no
    producer replaces it while it is shown."""
    with locked(s.out_dir, FLEET):
        rec = A.RecordingSet(s.out_dir)
        rec.validate()
    return rec
