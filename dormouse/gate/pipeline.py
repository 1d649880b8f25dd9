"""The gate notebooks' combined verdict and their papermill runner,
`python -m dormouse.gate.pipeline` (notebooks 01-04 in order).

The notebooks in notebooks/ hold parameters, a call or two into the library,
a table and a plot; every decision lives in dormouse.gate where tests reach
it: settings (settings), producing artifacts (produce), judging (judge),
tables (tables), figures (plots), and here the verdict of one out dir.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

from dormouse.errors import EXIT_CRASHED, EXIT_FAILED, DormouseError, OneLineParser, command_status
from dormouse.gate.judge.verdict import Verdict
from dormouse.gate.show.text import VERDICT_FILE, format_verdict, write_verdict
from dormouse.gate.record.produce import SETS, Log, ensure_all, locked, status
from dormouse.gate.cli import add_arguments
from dormouse.gate.settings import (ALIASES, ARTIFACTS, DEFAULT_OUT, FIELDS, REPO_ROOT, GateSettings, ParameterError,
                                    check)

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
EXECUTED_DIR = ARTIFACTS / "notebooks"
NOTEBOOKS = ("01_single.ipynb", "02_fleet_launcher.ipynb", "03_gradref.ipynb", "04_compare_plots.ipynb")


class GateFailed(DormouseError):
    """The gate ran and found the fleet does not compute the single process's mathematics."""

    exit_status = EXIT_FAILED  # the verdict, printed as it is


class NotebookFailed(DormouseError):
    """A pipeline notebook failed for a reason other than the gate's verdict."""

    exit_status = EXIT_CRASHED  # a fleet or a reference crashed: not the verdict, not the input


# --------------------------------------------------------------------------- the verdict


def verdict(s: GateSettings) -> Verdict:
    """Judge the out dir under every set's lock, after checking that the sets
    are still those `s` asks for (another notebook may have replaced them)."""
    with locked(s.out_dir, *SETS):
        sets = [n for n in SETS if n != "single" or s.plan.global_batch is not None]
        changed = next((w for w in (status(n, s) for n in sets) if w), None)
        if changed:
            raise DormouseError(f"the artifacts changed while the verdict was being taken ({changed}): "
                                "run 04 again (or give each concurrent run its own out)")
        from dormouse.gate.judge.entry import judge

        return judge(s.out_dir, s)


def gate(s: GateSettings, *, log: Log = print) -> Verdict:
    """04: ensure the artifacts, judge, write verdict.json; returns the verdict."""
    ensure_all(s, log=log)
    v = verdict(s)
    write_verdict(v, s.out_dir, settings=s.record())
    return v


def check_recording(out, *, force: bool = False, log: Log = print, memory: int | None = None) -> Verdict:
    """`dormouse gate check` and notebook 04 on a recording: the one-process
    reference (made when missing or stale), the verdict, verdict.json; the
    caller draws the figures (show.plots.render_recording). The verdict is
    judge(out)'s, the one entry: dormouse's own gate's out dir gets its own
    references' facts too (their files are not made here: the pipeline makes them).
    memory: the budget in bytes (gate/budget.py; None: 80% of what the machine
    has available, 0: none): past it the verdict is "not judged: needs N GB"."""
    from dormouse.gate import budget as B
    from dormouse.gate.judge.entry import judge
    from dormouse.gate.judge.verdict import Check
    from dormouse.gate.judge.forms import needs_normalised
    from dormouse.gate.record.reference import make_reference

    limit = B.default_budget() if memory is None else int(memory)
    B.return_freed_memory()
    before = _recording_stamp(out)
    try:
        B.check_fits(out, limit)
        with B.watched(limit):
            try:
                make_reference(out, force=force, log=log, normalised=needs_normalised)  # gn where g misses
            except Exception:
                _refuse_if_rewritten(out, before)
                raise
            _refuse_if_rewritten(out, before)
            B.return_freed_memory()
            v = judge(out)
            if _deferred(out, v):  # a failing check: its cause named from every step's fits and the probe
                log("a check fails: the reference again, with the module probe and the fits that name a failing "
                    "gradient's cause at every step")
                make_reference(out, force=True, log=log, normalised=True)
                _refuse_if_rewritten(out, before)
                v = judge(out)
    except B.NotJudged as e:
        v = Verdict(str(out), False, [Check("complete", False, str(e))], [])
    write_verdict(v, out)
    return v


