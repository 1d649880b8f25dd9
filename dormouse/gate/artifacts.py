"""Gate artifacts: `<name>.json` (losses, fingerprint, configuration, extras)
beside `<name>.safetensors` (every parameter and persistent buffer by name).

Every artifact records its `provenance` (see `provenance`): what bitwise
results depend on besides the settings. The verdict refuses to compare
artifacts whose provenance differs, and the pipeline re-produces artifacts
made by other code.

The tensors are written first and the JSON last, each atomically, so a JSON
that exists always describes a complete set of tensors; a run killed midway
leaves either nothing or the previous artifact. The JSON records the
configuration that made it (`settings`), so a reader can tell an artifact
from another configuration apart from a missing one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.errors import DormouseError
# LEG1 and ONE_PROCESS are re-exported: the names are layout's
from dormouse.gate.layout import LEG1, ONE_PROCESS, rank_name, rank_of, trace_file  # noqa: F401
from dormouse.digest import fingerprint

SCHEMA = 2
# Settings that say how the global batch is cut among the fleet's ranks (and
# whether the fleet stops and resumes at another world): the one-process
# references (single, exact) depend on them only through the global batch, so
# they are compared with the fleet through it (normalised to the fleet's profile).
PROFILE_FIELDS = ("world", "batch", "capacity", "profile", "resume_world")
# Provenance keys every artifact of one gate run must share.
PROVENANCE = ("dormouse", "source", "torch", "device", "threads", "cpu_capability", "ns_kernel", "corpus", "init")


def references(settings: dict) -> list[str]:
    """The artifacts a verdict needs, from a gate run's settings as every
    artifact records them (GateSettings.record()): init, gradref and the
    replay always; single when the fleet's profile has one global batch
    (`global_batch` not None: one window length, so one process can hold it;
    a run from resume_from resumes it too); exact under reduce "exact" beside
    single. From the settings alone, never from the other artifacts under
    judgement (a rank artifact that lost its profile must not make a
    reference optional)."""
    if not isinstance(settings, dict) or "global_batch" not in settings or "reduce" not in settings:
        raise DormouseError("the settings record no global_batch or reduce (made by older code): re-run every mode")
    need = ["init", "gradref", "replay"]
    if settings["global_batch"] is not None:
        need.insert(0, "single")
    if settings["reduce"] == "exact" and "single" in need:
        need.append("exact")
    return need


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the dormouse package's Python source, file by file in path order."""
    import dormouse

    root = Path(dormouse.__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_artifact(out: Path, name: str, state: dict[str, torch.Tensor], losses: list[float],
                  **extra) -> Path:
    out = Path(out)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    atomic.write_bytes(out / f"{name}.safetensors", st_save(tensors))
    meta = {"schema": SCHEMA, "name": name, "losses": losses, "fingerprint": fingerprint(tensors),
            "params": f"{name}.safetensors", **extra}
    return atomic.write_text(out / f"{name}.json", json.dumps(meta, indent=1))


def load_meta(out: Path, name: str) -> dict:
    path = Path(out) / f"{name}.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DormouseError(f"artifact {str(path)!r} is missing: run the mode that writes it") from None
    except ValueError as e:
        raise DormouseError(f"artifact {str(path)!r} is not valid JSON ({e})") from e
    if meta.get("schema") != SCHEMA:
        raise DormouseError(f"artifact {str(path)!r} has schema {meta.get('schema')}, expected {SCHEMA}: re-run it")
    return meta


def load_tensors(out: Path, name: str) -> dict[str, torch.Tensor]:
    meta = load_meta(out, name)
    path = Path(out) / meta["params"]
    try:
        return st_load(path.read_bytes())
    except (OSError, Exception) as e:
        raise DormouseError(f"artifact tensors {str(path)!r} cannot be read ({e}): re-run the mode") from e


class ArtifactSet:
    """The artifacts of one out dir, read lazily and once: what the judge sees."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self._cache: dict = {}

    def has(self, name: str) -> bool:
        return (self.out / f"{name}.json").exists()

    def ranks(self, prefix: str = "") -> list[str]:
        """rank0, rank1, ... (prefix "leg1_": the first leg of a fleet that stopped and resumed)."""
        names = [p.stem for p in self.out.glob("*.json") if rank_of(p.stem, prefix) is not None]
        return sorted(names, key=lambda x: rank_of(x, prefix))

    def meta(self, name: str) -> dict:
        return self._get(("meta", name), lambda: load_meta(self.out, name))

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return self._get(("tensors", name), lambda: load_tensors(self.out, name))

    def trace(self, name: str) -> dict[str, torch.Tensor] | None:
        def read():
            path = trace_path(self.out, name)
            try:
                return st_load(path.read_bytes()) if path.exists() else None
            except Exception as e:
                raise DormouseError(f"trace {str(path)!r} cannot be read ({e}): re-run the mode") from e
        return self._get(("trace", name), read)

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


def trace_path(out: Path, name: str) -> Path:
    """Where the per-step trace of artifact `name` lives."""
    return Path(out) / trace_file(name)


def load_trace(out: Path, name: str) -> dict[str, torch.Tensor] | None:
    path = trace_path(out, name)
    return st_load(path.read_bytes()) if path.exists() else None


# --------------------------------------------------------------------------- recordings (issue 13)
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


def read_json(path: Path, what: str) -> dict:
    """A recording's JSON file, or one line saying which is missing or broken."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DormouseError(f"{what} {str(path)!r} is missing: the recording is incomplete "
                            "(a rank crashed, or the loop never called rec.close())") from None
    except ValueError as e:
        raise DormouseError(f"{what} {str(path)!r} is not valid JSON ({e}): re-record") from e


