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
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.errors import DormouseError
from dormouse.train.tensors import fingerprint

SCHEMA = 2
# Provenance keys every artifact of one gate run must share.
PROVENANCE = ("dormouse", "source", "torch", "device", "threads", "cpu_capability", "corpus", "init")


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


def provenance(*, device: str, corpus: Path, init: str) -> dict:
    """What bitwise results depend on: code, torch, device, threads, the CPU's
    vector capability, the corpus and the initial parameters' fingerprint."""
    import dormouse

    dev = device if device == "cpu" else f"{device}:{torch.cuda.get_device_name()}"
    return {"dormouse": dormouse.__version__, "source": source_hash(), "torch": torch.__version__,
            "device": dev, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "corpus": file_hash(Path(corpus)),
            "init": init}


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
        n = len(prefix) + 4
        names = [p.stem for p in self.out.glob(f"{prefix}rank*.json") if p.stem[n:].isdigit()]
        return sorted(names, key=lambda x: int(x[n:]))

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
    return Path(out) / f"{name}_trace.safetensors"


def load_trace(out: Path, name: str) -> dict[str, torch.Tensor] | None:
    path = trace_path(out, name)
    return st_load(path.read_bytes()) if path.exists() else None


# --------------------------------------------------------------------------- recordings (issue 13)
# A recording of any training loop (written by record/recorder.py) and the
# one-process references made from it (record/reference.py). Layout:
#   <out>/recording.json                     the run: world, segments, import paths, objective, provenance
#   <out>/rank{r}/init.safetensors           rank r's initial state (local shards under FSDP2; placements in
#                                            the file's metadata)
#   <out>/rank{r}/step{k:06d}.safetensors    in/{m}/{key}, p/ g/ (full) or ps/ gs/ (sketched)
#   <out>/rank{r}/step{k:06d}.json           lr, loss, clip, no-grad names, param hash, ...
#   <out>/rank{r}/final.safetensors|.json    the parameters after the last step
#   <out>/reference/step{k:06d}.safetensors|.json  the references at step k
#   <out>/reference/reference.json           what the references were made from (their staleness key)

RECORDING_SCHEMA = 1


def recording_path(out: Path) -> Path:
    return Path(out) / "recording.json"


def rank_dir(out: Path, rank: int) -> Path:
    return Path(out) / f"rank{rank}"


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


def recording_verdict_path(out: Path) -> Path:
    return Path(out) / "verdict.json"


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
