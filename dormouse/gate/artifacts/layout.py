"""Every name of the one run format, typed once: a recording's files, its
references' files, dormouse's own gate's references beside them, the schema
numbers and the wires. Everything that writes, finds or judges a file by name
(record, artifacts, judge) asks here; the readers live in dormouse.gate.artifacts.
"""

from __future__ import annotations

from pathlib import Path

RANK = "rank"  # rank r's files of a recording: rank<r>/


def rank_name(rank: int) -> str:
    return f"{RANK}{rank}"


# A recording of any training loop (written by record/recorder.py) and the
# one-process references made from it (record/reference/). Layout:
#   <out>/recording.json                     the run: world, segments, import paths, objective, provenance
#   <out>/rank{r}/init.safetensors           rank r's initial state (local shards under FSDP2; placements in
#                                            the file's metadata)
#   <out>/rank{r}/step{k:06d}.safetensors    in/{m}/{key}, rng/{m}/{device}, p/ g/ b/ (full; b/ persistent buffers)
#                                            or ps/ gs/ (sketched)
#   <out>/rank{r}/step{k:06d}.json           lr, loss, clip, no-grad names, param hash, ...
#   <out>/rank{r}/final.safetensors|.json    the parameters after the last step
#   <out>/reference/step{k:06d}.safetensors|.json  the references at step k
#   <out>/reference/reference.json           what the references were made from (their staleness key)

RECORDING_SCHEMA = 2  # 2: every field typed by artifacts/spec.py (RecordingSpec, RecordedRun)
EXTRA = "x/"  # a step's tensors a client keeps beside the run (Recorder.step(extra=...)): this rank's own

# A step file's tensors are keyed <prefix><name>; every prefix is typed here and nowhere else.
# The recording's (rank r's step file):
INPUT = "in/"  # a micro-batch's inputs: in/{m}/{key}
PARAM = "p/"  # the parameters before the step (the reference's replayed ones: REPLAY_PARAM)
GRAD = "g/"  # the synchronised gradient the optimizer stepped on; in the reference, one process's
BUFFER = "b/"  # the persistent buffers before the step
SKETCHED_PARAM, SKETCHED_GRAD, SKETCHED_BUFFER = "ps/", "gs/", "bs/"  # a sketched recording's (RecordingSpec(sketch=))
TP_INPUT = "tp/"  # a TP peer's (or a pipeline stage's, a CP rank's) own inputs, kept apart from its leader's
PROBE_OUTPUT, PROBE_GRAD = "po/", "pg/"  # the probed modules' outputs and their gradients (record/probe.py)
RNG_STATE = "rng/"  # rng/{m}/cpu (and rng/{m}/cuda): the RNG state micro-batch m's forward started from (uint8)
# The one-process reference's (reference/step{k}.safetensors; record/reference):
GRAD_NORMALISED = "gn/"  # each micro-batch's loss sum / N x W differentiated, summed, / W (HF's, DDP loops')
GRAD_MERGED = "gm/"  # the step's rows in one forward
WIRE_ABS = "wa/"  # sum_r |g_r| / T: every rank's contribution a reduce rounds
LAST_MICRO = "last/"  # the last micro-batch's own gradient
REPLAY_PARAM = "rp/"  # the replay's parameters before the step (reference/step{k}.replay.safetensors)
NUDGED_PARAM, NUDGED_GRAD = "np/", "ng/"  # a run mode's replay and gradient from parameters one ulp away
BUFFER_AFTER = "bu/"  # the buffers after the step as one process updates them
SAMPLED, SAMPLED_GRAD = "ex/", "exb/"  # the independence check's sampled micro-batches: reshaped, and as recorded
PROBE = "probe/"  # probe/{rank}/: a replica leader's probed micro-batch as one process computes it (probe_prefix)
PROBE_REF_OUTPUT, PROBE_REF_GRAD = "ro/", "rg/"  # ... its modules' outputs and gradients at the recorded parameters
PROBE_NUDGED_OUTPUT, PROBE_NUDGED_GRAD = "ron/", "rgn/"  # ... and from parameters one ulp away
# the alternative weightings a failing gradient is named by (record/reference/__init__.py): micro_mean/, ...
ALTERNATIVES = ("micro_mean", "rank_mean", "gm", "fwd")


def prefixed(prefix: str, tensors: dict) -> dict:
    """The tensors whose key starts with `prefix`, keyed by the rest of it."""
    return {k[len(prefix):]: tensors[k] for k in tensors if k.startswith(prefix)}  # by key: a lazy mapping reads only these