def read_tensors(path: Path, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, safetensors metadata) of one file, or one line saying what is wrong."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise DormouseError(f"{what} {str(path)!r} is missing: the recording is incomplete (a rank crashed?)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except Exception as e:
        raise DormouseError(f"{what} {str(path)!r} cannot be read ({e}): re-record") from e


def recording_steps(rec: dict) -> list[int]:
    """Every step of a recording: each segment's steps, a later segment
    (a resume) overriding the steps it re-ran."""
    segs = rec.get("segments", [])
    steps: list[int] = []
    for i, s in enumerate(segs):
        end = s.get("end")
        if end is None:
            continue
        if i + 1 < len(segs):
            end = min(end, segs[i + 1]["start"] - 1)
        steps = [k for k in steps if k < s["start"]] + list(range(s["start"], end + 1))
    return steps


def segment_of(rec: dict, step: int) -> dict:
    """The segment (its start, world, ...) that made `step`."""
    seg = None
    for s in rec.get("segments", []):
        if s["start"] <= step:
            seg = s
    if seg is None:
        raise DormouseError(f"step {step} is in no segment of the recording")
    return seg


def assemble(shards: list[torch.Tensor], placement: dict | None) -> torch.Tensor:
    """One full tensor from each rank's local piece: under FSDP2 Shard(dim)
    the pieces concatenated in rank order along `dim` (torch.chunk's split);
    unsharded (placement None), rank 0's tensor."""
    if not placement:
        return shards[0]
    full = torch.cat(shards, dim=placement["dim"])
    if list(full.shape) != list(placement["shape"]):
        raise DormouseError(f"shards of shape {[tuple(s.shape) for s in shards]} do not assemble to the recorded "
                            f"global shape {tuple(placement['shape'])}: re-record")
    return full


