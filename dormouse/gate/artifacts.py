"""Gate artifacts: `<name>.json` (losses, fingerprint, configuration, extras)
beside `<name>.safetensors` (every parameter and persistent buffer by name).

The tensors are written first and the JSON last, each atomically, so a JSON
that exists always describes a complete set of tensors; a run killed midway
leaves either nothing or the previous artifact. The JSON records the
configuration that made it (`settings`), so a reader can tell an artifact
from another configuration apart from a missing one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.errors import DormouseError
from dormouse.train.tensors import fingerprint

SCHEMA = 1


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
