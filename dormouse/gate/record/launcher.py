"""Launch a torchrun fleet of gate ranks as a subprocess and watch it.

`launch_fleet` starts `python -m torch.distributed.run --standalone
--nproc_per_node=W -m dormouse.gate rank ...` (`torchrun` below; its ranks
forked from the agent on request) in a process group of its own, streams every
output line to `stream` as it arrives (into a notebook cell, say), and on
timeout or interrupt kills the whole group (agent and ranks), so no rank
outlives the call. On success it returns the ranks' artifact metadata;
on failure it raises FleetError with the failing rank and the output's tail.
A plan of several launches (a stop-and-resume's two legs) starts each launch
while the one before it runs, its ranks held at their start until that one
has succeeded (`hold_for_go`), and kills it when that one fails.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dormouse import atomic
from dormouse.errors import PEER_LOST, FleetError
from dormouse.gate import artifacts as A
from dormouse.gate.settings import VALIDATED_FLAG, GateSettings

# Two ways to start a fleet's ranks, both torchrun's own CLI, elastic agent,
# rendezvous, restarts and failure report:
# - one fresh interpreter per rank (the gate's default, what a user's torchrun
#   and separate machines give);
# - forked (FORKED_RANKS: torchrun's --run-path --start-method fork; the rank
#   script runs through runpy in a process forked from the agent after its
#   `import torch`): a 2-rank launch that only joins the group takes 3.7 s and
#   3.5 CPU-s against 7.4 s and 10 CPU-s (`dormouse bench`'s
#   fleet_launch_fixed_s measures both). But forked ranks share the agent's
#   interpreter state: Python's string-hash secret above all, which no forked
#   process can change. A fleet whose ranks agree only because they hash alike
#   (code ordering its gradients by iterating a set of names) passes forked and
#   fails with an interpreter per rank (tests/gate/record/test_launcher.py), so the
#   gate's verdicts come from fresh interpreters, and forked ranks are for runs
#   whose subject is not that (the tests' many fleets, the bench) and for a
#   launch of one rank (the default stop-and-resume's second leg): with no
#   peer, no rank can agree with another by hashing alike.
# CUDA fleets are never forked: CUDA cannot be used in a process forked from
# one that touched it, and nothing here proves the agent never does.
FORKED_RANKS = ["--run-path", "--start-method", "fork"]
# A rank forked while one of the agent's threads is inside glibc's getaddrinfo inherits its resolver
# lock held, and waits on it for ever at its first name lookup (seen: a rank stuck in TCPStore's
# connect to "localhost", its peers waiting 30 minutes in gloo's rendezvous). A forked standalone
# fleet therefore names its rendezvous node by number (the agent never resolves its own name, the
# ranks' MASTER_ADDR is numeric); the ranks' gloo device is named by interface where the caller sets
# GLOO_SOCKET_IFNAME (the tests and the bench set "lo"), else gloo resolves the host's name.
FORKED_STANDALONE = ["--local-addr", "127.0.0.1"]


def torchrun(entry: list[str], *, world: int = 2, launch: list[str] | None = None,
             forked: bool = True) -> list[str]:
    """The command that runs `entry` (`[script, *args]`, or `["-m", module,
    *args]`: the module's file runs as the script) on every rank of a
    one-machine torchrun fleet of `world` ranks (or under the torchrun
    arguments `launch`), its ranks forked (FORKED_RANKS) unless `forked` is
    False (then `-m` stays torchrun's own)."""
    if not forked:
        return [sys.executable, "-m", "torch.distributed.run",
                *(launch or ["--standalone", f"--nproc_per_node={world}"]), *entry]
    if entry[:1] == ["-m"]:
        spec = importlib.util.find_spec(entry[1])
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__, as -m runs
            spec = importlib.util.find_spec(f"{entry[1]}.__main__")
        if spec is None or not spec.origin:
            raise FleetError(f"no module named {entry[1]!r} to run on the ranks")
        entry = [spec.origin, *entry[2:]]
    return [sys.executable, "-m", "torch.distributed.run",
            *(launch or ["--standalone", f"--nproc_per_node={world}", *FORKED_STANDALONE]), *FORKED_RANKS, *entry]


def rank_command(s: GateSettings, *, entry: list[str] | None = None, plan: Path | None = None,
                 leg: int = 0) -> list[str]:
    """The `dormouse.gate rank` arguments for settings `s` (or a plan file of
    settings validated with it), with the mark of validated settings (the
    ranks then rely on it, settings.VALIDATED_FLAG)."""
    cmd = [*(entry or ["-m", "dormouse.gate"]), "rank", f"--leg={leg}"]
    if plan is not None:
        return [*cmd, f"--out={s.out_dir}", "--plan", str(plan), *([VALIDATED_FLAG] if s.validated else [])]
    return [*cmd, *s.to_argv()]


def torchrun_command(s: GateSettings, *, entry: list[str] | None = None, plan: Path | None = None,
                     torchrun_args: list[str] | None = None, leg: int = 0, fork_ranks: bool = False) -> list[str]:
    world = s.legs()[leg - 1].world if leg else s.world
    # A launch of one rank has no peer to share a hash secret with: forked (one import of torch, not two).
    return torchrun(rank_command(s, entry=entry, plan=plan, leg=leg), world=world, launch=torchrun_args,
                    forked=(fork_ranks or (world == 1 and not torchrun_args)) and s.device != "cuda")


def launch_fleet(s: GateSettings, *, timeout_s: float = 300, stream=print, entry: list[str] | None = None,
                 torchrun_args: list[str] | None = None, env: dict | None = None,
                 fork_ranks: bool = False) -> A.RecordingSet:
    """Run the fleet for settings `s`; returns its recording.

    entry: what each rank runs instead of dormouse.gate's entry point (tests pass a
    script that injects a fault, then calls dormouse.gate's main).
    fork_ranks: fork the ranks from torchrun's agent (see FORKED_RANKS) instead
    of one fresh interpreter per rank.
    """
    return launch_plan([s], timeout_s=timeout_s, stream=stream, entry=entry,
                       torchrun_args=torchrun_args, env=env, fork_ranks=fork_ranks)[0]


def launch_plan(plan: list[GateSettings], *, timeout_s: float = 300, stream=print,
                entry: list[str] | None = None, torchrun_args: list[str] | None = None,
                env: dict | None = None, fork_ranks: bool = False) -> list[A.RecordingSet]:
    """Several fleet runs in as few torchrun launches as their world sizes
    allow: the runs of one launch run one after another in the same process
    group (the same code path as one run per launch); returns each run's
    recording, in the plan's order. A fleet that stops and resumes at another
    world size (resume_world) runs its two legs in two launches (--leg 1,
    then --leg 2): every first leg, and every run in one launch, goes before
    any second leg, so one launch holds the second legs of every run that
    resumes at that world size (`launches`)."""
    # Checked once, before any process starts: validated settings (every
    # driver's: check, from_args, by_hand) are relied on as they are, and the
    # ranks are told so (rank_command).
    plan = [s.validate() for s in plan]
    if not plan:
        raise FleetError("a plan needs at least one run")
    if torchrun_args and (len({s.world for s in plan}) > 1 or any(len(s.legs()) == 2 for s in plan)):
        raise FleetError("custom torchrun arguments launch one world size in one leg: set resume_world = 0")
    for s in plan:
        s.out_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(plan[0].threads), **(env or {})}
    started: list[_Launch] = []
    try:
        for i, (legs, runs) in enumerate(launches(plan)):
            plan_file = None
            if len(runs) > 1:
                plan_file = runs[0].out_dir / f"plan_leg{max(legs)}.json"
                atomic.write_text(plan_file, json.dumps([{"leg": leg, "settings": dataclasses.asdict(s)}
                                                         for leg, s in zip(legs, runs)], indent=1))
            cmd = torchrun_command(runs[0], entry=entry, plan=plan_file, torchrun_args=torchrun_args,
                                   leg=legs[0], fork_ranks=fork_ranks)
            # Each launch after the first starts while the one before it runs, its ranks held (hold_for_go)
            # until that one has succeeded: its agent's `import torch` and its ranks' start-up are then off
            # the fleet's path (a forked second leg: about 3 s of a tiny fleet's 8).
            go = None if i == 0 else runs[0].out_dir / f".launch{i}-{os.getpid()}-{time.monotonic_ns()}.go"
            launch_env = full_env if go is None else {**full_env, HOLD_ENV: str(go),
                                                      HOLD_S_ENV: f"{timeout_s * 2 + 60:.0f}"}
            started.append(_Launch(cmd, launch_env, go))
            if i > 0:
                _follow(started[-2], timeout_s=timeout_s, stream=stream)
                started[-1].release()
        _follow(started[-1], timeout_s=timeout_s, stream=stream)
    finally:
        for launch in started:
            launch.close()
    return [A.RecordingSet(s.out_dir) for s in plan]  # (run.py, and torch, imported now: after the launches)


def launches(plan: list[GateSettings]) -> list[tuple[list[int], list[GateSettings]]]:
    """The torchrun launches of a plan, in order: (each run's leg, the runs),
    one world size each (leg 0: a run in one launch; 1 and 2: the two legs
    of a stop-and-resume). One launch per world size holds every one-launch
    run and first leg at that size; then one per world size the second legs
    (each resumes its own first leg's checkpoint). The plan's order is kept
    inside each launch."""
    groups: dict[tuple[int, int], list[tuple[int, GateSettings]]] = {}
    for s in plan:
        legs = s.legs()
        for leg in ([1, 2] if len(legs) == 2 else [0]):
            world = legs[leg - 1].world if leg else s.world
            groups.setdefault((2 if leg == 2 else 1, world), []).append((leg, s))
    return [([leg for leg, _ in runs], [s for _, s in runs])
            for _, runs in sorted(groups.items(), key=lambda kv: kv[0][0])]


HOLD_ENV, HOLD_S_ENV = "DORMOUSE_HOLD", "DORMOUSE_HOLD_S"  # a held launch's go-file, and how long its ranks wait


class _Launch:
    """One torchrun launch, a subprocess in a session of its own (killed as a group), its output
    pumped into a queue from the start (a held launch's output waits there until it is followed).
    `go`: the file whose creation releases its held ranks (None: not held)."""

    def __init__(self, cmd: list[str], env: dict, go: Path | None = None):
        self.cmd, self.go, self.lines = cmd, go, queue.Queue()
        if go is not None:
            go.unlink(missing_ok=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True, bufsize=1)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def release(self) -> None:
        if self.go is not None:
            atomic.write_text(self.go, "")

    def close(self) -> None:
        """Kill whatever of the launch still runs (a held launch whose predecessor failed), drop its go-file."""
        if self.proc.poll() is None:
            _kill_group(self.proc)
        if self.go is not None:
            self.go.unlink(missing_ok=True)


def hold_for_go() -> None:
    """A rank of a held launch (HOLD_ENV set by launch_plan) waits here until the launch before its own
    has succeeded and the launcher created the go-file; a launcher that died without either (the go-file
    never comes) is waited for HOLD_S_ENV seconds, then the rank ends with one line."""
    go = os.environ.get(HOLD_ENV)
    if not go:
        return
    deadline = time.monotonic() + float(os.environ.get(HOLD_S_ENV, "3600"))
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise FleetError(f"this launch was held until the launch before it ended, and no word came in "
                             f"{os.environ.get(HOLD_S_ENV)} s (the launcher is gone): run the fleet again")
        time.sleep(0.01)
    for name in (HOLD_ENV, HOLD_S_ENV):  # released: nothing this rank starts is held by it
        os.environ.pop(name, None)


def _follow(launch: _Launch, *, timeout_s: float, stream) -> list[str]:
    """Stream a launch's output until it ends (its command first); FleetError when it fails or runs past
    timeout_s from now (its whole group killed), or on an interrupt."""
    stream(f"$ {' '.join(launch.cmd)}")
    proc, q, lines = launch.proc, launch.lines, []
    deadline = time.monotonic() + timeout_s
    try:
        done = False
        while not done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _kill_group(proc)
                raise FleetError(
                    f"the fleet did not finish within {timeout_s:.0f} s and was killed (all ranks); "
                    f"last output: {' | '.join(lines[-3:])}"
                )
            try:
                line = q.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                done = True
            else:
                lines.append(line)
                stream(line)
        rc = proc.wait()
    except BaseException:  # KeyboardInterrupt (a notebook's stop button) included
        _kill_group(proc)
        raise
    if rc != 0:
        raise FleetError(f"the fleet failed (exit status {rc}): {failure_summary(lines)}")
    return lines


def failure_summary(lines: list[str]) -> str:
    """One sentence from a failed fleet's output: our own error lines, and
    torchrun's account of which rank failed with which exit code."""
    ours = [l.split("error: ", 1)[1] for l in lines if "error: " in l]
    failed = []
    for i, l in enumerate(lines):
        m = re.search(r"rank\s*:\s*(\d+)", l)
        if m and any("exitcode" in x for x in lines[i:i + 4]):
            code = next((re.search(r"exitcode\s*:\s*(-?\d+)", x) for x in lines[i:i + 4]
                         if re.search(r"exitcode\s*:\s*(-?\d+)", x)), None)
            failed.append(f"rank {m.group(1)} exited with {code.group(1) if code else '?'}")
    # A rank whose peer vanished says so; it is named only when nothing else is.
    lost = sorted({l for l in ours if PEER_LOST in l})
    parts = sorted(set(ours) - set(lost)) + sorted(set(failed))
    parts = parts or lost
    return "; ".join(parts) if parts else " | ".join(lines[-5:])


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the fleet's process group, SIGKILL whatever is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