# recording.json's fields and the type each must have: a field of another type is one line (exit 2),
# not a traceback wherever it is read. (kind, schema, run: checked first; segments: each their own.)
_INT, _NUM, _STR = (int,), (int, float), (str,)
RECORDING_FIELDS = {
    "world": (_INT, False), "build_model": (_STR, False), "build_optimizer": (_STR, False),
    "build_kwargs": ((dict,), False), "objective": (_STR, False), "buffer_update": (_STR, True),
    "max_grad_norm": (_NUM, False), "dataset_len": (_INT, False), "example_corpus": (_STR, True),
    "example_corpus_sha256": (_STR, True), "sketch": (_INT, False), "every": (_INT, False), "seed": (_INT, False),
    "inputs": ((list,), False), "fsdp": ((bool,), False), "closed": ((bool,), False), "frozen": ((list,), False),
    "hf_config": ((dict,), True), "provenance": ((dict,), False), "steps": ((list,), True),
}
# a micro-batch's labels the loop gave its loss and not the model (rec.labels): recorded under this key,
# never passed to the forward; the built-in objectives (and the judge's counts) read them before "labels"
LOSS_LABELS = "loss_labels"
# a step JSON's numbers (None where the loop gave none) and counts
STEP_NUMBERS = ("lr", "loss", "clip_coef", "grad_norm")
STEP_FIELDS = {"micro_batches": (_INT, False), "epoch": (_INT, True), "no_grad": ((list,), False),
               "param_hash": (_STR, True), "tensors": ((bool,), False), "clipped": ((bool,), False)}


def _typed(x, types: tuple, nullable: bool) -> bool:
    if x is None:
        return nullable
    if isinstance(x, bool) and bool not in types:  # True is an int to Python, not to a recording
        return False
    return isinstance(x, types)


def _kind(types: tuple, nullable: bool) -> str:
    words = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
             bool: "true or false"}
    return " or ".join([words[types[-1] if types == _NUM else types[0]]] + (["null"] if nullable else []))


def validate_recording_meta(meta: dict, path: Path) -> None:
    """Every field of recording.json of the type it must have (RECORDING_FIELDS),
    the numbers in range, the segments well formed: one line on the first
    that is not."""
    for key, (types, nullable) in RECORDING_FIELDS.items():
        if key in meta and not _typed(meta[key], types, nullable):
            raise DormouseError(f"{path}: field {key!r} is {meta[key]!r}, not {_kind(types, nullable)}: the recording "
                                "was edited or is damaged: re-record")
    for key, low in (("world", 1), ("max_grad_norm", 0), ("dataset_len", 0), ("sketch", 0), ("every", 1)):
        if key in meta and not (meta[key] >= low and math.isfinite(meta[key])):
            raise DormouseError(f"{path}: field {key!r} is {meta[key]!r}, below {low}: re-record")
    segs = meta.get("segments")
    if not isinstance(segs, list) or not all(
            isinstance(sg, dict) and _typed(sg.get("start"), _INT, False) and _typed(sg.get("end"), _INT, True)
            and _typed(sg.get("world"), _INT, False) and sg["world"] >= 1 for sg in segs):
        raise DormouseError(f"{path}: field 'segments' is not a list of {{start, end, world}} with integer steps and "
                            "a world of at least 1: re-record")
    if segs and "world" in meta and meta["world"] != segs[-1]["world"]:
        raise DormouseError(f"{path}: field 'world' is {meta['world']} but its last segment ran at world "
                            f"{segs[-1]['world']}: the recording was edited: re-record")


def validate_step_meta(m: dict, path: Path) -> None:
    """A step JSON's numbers numbers (or null) and its counts of their type: one line."""
    for key in STEP_NUMBERS:
        if not _typed(m.get(key), _NUM, True):
            raise DormouseError(f"{path}: field {key!r} is {m[key]!r}, not a number or null: the recording was "
                                "edited or is damaged: re-record")
    for key, (types, nullable) in STEP_FIELDS.items():
        if key in m and not _typed(m[key], types, nullable):
            raise DormouseError(f"{path}: field {key!r} is {m[key]!r}, not {_kind(types, nullable)}: re-record")


def reference_final_path(out: Path) -> Path:
    return reference_dir(out) / "final.safetensors"


