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

The package: layout.py (every name and path), applies.py (which references
a run needs), store.py (writing, hashing), run.py (the readers), spec.py (recording.json's typed
fields: RecordingSpec, RecordedRun).

The readers (run.py) import torch, and are loaded on first use of one of
their names: the names and paths alone (what a launcher needs before its
fleet starts) cost no `import torch`."""

from dormouse.gate.artifacts.applies import *  # noqa: F403
from dormouse.gate.artifacts.layout import *  # noqa: F403
from dormouse.gate.artifacts.spec import *  # noqa: F403
from dormouse.gate.artifacts.store import *  # noqa: F403


def __getattr__(name: str):
    """A reader's name (RecordingSet, read_json, ...): run.py, imported now (PEP 562)."""
    import importlib

    run = importlib.import_module("dormouse.gate.artifacts.run")
    try:
        return getattr(run, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
