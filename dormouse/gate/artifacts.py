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
# Settings that say how the global batch is cut among the fleet's ranks (and
# whether the fleet stops and resumes at another world): the one-process
# references (single, exact) depend on them only through the global batch, so
# they are compared with the fleet through it (normalised to the fleet's profile).
PROFILE_FIELDS = ("world", "batch", "capacity", "profile", "resume_world")
ONE_PROCESS = ("single", "exact")  # the references that run the global batch in one process
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