class RecordingSet:
    """A recording as the references and the judge read it: its JSON, its
    steps, each rank's step JSON and tensors, FSDP2 shards assembled.
    Reading only: it validates completeness (one line per problem)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        if not recording_path(self.out).exists():
            raise DormouseError(f"{self.out} holds no recording ({recording_path(self.out).name}): point --out at "
                                "the directory the Recorder wrote")
        self.meta = read_json(recording_path(self.out), "recording")
        if self.meta.get("kind") != "recording" or self.meta.get("schema") != RECORDING_SCHEMA:
            raise DormouseError(f"{recording_path(self.out)} is not a recording of schema {RECORDING_SCHEMA}: "
                                "re-record with this dormouse")
        validate_recording_meta(self.meta, recording_path(self.out))
        self.steps = recording_steps(self.meta)
        if not self.steps:
            raise DormouseError(f"the recording in {self.out} has no finished segment: the loop must call "
                                "rec.close() (every rank)")
        self.run = self.meta["run"]
        self.sketch = int(self.meta.get("sketch", 0))
        self.every = int(self.meta.get("every", 1))
        self.seed = int(self.meta.get("seed", 0))
        self._metas: dict = {}
        self._init_meta: dict | None = None

    # shape of the run
    def world_at(self, step: int) -> int:
        return int(segment_of(self.meta, step)["world"])

    def tensor_steps(self) -> list[int]:
        return [k for k in self.steps if self.step_meta(0, k).get("tensors", True)]

    def resumed_at(self) -> list[int]:
        """The first step of each resumed segment."""
        return [s["start"] for s in self.meta["segments"] if s.get("resumed") and s["start"] in self.steps]

    # files
    def step_meta(self, rank: int, step: int) -> dict:
        key = (rank, step)
        if key not in self._metas:
            path = step_meta_path(self.out, rank, step)
            if not path.exists():
                raise DormouseError(f"rank {rank} has no step {step} ({path}): the recording is incomplete "
                                    "(a rank crashed, or it ran another number of steps)")
            m = read_json(path, "step")
            if not isinstance(m, dict):
                raise DormouseError(f"{path} is not a step's JSON object: re-record")
            validate_step_meta(m, path)
            if m.get("run") != self.run:
                raise DormouseError(f"{path} belongs to another run than {recording_path(self.out)} "
                                    "(run ids differ): record each run into an empty directory")
            self._metas[key] = m
        return self._metas[key]

    def step_tensors(self, rank: int, step: int) -> dict[str, torch.Tensor]:
        cache = self.__dict__.setdefault("_tensors", {})
        if (rank, step) not in cache:
            if len(cache) > 16:  # a few steps' worth: the readers go step by step
                cache.clear()
            cache[(rank, step)] = read_tensors(step_tensors_path(self.out, rank, step), "step tensors")[0]
        return cache[(rank, step)]

    def validate(self) -> None:
        """Every rank of every step present, from this run (one line on the first problem)."""
        worlds = {s["world"] for s in self.meta["segments"]}
        for r in range(max(worlds)):
            if not rank_dir(self.out, r).is_dir():
                raise DormouseError(f"the recording in {self.out} has no {rank_name(r)}/ (world {max(worlds)}): "
                                    "copy every rank's directory, or re-record")
        extra = sorted(p.name for p in self.out.glob("rank*") if p.is_dir() and p.name[4:].isdigit()
                       and int(p.name[4:]) >= max(worlds))
        if extra:
            raise DormouseError(f"the recording in {self.out} holds {', '.join(extra)}/ beyond its world "
                                f"{max(worlds)}: a rank folder from another recording, or an edited world: re-record "
                                "into an empty directory")
        for k in self.steps:
            for r in range(self.world_at(k)):
                self.step_meta(r, k)
                if not step_tensors_path(self.out, r, k).exists():
                    raise DormouseError(f"rank {r} step {k} has no tensors ({step_tensors_path(self.out, r, k)}):"
                                        " the recording is incomplete")
        for r in range(self.world_at(self.steps[-1])):
            m = read_json(final_meta_path(self.out, r), "final")
            if m.get("run") != self.run:
                raise DormouseError(f"{final_meta_path(self.out, r)} belongs to another run: re-record")
        if bool(self.placements()) != self.meta.get("fsdp", False):
            raise DormouseError(f"{recording_path(self.out)}: field 'fsdp' is {self.meta.get('fsdp')} but the "
                                f"initial state holds {'sharded' if self.placements() else 'no sharded'} tensors: the "
                                "recording was edited: re-record")


    # tensors
    def placements(self) -> dict:
        if self._init_meta is None:
            _, md = read_tensors(init_path(self.out, 0), "initial state")
            self._init_meta = json.loads(md.get("placements", "{}"))
        return self._init_meta

    def _assembled(self, pieces: list[dict[str, torch.Tensor]], prefix: str) -> dict[str, torch.Tensor]:
        pl = self.placements()
        names = sorted({k[len(prefix):] for p in pieces for k in p if k.startswith(prefix)})
        out = {}
        for n in names:
            if pl.get(n):
                got = [p.get(prefix + n) for p in pieces]
                if any(g is None for g in got):  # an FSDP rank without this gradient: none at all
                    continue
                out[n] = assemble(got, pl[n])
            else:
                out[n] = pieces[0][prefix + n] if prefix + n in pieces[0] else next(
                    p[prefix + n] for p in pieces if prefix + n in p)
        return out

    def init(self) -> dict[str, torch.Tensor]:
        pieces = [read_tensors(init_path(self.out, r), "initial state")[0]
                  for r in range(self.meta["segments"][0]["world"])]
        return self._assembled([{f"x/{k}": v for k, v in p.items()} for p in pieces], "x/")

    def tensors_at(self, step: int, prefix: str) -> dict[str, torch.Tensor]:
        """Full tensors "p/" or "g/" at `step` (assembled across FSDP2 shards);
        sketches "ps/"/"gs/": rank 0's, or the sum of the ranks' partial sketches under FSDP2."""
        pieces = [self.step_tensors(r, step) for r in range(self.world_at(step))]
        return self._combine(pieces, prefix)

    def final(self, prefix: str) -> dict[str, torch.Tensor]:
        pieces = [read_tensors(final_tensors_path(self.out, r), "final tensors")[0]
                  for r in range(self.world_at(self.steps[-1]))]
        return self._combine(pieces, prefix)

    def _combine(self, pieces, prefix):
        if prefix.endswith("s/"):
            if not self.meta.get("fsdp"):
                return {k[len(prefix):]: v for k, v in pieces[0].items() if k.startswith(prefix)}
            names = sorted({k[len(prefix):] for p in pieces for k in p if k.startswith(prefix)})
            return {n: sum(p[prefix + n] for p in pieces if prefix + n in p) for n in names}
        return self._assembled(pieces, prefix)

    def micro_batches(self, step: int) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
        """(rank, m, batch) of every micro-batch every rank's model saw at `step`, in rank then micro order."""
        out = []
        for r in range(self.world_at(step)):
            t = self.step_tensors(r, step)
            n = self.step_meta(r, step).get("micro_batches", 0)
            for m in range(n):
                pre = f"in/{m}/"
                out.append((r, m, {k[len(pre):]: v for k, v in t.items() if k.startswith(pre)}))
        return out

    def autocast(self, rank: int, step: int, m: int) -> dict | None:
        """The autocast ({"device_type", "dtype"}) micro-batch m of `rank` at
        `step` ran its forward under, None when off (or not recorded)."""
        acs = self.step_meta(rank, step).get("autocast") or []
        return acs[m] if m < len(acs) else None

    def eval_modules(self, step: int, rank: int = 0, m: int = 0) -> list[str]:
        """The submodules micro-batch m of `rank` at `step` (by default rank 0's
        first, whose modes the reference sets for the step) ran in eval mode (a
        frozen BatchNorm, a dropout switched off): [] when all trained (or not recorded)."""
        evs = self.step_meta(rank, step).get("eval_modules") or []
        return list(evs[m] or []) if m < len(evs) else []

    def compute_dtype(self, rank: int, step: int, m: int) -> str | None:
        """The dtype micro-batch m's forward cast the parameters to (FSDP2's
        mixed precision), None when it ran on them as stored."""
        ds = self.step_meta(rank, step).get("compute_dtype") or []
        return ds[m] if m < len(ds) else None

    def compute_dtypes(self) -> list[str]:
        """The dtypes any recorded micro-batch's forward cast the parameters to (empty: none)."""
        return sorted({d for k in self.steps for r in range(self.world_at(k))
                       for d in (self.step_meta(r, k).get("compute_dtype") or []) if d})

    def autocast_dtypes(self) -> list[str]:
        """The autocast dtypes any recorded micro-batch ran under (empty: none)."""
        return sorted({a["dtype"] for k in self.steps for r in range(self.world_at(k))
                       for a in (self.step_meta(r, k).get("autocast") or []) if a})

    def example_ids(self, rank: int, step: int) -> torch.Tensor | None:
        t = self.step_tensors(rank, step)
        return t.get("ids")


