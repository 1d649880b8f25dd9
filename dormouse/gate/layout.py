"""The names of a gate run's artifacts, typed once: a rank's name (`rank<r>`,
the first leg's `leg1_rank<r>`), the fleet's initial state, a trace's file,
and which files belong to one launch of the fleet or to the one-process
references. Everything that writes, finds, drops or judges them by name
(artifacts, record, judge) asks here; the format's readers live in
dormouse.gate.artifacts."""

from __future__ import annotations

import re

RANK = "rank"  # a rank's artifacts: rank<r>.json / .safetensors (trace format), rank<r>/ (a recording)
LEG1 = "leg1_"  # prefix of the first leg's rank artifacts (a fleet that stops and resumes at another world)
INIT = "init"  # the fleet's initial state
TRACE = "_trace"  # <name>_trace.safetensors: a run's trace beside its artifact
ONE_PROCESS = ("single", "exact")  # the references that run the global batch in one process
SUFFIXES = ("json", "safetensors")


def rank_name(rank: int, *, first_leg: bool = False) -> str:
    """rank<r>, or leg1_rank<r> for the first leg of a fleet that stopped and resumed."""
    return f"{LEG1 if first_leg else ''}{RANK}{rank}"


def rank_names(world: int, *, first_leg: bool = False) -> list[str]:
    """Every rank's name of a world, in rank order."""
    return [rank_name(r, first_leg=first_leg) for r in range(world)]


def rank_of(name: str, prefix: str = "") -> int | None:
    """r for a name `<prefix>rank<r>` (None for any other name)."""
    m = re.fullmatch(re.escape(prefix + RANK) + r"([0-9]+)", name)
    return int(m.group(1)) if m else None


def trace_file(name: str) -> str:
    return f"{name}{TRACE}.safetensors"


def _artifact(stems: str, filename: str) -> bool:
    return re.fullmatch(rf"({stems})\.({'|'.join(SUFFIXES)})", filename) is not None


def is_fleet_file(filename: str) -> bool:
    """A file one launch of the fleet writes: init, every leg's ranks and their traces."""
    return _artifact(rf"({LEG1})?{RANK}[0-9]+({TRACE})?|{INIT}", filename)


def is_one_process_file(filename: str) -> bool:
    """A file of the one-process references (single, exact) or their traces."""
    return _artifact(rf"({'|'.join(ONE_PROCESS)})({TRACE})?", filename)
