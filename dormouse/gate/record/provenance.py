"""What bitwise results depend on: the one provenance every producer writes
(the Recorder into recording.json; dormouse's own modes into their
artifacts), built here. The judge compares them; artifacts reads them."""

from __future__ import annotations

from pathlib import Path

import torch

from dormouse.gate.artifacts import file_hash, source_hash
from dormouse.train.newton_schulz import resolve_kernel


def provenance(*, device: str, **extra) -> dict:
    """The code (dormouse's version and source hash), torch, the device (a
    CUDA device by its name), the threads and the CPU's vector capability;
    then `extra`, what the producer adds (a recording: its user functions'
    code hashes)."""
    import dormouse

    dev = device if device != "cuda" else f"cuda:{torch.cuda.get_device_name()}"
    return {"dormouse": dormouse.__version__, "source": source_hash(), "torch": torch.__version__,
            "device": dev, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), **extra}


def gate_provenance(*, device: str, corpus: Path, init: str) -> dict:
    """provenance() of an artifact of dormouse's own gate: with the corpus's
    hash, the Newton-Schulz kernel ns_kernel="auto" runs here, and the initial
    parameters' fingerprint."""
    return provenance(device=device, corpus=file_hash(Path(corpus)),
                      ns_kernel=resolve_kernel("auto", torch.bfloat16, device), init=init)