def _deferred(out, v: Verdict) -> bool:
    """Whether a check of v fails on a reference that deferred what names a failure's cause: the module
    probe (record/reference/replay.py), or, at a step the fleet passed by half its bound, the fits of
    a failing gradient (record/reference/spilled.drop_fits)."""
    from dormouse.gate.artifacts.run import ReferenceSet

    if v.passed:
        return False
    ref = ReferenceSet(out)
    steps = ref.meta.get("steps", [])
    return bool(ref.meta.get("probe_deferred")) or any(ref.info(k).get("fits_dropped") for k in steps)


def sharded_launch() -> bool:
    """Whether this process is one rank of several (torchrun's WORLD_SIZE > 1): `gate check` then
    computes the reference sharded over the ranks (check_sharded)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_sharded(out, *, force: bool = False, log: Log = print) -> Verdict | None:
    """`torchrun --nproc_per_node N -m dormouse gate check --out DIR`: the one-process reference
    computed with the model sharded by FSDP2 over the launch's ranks (record/reference/sharded.py:
    the same files, so the judge reads them unchanged), then judged on rank 0 as check_recording
    judges, with one more line saying how the reference was made; the other ranks get None (and
    exit quietly). Bad input on any rank ends every rank (rank 0 says it). --memory does not apply:
    what each rank holds is set by the model and N (sharded.py)."""
    import datetime

    import torch.distributed as dist

    from dormouse.gate.judge.entry import judge
    from dormouse.gate.judge.verdict import Check
    from dormouse.gate.record.reference.sharded import make_sharded_reference, sharded_note

    if not dist.is_initialized():  # a peer that failed inside a collective is waited for at most this long
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    make_sharded_reference(out, force=force, log=log if rank == 0 else (lambda line: None))
    dist.barrier()
    if rank != 0:
        return None
    v = judge(out)
    note = sharded_note(out)
    if note:
        v.checks.append(Check("sharded", True, note))
    write_verdict(v, out)
    return v


def _recording_stamp(out) -> tuple | None:
    """recording.json's modification time and bytes (None when there is none): what a training that
    writes into the recording changes."""
    from dormouse.gate.artifacts import recording_path

    path = recording_path(out)
    try:
        return path.stat().st_mtime_ns, path.read_bytes()
    except OSError:
        return None


def _refuse_if_rewritten(out, before) -> None:
    """One line when the recording changed while it was judged: importing the
    user's builders ran a training that recorded into the same directory."""
    from dormouse.errors import DormouseError

    if before is not None and _recording_stamp(out) != before:
        raise DormouseError(f"the recording in {out} was rewritten while it was judged: importing the module of "
                            "build_model / build_optimizer ran a training that recorded into it (the recording "
                            "is now that run's, and may be incomplete). Keep that module importable without "
                            "training: guard the training under `if __name__ == \"__main__\":` (e.g. "
                            "trainer.train()), then record again")


def raise_if_failed(v: Verdict) -> None:
    """Raise GateFailed (so papermill and nbmake fail) unless the gate passed."""
    if not v.passed:
        raise GateFailed(format_verdict(v))


# --------------------------------------------------------------------------- the papermill runner


