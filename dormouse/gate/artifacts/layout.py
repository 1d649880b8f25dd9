"""Every name of the gate's run format, typed once: rank and leg names, the
files of a recording and of its references, the trace format's files (until
the fleet's recording replaces them), the schema numbers and the wires.

The names of a gate run's artifacts, typed once: a rank's name (`rank<r>`,
the first leg's `leg1_rank<r>`), the fleet's initial state, a trace's file,
and which files belong to one launch of the fleet or to the one-process
references. Everything that writes, finds, drops or judges them by name
(artifacts, record, judge) asks here; the format's readers live in
dormouse.gate.artifacts.
"""

from __future__ import annotations

import re
from pathlib import Path

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


SCHEMA = 2


def trace_path(out: Path, name: str) -> Path:
    """Where the per-step trace of artifact `name` lives."""
    return Path(out) / trace_file(name)


# A recording of any training loop (written by record/recorder.py) and the
# one-process references made from it (record/reference.py). Layout:
#   <out>/recording.json                     the run: world, segments, import paths, objective, provenance
#   <out>/rank{r}/init.safetensors           rank r's initial state (local shards under FSDP2; placements in
#                                            the file's metadata)
#   <out>/rank{r}/step{k:06d}.safetensors    in/{m}/{key}, p/ g/ b/ (full; b/ persistent buffers) or ps/ gs/ (sketched)
#   <out>/rank{r}/step{k:06d}.json           lr, loss, clip, no-grad names, param hash, ...
#   <out>/rank{r}/final.safetensors|.json    the parameters after the last step
#   <out>/reference/step{k:06d}.safetensors|.json  the references at step k
#   <out>/reference/reference.json           what the references were made from (their staleness key)

RECORDING_SCHEMA = 1


# how a recorded loop's gradient reduce rounds (Recorder(wire=...)): "fp32", or "bf16" (every summand and
# partial sum rounded to bfloat16 on the wire: DDP's bf16_compress_hook, dormouse's reduce="bf16")
WIRES = ("fp32", "bf16")


def fleet_recording_dir(out: Path) -> Path:
    """Where a gate's fleet writes its recording (GateSettings.recording = 1)."""
    return Path(out) / "recording"


def recording_path(out: Path) -> Path:
    return Path(out) / "recording.json"


def rank_dir(out: Path, rank: int) -> Path:
    return Path(out) / rank_name(rank)


def init_path(out: Path, rank: int) -> Path:
    return rank_dir(out, rank) / "init.safetensors"


def step_tensors_path(out: Path, rank: int, step: int) -> Path:
    return rank_dir(out, rank) / f"step{step:06d}.safetensors"


def step_meta_path(out: Path, rank: int, step: int) -> Path:
    return rank_dir(out, rank) / f"step{step:06d}.json"


def step_files(out: Path, rank: int) -> list[Path]:
    """Every step JSON rank r wrote (any segment), in step order."""
    return sorted(rank_dir(out, rank).glob("step[0-9][0-9][0-9][0-9][0-9][0-9].json"))


def final_tensors_path(out: Path, rank: int) -> Path:
    return rank_dir(out, rank) / "final.safetensors"


def final_meta_path(out: Path, rank: int) -> Path:
    return rank_dir(out, rank) / "final.json"


def reference_dir(out: Path) -> Path:
    return Path(out) / "reference"


def reference_meta_path(out: Path) -> Path:
    return reference_dir(out) / "reference.json"


def reference_step_tensors_path(out: Path, step: int) -> Path:
    return reference_dir(out) / f"step{step:06d}.safetensors"


def reference_step_meta_path(out: Path, step: int) -> Path:
    return reference_dir(out) / f"step{step:06d}.json"


def reference_final_path(out: Path) -> Path:
    return reference_dir(out) / "final.safetensors"


# a micro-batch's labels the loop gave its loss and not the model (rec.labels): recorded under this key,
# never passed to the forward; the built-in objectives (and the judge's counts) read them before "labels"
LOSS_LABELS = "loss_labels"
