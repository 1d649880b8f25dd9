"""What the Recorder reads beside its spec: the batch keys, the plain attribute
types, the attributes that do not change what a forward computes; the spec
against the run's layout (check_runtime) and as recording.json keeps it
(effective_spec). The options themselves, their defaults and their checks are
RecordingSpec's (dormouse.gate.artifacts.spec)."""

from __future__ import annotations

from pathlib import Path

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


def check_runtime(spec, pipeline_stage, sharding, context_parallel) -> None:
    """The spec against the run's layout (what only the Recorder knows): one line on the first that cannot be."""
    if not isinstance(spec, RecordingSpec):
        raise RecorderError(f"Recorder(out_dir, model, spec): spec is a {type(spec).__name__}, not a RecordingSpec: "
                            "pass RecordingSpec(build_model=..., build_optimizer=..., ...) "
                            "(from dormouse.gate import RecordingSpec)")
    if pipeline_stage is not None and spec.sketch:  # each stage's sketches would need summing by name
        raise RecorderError(f"sketch={spec.sketch} with pipeline_stage: a pipeline is recorded in full tensors "
                            "(sketch=0)")
    if sharding is not None and (spec.sketch or pipeline_stage is not None or spec.probe_steps):
        raise RecorderError(f"sharding with sketch={spec.sketch}, pipeline_stage or probe_steps: a declared sharding "
                            "is recorded in full tensors (sketch=0), without a pipeline, and not probed")
    if context_parallel is not None and (pipeline_stage is not None or sharding is not None):
        raise RecorderError("context_parallel with pipeline_stage or sharding: a context-parallel run is "
                            "recorded with its parameters replicated (no pipeline, no declared sharding)")


def effective_spec(spec: RecordingSpec, prior: RecordingSpec | None, segments: list[dict]) -> RecordingSpec:
    """The spec as recording.json keeps it: the numbers a framework would infer (None) at the Recorder's own
    defaults, the example-id keys among the inputs, the corpus's absolute path, the extra merged over a
    resumed recording's, the recording's own start (its first segment's)."""
    return spec.replace(
        max_grad_norm=float(spec.max_grad_norm or 0.0), dataset_len=int(spec.dataset_len or 0),
        inputs=tuple(spec.inputs) + tuple(k for k in EXAMPLE_ID_KEYS if k not in spec.inputs),
        example_corpus=str(Path(spec.example_corpus).resolve()) if spec.example_corpus else None,
        extra={**(prior.extra if prior else {}), **spec.extra},
        start=segments[0]["start"] - 1 if segments else spec.start)