def notebook_parameters(path: Path) -> list[str]:
    """The names a notebook's `parameters` cell assigns."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            return re.findall(r"^([A-Za-z_]\w*)\s*(?::[^=]*)?=", cell.source, re.M)
    return []


@functools.cache
def kernel_manager_class():
    """The kernel manager every notebook run of ours uses (papermill's and
    nbmake's, through notebooks/conftest.py): jupyter_client's, with its five
    sockets on Unix-domain files in a fresh private directory instead of TCP
    ports on 127.0.0.1. The client picks those ports by binding port 0 and
    closing it, and the kernel binds them a second or two later; any process
    that binds port 0 in between (torchrun's rendezvous store, gloo's pair
    listeners: a fleet beside the notebook) may be given the same port, and
    the kernel dies with "Address already in use" (it did, once, in the CI
    suite). A file name cannot be taken that way. jupyter_client's own ipc
    default is the relative path "kernel-ipc", shared by every kernel started
    in one directory, so the path is set here. Plain TCP where Unix sockets
    are not to be had (Windows) or the temporary directory's path is too long
    for one (sun_path: 108 bytes)."""
    import os
    import shutil
    import tempfile

    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    prefix = "dormouse-kernel-"

    class PrivateSocketKernelManager(AsyncKernelManager):
        @default("transport")
        def _transport_default(self) -> str:
            # in bytes: mkdtemp adds "/<prefix><8 chars>", the sockets "/kernel-<n>"
            return "ipc" if os.name == "posix" and len(os.fsencode(tempfile.gettempdir())) <= 70 else "tcp"

        def _ip_default(self) -> str:  # jupyter_client's dynamic default, by its name
            if self.transport != "ipc":
                return super()._ip_default()
            return os.path.join(tempfile.mkdtemp(prefix=prefix), "kernel")  # absolute: any kernel cwd finds it

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart=restart)  # removes the socket files
            folder = os.path.dirname(self.ip)
            if not restart and self.transport == "ipc" and os.path.basename(folder).startswith(prefix):
                shutil.rmtree(folder, ignore_errors=True)

        cleanup_resources = _async_cleanup_resources  # AsyncKernelManager's own spelling

    return PrivateSocketKernelManager


def run_pipeline(overrides: dict, *, executed: Path | None = None, notebooks=NOTEBOOKS,
                 log: Log = print, log_output: bool = True, on_verdict=None) -> dict | None:
    """Run the notebooks under papermill (the kernel in the caller's working
    directory); returns the verdict (None when 04 was not among them). Each
    override goes only to the notebooks whose parameters cell names it; 01 is
    given the global batch of the fleet the others describe. Raises
    ParameterError before running anything when an override is bad,
    GateFailed when the gate fails.

    With all four notebooks, the artifacts are produced and judged first, in
    this process (`gate`: the same functions 04 calls), and `on_verdict`
    receives the verdict as soon as it exists; the notebooks then find every
    set fresh, present it, and run side by side (each in its own kernel: a
    kernel's start-up and imports are most of a notebook's time). Alone or
    in a subset, they run in order and produce what they need themselves."""
    p = check(**overrides)  # before anything runs (or papermill is imported)
    if not NOTEBOOK_DIR.is_dir():
        raise DormouseError(f"no notebooks at {NOTEBOOK_DIR}: the pipeline runs from a checkout of the "
                            "repository installed with `pip install -e .` (a plain install has no notebooks)")
    import importlib.util

    if importlib.util.find_spec("papermill") is None:  # found now, imported after the verdict
        raise DormouseError("the pipeline runs the notebooks with papermill, which is not installed: "
                            "pip install -e '.[notebooks]'")

    # The validated values (profile normalised, out absolute, old names as
    # new), and the defaults that followed them (settings._defaults_follow:
    # a world or a batch without a profile, a mixed-window profile's one launch).
    given = {ALIASES.get(k, k): getattr(p, ALIASES.get(k, k)) for k in overrides}
    for derived in ("profile", "resume_world"):
        if derived not in given and getattr(p, derived) != getattr(GateSettings(), derived):
            given[derived] = getattr(p, derived)
    if "out" in given:
        given["out"] = str(p.out_dir)
    if executed is None:
        executed = EXECUTED_DIR if p.out_dir == DEFAULT_OUT else p.out_dir / "notebooks"
    executed = Path(executed)
    executed.mkdir(parents=True, exist_ok=True)
    side_by_side = set(notebooks) == set(NOTEBOOKS)
    if side_by_side:
        log("== producing and judging (single, fleet, gradref, replay), then the four notebooks side by side")
        gate(p, log=log)
        if on_verdict is not None:
            on_verdict(json.loads((p.out_dir / VERDICT_FILE).read_text()))
    import papermill as pm  # after the verdict: its import (~3 s) is not on the verdict's path

    runs = []
    for name in notebooks:
        declared = notebook_parameters(NOTEBOOK_DIR / name)
        params = {k: v for k, v in given.items() if k in declared}
        if name.startswith("01") and p.plan.global_batch is None:
            log(f"== {name}: skipped (profile {p.profile!r} mixes window lengths: no single-process curve)")
            continue
        runs.append((name, params))

    def execute(name: str, params: dict, echo: bool) -> None:
        try:
            pm.execute_notebook(str(NOTEBOOK_DIR / name), str(executed / name), parameters=params,
                                kernel_name="python3", progress_bar=False, log_output=echo,
                                kernel_manager_class=kernel_manager_class())
        except pm.PapermillExecutionError as e:
            if e.ename == GateFailed.__name__:
                raise GateFailed(format_verdict(json.loads((p.out_dir / VERDICT_FILE).read_text()))) from None
            raise NotebookFailed(f"{name} failed ({e.ename}: {e.evalue}); executed copy: "
                                 f"{executed / name}") from None

    if side_by_side:
        from concurrent.futures import ThreadPoolExecutor

        for name, params in runs:
            log(f"== {name} {' '.join(f'-p {k} {v}' for k, v in params.items())}".rstrip())
        with ThreadPoolExecutor(max_workers=len(runs)) as pool:
            futures = [pool.submit(execute, name, params, False) for name, params in runs]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if isinstance(e, GateFailed)] or [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        log(f"== executed notebooks in {executed}")
    else:
        for name, params in runs:
            log(f"== {name} {' '.join(f'-p {k} {v}' for k, v in params.items())}".rstrip())
            execute(name, params, log_output)
    if not any(n.startswith("04") for n in notebooks):
        return None  # no verdict without 04
    return json.loads((p.out_dir / VERDICT_FILE).read_text())


def _cli() -> argparse.ArgumentParser:
    a = OneLineParser(
        prog="dormouse pipeline",
        description="Run notebooks 01-04 under papermill with the gate's settings (every `dormouse gate` "
                    "flag: --world 3 --profile 4,2,1); executed copies, figures and verdict.json go to the out dir. "
                    "Exit 0 when the gate passes, 1 when it fails, 2 on bad input, 3 when a notebook crashed.")
    add_arguments(a, skip=("out",), given_only=True)
    a.add_argument("--out", dest="out", default=argparse.SUPPRESS,
                   help="artifact directory (default: <repository>/artifacts/gate)")
    a.add_argument("--executed", default=None,
                   help="where executed notebooks go (default artifacts/notebooks, or <out>/notebooks)")
    a.add_argument("--only", default="",
                   help="run only these notebooks, by number: e.g. 04 (re-judge artifacts already there)")
    a.add_argument("--quiet", action="store_true", help="do not echo the notebooks' output")
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        args = _cli().parse_args(argv)
    except SystemExit as e:  # a bad flag: argparse printed its one line; its status is returned like any other
        return int(e.code or 0)
    return command_status("pipeline", lambda: _main(args))


def _main(args) -> int:
    overrides = {k: getattr(args, k) for k in FIELDS if hasattr(args, k)}
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
        raise ParameterError(f"--only {args.only!r}: name notebooks by number, among "
                             f"{', '.join(n[:2] for n in NOTEBOOKS)}")
    shown = []

    def show(verdict: dict) -> None:  # as soon as the verdict exists, before the notebooks present it
        print(format_verdict(verdict), flush=True)
        shown.append(verdict)

    try:
        v = run_pipeline(overrides, executed=args.executed and Path(args.executed), notebooks=chosen,
                         log_output=not args.quiet, on_verdict=show)
    except GateFailed:
        if not shown:
            raise  # errors.command_status prints it (status 1)
        return EXIT_FAILED
    if v is None:
        print(f"ran {', '.join(chosen)}; no verdict without 04")
        return 0
    if not shown:
        print(format_verdict(v))
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