def micro_input(m: int, prefix: str = INPUT) -> str:
    """The prefix of micro-batch m's inputs (a TP peer's own: prefix TP_INPUT): in/{m}/{key}."""
    return f"{prefix}{m}/"


def rng_key(m: int, device: str) -> str:
    """The key of the `device` ("cpu", "cuda") RNG state micro-batch m's forward started from: rng/{m}/{device}."""
    return f"{RNG_STATE}{m}/{device}"


def probe_prefix(rank: int) -> str:
    """The reference's probe tensors of the replica led by `rank`."""
    return f"{PROBE}{rank}/"


def alternative(name: str) -> str:
    """The prefix of the alternative weighting `name` (one of ALTERNATIVES)."""
    return f"{name}/"


# how a recorded loop's gradient reduce rounds (RecordingSpec(wire=...)): "fp32", or "bf16" (every summand and
# partial sum rounded to bfloat16 on the wire: DDP's bf16_compress_hook, dormouse's reduce="bf16")
WIRES = ("fp32", "bf16")


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


def step_done_path(out: Path, rank: int, step: int) -> Path:
    """Rank r's marker that it wrote everything of `step` (tensors, JSON, the report after the optimizer
    step): a follower (`gate check --follow`) judges a step once every rank's marker is there."""
    return rank_dir(out, rank) / f"step{step:06d}.done"


# the reference-free checks' numbers in a step's tensors (RecordingSpec(selfcheck=k)), every step, at the step's k
# sampled elements of each tensor (artifacts/selfcheck.py): each rank's local gradient before the reduce and
# the sum of its contributions' magnitudes, its synchronised gradient (0 outside its shard under FSDP2), its
# parameters and their checksum (replicas only)
LOCAL_SKETCH, ABS_SKETCH, SYNC_SKETCH, PARAM_SKETCH = "sl/", "sa/", "ss/", "sp/"


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


REPLAY_SUFFIX = ".replay.safetensors"  # the replay's own file beside each step's


def reference_replay_tensors_path(out: Path, step: int) -> Path:
    """The replay's parameters before `step` ("rp/"), written by the replay's own pass."""
    return reference_dir(out) / f"step{step:06d}{REPLAY_SUFFIX}"


def reference_scratch_dir(out: Path) -> Path:
    """Where the reference spills one step's micro-batch gradients while it combines them (emptied after)."""
    return reference_dir(out) / ".scratch"


def reference_scratch_step_dir(out: Path, step: int) -> Path:
    """One step's spilled sources (emptied when its file is written)."""
    return reference_scratch_dir(out) / f"step{step}"


def scratch_source_path(scratch: Path, index: int) -> Path:
    """The `index`-th spilled source of a step's scratch folder."""
    return Path(scratch) / f"{index}.safetensors"


def reference_step_meta_path(out: Path, step: int) -> Path:
    return reference_dir(out) / f"step{step:06d}.json"


def reference_final_path(out: Path) -> Path:
    return reference_dir(out) / "final.safetensors"


# a micro-batch's labels the loop gave its loss and not the model (rec.labels): recorded under this key,
# never passed to the forward; the built-in objectives (and the judge's counts) read them before "labels"
LOSS_LABELS = "loss_labels"


# dormouse's own gate: its out dir is its fleet's recording; the references only its own trainer has
# live in that recording's reference folder, beside the one-process reference every recording gets:
#   <out>/reference/single/        a recording of one process at the global batch
#   <out>/reference/floor.json     that run's round-off floor (its nudged runs, step by step)
#   <out>/reference/exact/         a recording of the exact reference (reduce="exact")
#   <out>/reference/gradref.json   the bytes, tokens and evals by the data rule's own arithmetic
GATE_SCHEMA = 3  # floor.json, gradref.json
SINGLE, EXACT, GRADREF, FLOOR = "single", "exact", "gradref", "floor"
ONE_PROCESS = (SINGLE, FLOOR, EXACT)  # the references that run the global batch in one process (mode single)


def gate_reference_dir(out: Path, name: str) -> Path:
    """The recording of one of the gate's one-process references (SINGLE, EXACT)."""
    return reference_dir(out) / name


def gate_reference_path(out: Path, name: str) -> Path:
    """A JSON reference of the gate's (GRADREF, FLOOR)."""
    return reference_dir(out) / f"{name}.json"