def ranks_apart_from(rec: "RecordingSet", built: dict[str, torch.Tensor]) -> str | None:
    """Where build_model's state (`built`, full tensors) differs from the
    recorded initial one: the sentence blaming the RANKS when some rank's
    recorded initial tensors (its FSDP2 shards, each cut from the full tensor
    at its offset) equal build_model's and another's do not -- each rank built
    its own model from other parameters (FSDP2 does not broadcast) -- else None
    (no rank's equal: build_model's fault, said by the caller)."""
    world = int(rec.meta["segments"][0]["world"])
    if world < 2:
        return None
    pl = rec.placements()
    pieces = [read_tensors(init_path(rec.out, r), "initial state")[0] for r in range(world)]
    same = []
    for r, piece in enumerate(pieces):
        ok = True
        for n, t in piece.items():
            want = built.get(n)
            if want is None:
                ok = False
                break
            want = want.detach().cpu()
            if pl.get(n):
                dim = pl[n]["dim"]
                start = sum(pieces[q][n].shape[dim] for q in range(r) if n in pieces[q])
                if start + t.shape[dim] > want.shape[dim]:
                    ok = False
                    break
                want = want.narrow(dim, start, t.shape[dim])
            if want.shape != t.shape or want.dtype != t.dtype or not torch.equal(want, t):
                ok = False
                break
        same.append(ok)
    if not any(same) or all(same):
        return None
    good = [r for r, ok in enumerate(same) if ok]
    bad = [r for r, ok in enumerate(same) if not ok]
    words = lambda rs: ", ".join(map(str, rs))  # noqa: E731
    return (f"the ranks started from different parameters: rank {words(good)}'s recorded initial tensors equal "
            f"build_model's, rank {words(bad)}'s do not: each rank built its own model from other parameters (a seed "
            "that differs by rank, or none; FSDP2 does not broadcast rank 0's): seed every rank alike before "
            "build_model, or broadcast rank 0's parameters (build_model is right)")


def corpus_digest(path) -> str:
    """sha256 of a corpus file: the whole file up to 256 MiB; beyond, its size
    and its first and last MiB (a recording's corpus is checked against it)."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        if size <= 256 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()


def file_digest(paths: list[Path]) -> str:
    """sha256 over the bytes of files, in the order given (each its folder's
    and its own name, then its bytes, read in blocks)."""
    h = hashlib.sha256()
    for p in map(Path, paths):
        h.update(f"{p.parent.name}/{p.name}".encode())
        if not p.exists():
            h.update(b"-")
            continue
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
