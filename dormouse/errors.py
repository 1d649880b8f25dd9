"""The errors dormouse raises on purpose.

Every one of them carries a message meant for the person at the keyboard: what
is wrong and what to do. Command-line entry points print that message alone
(no traceback) and exit with status 2, and a notebook shows it alone too
(IPython calls `_render_traceback_`); library callers can catch
`DormouseError` to tell "you asked for something impossible" from a bug.
"""

from __future__ import annotations

import argparse


class DormouseError(Exception):
    """A problem with the user's input or environment, stated in one message."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback: the message alone."""
        return [f"{type(self).__name__}: {self}"]


class ConfigError(DormouseError, ValueError):
    """A configuration field holds a value dormouse cannot run with."""


class DataError(DormouseError):
    """The corpus is missing, empty, or too short for the requested batch."""


class CheckpointError(DormouseError):
    """A checkpoint cannot be written, read, or does not belong to this run."""


class DivergedError(DormouseError):
    """Training produced a non-finite loss; the last good checkpoint is kept."""


class FleetError(DormouseError):
    """A data-parallel fleet is misconfigured or one of its ranks failed."""


class PlanError(ConfigError, FleetError):
    """The fleet's plan (profile, world, batch, micro-batch) cannot be made.

    `field` names what holds the bad value (profile, micro_batch, world),
    `value` is that value and `reason` says why and what to do, so callers
    that name the setting otherwise (the gate's settings) restate it without
    cutting the message apart."""

    def __init__(self, field: str, value, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} = {value!r}: {reason}")


# ---------------------------------------------------------------- what a command's exit status says
#
# THE one mapping from outcomes to exit statuses, for every dormouse command
# (`dormouse ...`, `python -m dormouse.gate`, the pipeline, the benchmarks).

EXIT_OK = 0  # done (or the gate passed)
EXIT_FAILED = 1  # the gate ran and failed
EXIT_BAD_INPUT = 2  # bad input or environment: one line starting "error:"
EXIT_CRASHED = 3  # a run crashed (a bug or a broken machine): one line naming the exception
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C


def end_rank_process(status: int) -> None:
    """End a fleet's rank that torchrun started as an interpreter of its own
    (its default start), at its `status`, without the interpreter's module
    teardown: after `import torch` that teardown takes about 1.3 s, on the
    path between one leg of a fleet and the next, and between the fleet and
    its references. What teardown would still do that matters runs first:
    atexit handlers, then the standard streams flushed; the rank's artifacts
    and checkpoints are written and closed before its command returns
    (dormouse.atomic). A rank forked from torchrun's agent (multiprocessing's
    child) returns to the agent, which collects it, so it is left alone, and
    so is every process torchrun did not start (TORCHELASTIC_RUN_ID unset:
    WORLD_SIZE alone is set by cluster wrappers too), one under a profiler or
    tracer, and one with a non-daemon thread still running. Files a caller
    left open without closing are not flushed: the rank's own writes close
    theirs."""
    import atexit
    import multiprocessing
    import os
    import sys
    import threading

    if "TORCHELASTIC_RUN_ID" not in os.environ or multiprocessing.parent_process() is not None:
        return  # not started by torchrun, or forked by its agent
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return  # a profiler or debugger writes its output at teardown
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return  # teardown would join it first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(status)


def _one_line(e: BaseException) -> str:
    """A DormouseError's message on one line (its parts joined, nothing dropped)."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _first_line(e: BaseException) -> str:
    """An unexpected exception's message, cut to its first line."""
    return (str(e).strip().splitlines() or [""])[0]


def command_status(command: str, call, *, traceback: bool = False) -> int:
    """Run `call()` (which returns an exit status) and map what it raises to
    a status and one line: a DormouseError is bad input (its `exit_status`,
    2 unless the class says otherwise: a failed gate's verdict is 1, on
    stdout), any other exception a crash (3, with its traceback first when
    `traceback`). In a torchrun fleet every rank meets the same bad input:
    rank 0 alone says so; a crash names its rank. The process group, if any,
    is left without waiting for peers."""
    import os
    import sys

    rank = os.environ.get("RANK") if "WORLD_SIZE" in os.environ else None
    try:
        return call()
    except DormouseError as e:
        status = getattr(e, "exit_status", EXIT_BAD_INPUT)
        if status == EXIT_FAILED:
            print(str(e), flush=True)
        elif rank in (None, "0"):
            print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
        _leave_fleet()
        return status
    except KeyboardInterrupt:
        print(f"interrupted: dormouse {command} stopped (with any fleet it launched)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:
        if e.errno not in _CANNOT_WRITE or (rank is not None and lost_a_peer(e)):
            return _crashed(command, e, rank, traceback)
        _quiet_stdout()  # what stdout still buffers would fail again at exit
        where = f"{e.filename}" if e.filename else "its output"
        print(f"error: dormouse {command}: cannot write {where}: {os.strerror(e.errno)}: free space there, or "
              "send the output where it can be written", file=sys.stderr, flush=True)
        _leave_fleet()
        return EXIT_BAD_INPUT
    except Exception as e:  # a bug or a broken environment: one line, and a status of its own
        return _crashed(command, e, rank, traceback)


# the errors of a write that had nowhere to go (a full disk, a quota, a closed pipe): the environment's
_CANNOT_WRITE = {28, 122, 32, 27}  # ENOSPC, EDQUOT, EPIPE, EFBIG


def _quiet_stdout() -> None:
    """Point stdout at /dev/null (its buffered text dropped), so that the interpreter's flush at exit
    does not meet the same failed write and print a traceback of its own."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _crashed(command: str, e: BaseException, rank, traceback: bool) -> int:
    """A bug or a broken environment: the traceback (when `traceback`) and one line naming the exception;
    a rank that lost a peer mid-collective says so and waits out torchrun's report."""
    import sys

    if rank is not None and lost_a_peer(e):
        # Not this rank's own failure: a peer went away mid-collective. torchrun's
        # report on ranks forked from its agent names the FIRST rank it sees exit,
        # so this one waits that report out (many times its 0.1 s poll) and the
        # report names the rank that failed first.
        import time

        print(f"error: rank {rank}: dormouse {command}: {PEER_LOST}: {_first_line(e)}", file=sys.stderr,
              flush=True)
        _leave_fleet()
        time.sleep(PEER_LOST_GRACE_S)
        return EXIT_CRASHED
    if traceback:
        import traceback as tb

        tb.print_exc()
    where = f"rank {rank}: " if rank is not None else ""
    print(f"error: {where}dormouse {command}: the run crashed: {type(e).__name__}: {_first_line(e)}",
          file=sys.stderr, flush=True)
    _leave_fleet()
    return EXIT_CRASHED


PEER_LOST = "a peer rank went away mid-collective (not this rank's failure)"
PEER_LOST_GRACE_S = 2.0  # how long a rank whose peer vanished waits before it exits (see command_status)


def lost_a_peer(e: BaseException) -> bool:
    """Whether `e` is a collective that failed because a peer's connection
    went away (gloo's words for a peer process that died)."""
    text = str(e)
    return any(w in text for w in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))


def _leave_fleet() -> None:
    """Leave a torch.distributed process group, if this process is in one,
    without waiting for peers that may be gone (a barrier would hang)."""
    import sys

    if "torch.distributed" not in sys.modules:
        return
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # already broken: nothing more to release
        pass


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line starting with "error:" (status
    2), like every other input error of dormouse's commands."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")
