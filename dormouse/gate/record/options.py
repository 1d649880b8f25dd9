"""What the Recorder's hooks read beside its spec: the batch keys, the plain
attribute types, the attributes that do not change what a forward computes.
The options themselves, their defaults and their checks are RecordingSpec's
(dormouse.gate.artifacts.spec)."""

from __future__ import annotations

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts.spec import (  # noqa: F401 (the record side's names for them)
    EXAMPLE_ID_KEYS,
    INPUTS,
    OBJECTIVES,
    SCOPES,
    RecorderError,
    RecordingSpec,
)

WIRES = A.WIRES  # how the loop's gradient reduce rounds (artifacts.WIRES)


LOSS_LABELS = A.LOSS_LABELS  # rec.labels's key (artifacts.layout)


# Plain attribute values of the model's modules the Recorder records (and the reference sets)
PLAIN = (bool, int, float, str, type(None))


# attributes that change how a forward is computed, not what: not recorded (gradient checkpointing
# needs a function the loop installed beside the flag)
NEUTRAL_ATTRS = ("training", "gradient_checkpointing")


def check_options(**options) -> RecordingSpec:
    """The spec of these options, checked before any model exists (one line on the first wrong)."""
    return RecordingSpec(**options)
