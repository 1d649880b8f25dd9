"""Whether a reference on disk was made from this recording by this code."""

from __future__ import annotations

import hashlib
import json

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A


REFERENCE_SCHEMA = 1


def staleness_key(rec: A.RecordingSet) -> str:
    """What the reference was made from: every file it reads (the recording's fields, every rank's step
    JSONs and tensors) and this code. A JSON file by its bytes; a tensor file by its name, size and
    modification time (an edit, a copy written anew, a re-recording move them; hashing the bytes was
    GBs a step at size, and the bytes of the parameters and gradients are the intact check's: every
    rank's recorded sha256 of them)."""
    from dormouse.gate.artifacts import source_hash

    files = [A.recording_path(rec.out)]
    ranks = range(max(rec.world_at(k) for k in rec.steps)) if rec.steps else range(0)
    for r in ranks:
        files += sorted(p for p in A.rank_dir(rec.out, r).iterdir() if p.is_file())
    h = hashlib.sha256(source_hash().encode())
    small = [p for p in files if p.suffix != ".safetensors"]
    h.update(A.file_digest(small).encode())
    for p in files:
        if p.suffix == ".safetensors":
            st = p.stat()
            h.update(f"{p.parent.name}/{p.name} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()


def is_current(out) -> bool:
    """The reference in `out` was made from this recording by this code."""
    path = A.reference_meta_path(out)
    if not path.exists():
        return False
    try:
        ref = json.loads(path.read_text())
        return ref.get("schema") == REFERENCE_SCHEMA and ref.get("key") == staleness_key(A.RecordingSet(out))
    except (ValueError, DormouseError):
        return False
