"""Whether a reference on disk was made from this recording by this code."""

from __future__ import annotations

import hashlib
import json

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A


REFERENCE_SCHEMA = 1


def staleness_key(rec: A.RecordingSet) -> str:
    from dormouse.gate.artifacts import source_hash

    # every file the reference reads: the recording's fields and every rank's step JSONs and tensors (an edited
    # input or gradient makes the reference stale, never a cached one judged against it)
    files = [A.recording_path(rec.out)]
    ranks = range(max(rec.world_at(k) for k in rec.steps)) if rec.steps else range(0)
    for r in ranks:
        files += sorted(p for p in A.rank_dir(rec.out, r).iterdir() if p.is_file())
    return hashlib.sha256((A.file_digest(files) + source_hash()).encode()).hexdigest()


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
