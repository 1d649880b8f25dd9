"""What a recording is asked to record, and what it recorded: the one typed
owner of a recording's options and of recording.json's schema.

    RecordingSpec   what the user asks for (the Recorder's and the framework
                    callbacks' options): every field JSON-able, checked when it
                    is made (one line naming the field and what to do)
    RecordedRun     what the Recorder writes about the run beside them (its id,
                    world, segments, steps, ...)

recording.json is `to_json(spec, run)` and is read back by `read_recording`
into the same two types only: a field's type, range and meaning are written
here once (each field's `doc`, from which docs/recording.md is generated).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dormouse.errors import DormouseError
from dormouse.gate.artifacts.layout import RECORDING_SCHEMA, WIRES

OBJECTIVES = ("causal_lm", "token_mean", "example_mean")


EXAMPLE_ID_KEYS = ("idx", "example_id")


INPUTS = ("input_ids", "attention_mask", "labels")


# What the declared objective is a function of (docs/objectives.md):
#   example  each row alone: a sum over rows (the default); the reference checks that a row's
#            gradient does not depend on the rows beside it, nor on which rows share a forward
#   forward  each forward's own statistics (a per-forward load-balancing term, what HF's MoE models
#            compute): differentiated micro-batch by micro-batch as recorded; the verdict states how far
#            the global batch in one forward is
#   step     fn(model, batches) -> (loss_sum, count) over every recorded micro-batch of every rank of
#            the step (rank then micro order), differentiated once (statistics over the global batch)
SCOPES = ("example", "forward", "step")


REDUCTIONS = ("mean", "sum")


KIND = "recording"  # recording.json's "kind"


class RecorderError(DormouseError):
    """The Recorder was asked for something it cannot record."""


# ---------------------------------------------------------------------- field types

_INT, _NUM, _STR = (int,), (int, float), (str,)


def typed(x, types: tuple, nullable: bool) -> bool:
    """Whether x is of one of `types` (None only where nullable; a bool is no int here)."""
    if x is None:
        return nullable
    if isinstance(x, bool) and bool not in types:  # True is an int to Python, not to a recording
        return False
    return isinstance(x, types)


def kind_words(types: tuple, nullable: bool) -> str:
    """The types a field may have, as a sentence says them ("an integer or null")."""
    words = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
             tuple: "a list", bool: "true or false"}
    return " or ".join([words[types[-1] if types == _NUM else types[0]]] + (["null"] if nullable else []))


def _opt(default, doc: str, types: tuple, nullable: bool = False):
    """A field with its one-line meaning and its JSON types (a dict or list default is copied per object)."""
    meta = {"doc": doc, "types": types, "nullable": nullable}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def _check_types(obj) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if not typed(v, f.metadata["types"], f.metadata["nullable"]):
            raise RecorderError(f"{f.name}={v!r} is not {kind_words(f.metadata['types'], f.metadata['nullable'])}: "
                                f"{f.metadata['doc']}")


def _import_path(value, what: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, str) and value.split(":")[0] == "__main__":
        raise RecorderError(f"{what} {value!r} names the script being run, which the check cannot import in "
                            "another process: name its module instead ('mytrain:fn', with its folder on "
                            "PYTHONPATH), or move the function into an importable module")
    if not isinstance(value, str) or value.count(":") != 1:
        raise RecorderError(f"{what} {value!r} is not an import path: write it as 'package.module:function'")


_MISSING = dataclasses.MISSING


@dataclass(frozen=True)
class RecordingSpec:
    """What a recording is asked to record: the Recorder's options (and the framework
    callbacks'), each JSON-able, checked here (one line naming the field)."""

    build_model: str = _opt(_MISSING, '"pkg.mod:fn": fn(**build_kwargs) returns the same initial model in a '
                            "fresh process", _STR)
    build_optimizer: str = _opt(_MISSING, '"pkg.mod:fn": fn(model, **build_kwargs) returns the optimizer, or '
                                "(optimizer, lr_scheduler); an optimizer is what the replay steps: step(), "
                                "zero_grad() and a param_groups list holding the lr, as torch's have", _STR)
    objective: str = _opt("causal_lm", 'causal_lm | token_mean | example_mean | "pkg.mod:fn" with fn(model, batch) '
                          "-> (loss_sum, count)", _STR)
    objective_scope: str = _opt("example", 'what the objective is a function of: "example" (each row alone), '
                                '"forward" (each forward\'s own statistics, declared), "step" (objective '
                                "fn(model, batches) over every rank's micro-batches of the step)", _STR)
    build_kwargs: dict = _opt({}, "JSON-able keyword arguments for build_model and build_optimizer (a configured "
                              "run), and for a user objective among those it names (a DPO reference's seed)",
                              (dict,))
    max_grad_norm: float | None = _opt(None, "the loop's clipping threshold (0 = no clipping); None = the "
                                       "framework callbacks read it from the framework (TrainingArguments."
                                       "max_grad_norm, gradient_clip_val), the Recorder takes 0", _NUM, True)
    dataset_len: int | None = _opt(None, "examples in the dataset (0 = unknown: the epoch check is skipped, and "
                                   "says so); None = the framework callbacks read len(train_dataset), the Recorder "
                                   "takes 0", _INT, True)
    sketch: int = _opt(0, "0 = full tensors; k > 0 = a CountSketch of k numbers per tensor", _INT)
    every: int = _opt(1, "tensors at every `every`-th step (micro-batches at every step)", _INT)
    seed: int = _opt(0, "the sketches' seed", _INT)
    inputs: tuple = _opt(INPUTS, "which forward keyword arguments are the batch (the example-id keys idx, "
                         "example_id are added)", (tuple, list))
    buffer_update: str | None = _opt(None, 'None, or "pkg.mod:fn": the rule that moves persistent buffers after '
                                     "a step, fn(model, batches, **build_kwargs) -> {name: buffer after the step}",
                                     _STR, True)
    example_corpus: str | None = _opt(None, "None, or a file of bytes whose byte offsets the loop's example ids are "
                                      "(each row its input tokens read from that offset): the data check then "
                                      "requires every recorded row to be those bytes", _STR, True)
    wire: str = _opt("fp32", 'how the gradient\'s reduce rounds: "fp32", or "bf16" when every summand is rounded '
                     "to bfloat16 on the wire (DDP's bf16_compress_hook): the gradient is then judged element by "
                     "element against that rounding's bound, and for bias", _STR)
    reduction: str = _opt("mean", '"mean" (DDP\'s and FSDP2\'s default) or "sum": how the loop reduces the '
                          "gradients", _STR)
    start: int = _opt(0, "the steps done before this recording's first step: 0 = a fresh run; K > 0 = the loop "
                      "continues from a checkpoint after step K: a new segment of the recording already in "
                      "out_dir, or (none there) a fresh recording from step K + 1, whose build_model and "
                      "build_optimizer rebuild the state after step K", _INT)
    probe_steps: tuple | None = _opt(None, "the steps whose first micro-batch is probed module by module: None = "
                                     "the first recorded step (none under pipeline_stage or sharding), () = none",
                                     (tuple, list), True)
    selfcheck: int = _opt(0, "0 = off; k > 0 = the reference-free checks inside the run, every step: each rank's "
                          "local gradient read at k elements of each tensor before the reduce against the "
                          "synchronised one, replicas' parameters equal, the logged loss against "
                          "rec.step(loss_sum=, tokens=)", _INT)
    stop_on_fail: bool = _opt(False, "raise one RecorderError on every rank at the first step the in-run checks "
                              "mark wrong (k = 64 unless selfcheck says otherwise); the recording is closed "
                              "before that step", (bool,))
    reports: bool = _opt(False, "the loop calls rec.report() after every step (the HF callback): the step's marker "
                         "for a follower (`gate check --follow`) is written after the report", (bool,))
    extra: dict = _opt({}, 'a JSON object kept in recording.json as "extra" (rec.extra, until close; a resumed '
                       "segment starts from the earlier one's): what a client keeps beside the run; no fact reads "
                       "it but a client's own", (dict,))

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen: normalised once, here)
        if self.build_kwargs is None:
            set_("build_kwargs", {})
        if self.extra is None:
            set_("extra", {})
        if isinstance(self.inputs, str):
            raise RecorderError(f"inputs={self.inputs!r} is a string: pass a tuple of keyword names, "
                                "e.g. ('input_ids', 'labels')")
        _import_path(self.build_model, "build_model")
        _import_path(self.build_optimizer, "build_optimizer")
        _import_path(self.buffer_update, "buffer_update", optional=True)
        if self.objective not in OBJECTIVES:
            if isinstance(self.objective, str) and self.objective.split(":")[0] == "__main__":
                _import_path(self.objective, "objective")
            if not isinstance(self.objective, str) or self.objective.count(":") != 1:
                raise RecorderError(f"objective {self.objective!r} is none of {', '.join(OBJECTIVES)} and not an "
                                    "import path 'package.module:function' of fn(model, batch) -> (loss_sum, count)")
        _check_types(self)
        set_("inputs", tuple(self.inputs))
        if self.probe_steps is not None:
            set_("probe_steps", tuple(self.probe_steps))
        self._check_values()

    def _check_values(self) -> None:
        """The fields' ranges and their combinations, one line on the first wrong."""
        if not all(isinstance(k, str) for k in self.inputs):
            raise RecorderError(f"inputs={self.inputs!r}: the forward's keyword names, each a string")
        if self.probe_steps is not None and not all(typed(k, _INT, False) and k >= 1 for k in self.probe_steps):
            raise RecorderError(f"probe_steps={self.probe_steps!r}: step numbers (ints >= 1), () for none")
        for what, value in (("build_kwargs", self.build_kwargs), ("extra", self.extra)):
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise RecorderError(f"{what} must be a JSON object: pass a dict of JSON values (strings, numbers, "
                                    f"lists, dicts) ({e})") from None
        if self.objective_scope not in SCOPES:
            raise RecorderError(f"objective_scope {self.objective_scope!r} is none of {', '.join(SCOPES)}")
        if self.wire not in WIRES:
            raise RecorderError(f"wire {self.wire!r} is none of {', '.join(WIRES)}: 'bf16' when the gradient is "
                                "all-reduced in bfloat16 (a bf16 compress hook), else 'fp32'")
        if self.wire == "bf16" and self.sketch:
            raise RecorderError(f"wire='bf16' with sketch={self.sketch}: the bf16 wire's bound holds element by "
                                "element, which a sketch cannot show; record full tensors (sketch=0)")
        if self.objective_scope == "step" and self.objective in OBJECTIVES:
            raise RecorderError(f"objective_scope='step' needs objective='pkg.mod:fn' with fn(model, batches) -> "
                                f"(loss_sum, count) over the step's micro-batches, not the built-in "
                                f"{self.objective!r}")
        if self.sketch < 0 or self.every < 1:
            raise RecorderError(f"sketch={self.sketch}, every={self.every}: sketch is 0 (full tensors) or the "
                                "number of projections per tensor, every a whole number >= 1")
        for what, value in (("max_grad_norm", self.max_grad_norm), ("dataset_len", self.dataset_len)):
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise RecorderError(f"{what}={value}: must be >= 0 (0: no clipping / an unknown dataset length)")
        if self.selfcheck < 0:
            raise RecorderError(f"selfcheck={self.selfcheck!r}: the sketch size of the in-run checks (an int >= 0)")
        if self.reduction not in REDUCTIONS:
            raise RecorderError(f"reduction={self.reduction!r}: 'mean' (DDP's and FSDP2's default) or 'sum'")
        if self.start < 0:
            raise RecorderError(f"start={self.start!r}: the number of steps done before this recording "
                                "(an int >= 0)")

    def replace(self, **changes) -> "RecordingSpec":
        """This spec with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    def json_fields(self) -> dict:
        """The fields as recording.json holds them."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["inputs"] = list(self.inputs)
        out["probe_steps"] = None if self.probe_steps is None else list(self.probe_steps)
        return out


@dataclass(frozen=True)
class RecordedRun:
    """What the Recorder writes into recording.json about the run beside its spec."""

    run: str = _opt(_MISSING, "the run's id (a resumed segment keeps it; every step file names it)", _STR)
    world: int = _opt(_MISSING, "the processes of the last segment", _INT)
    segments: list = _opt(_MISSING, "each segment's {start, end, world, resumed}: a resume is a new segment "
                          "(end null while it records)", (list,))
    steps: list = _opt([], "every recorded step (each segment's, a later one overriding the steps it re-ran)",
                       (list,))
    closed: bool = _opt(False, "every rank called rec.close()", (bool,))
    fsdp: bool = _opt(False, "the parameters are FSDP2 shards (placements in init.safetensors' metadata)", (bool,))
    layout: dict | None = _opt(None, "a tensor-parallel, pipeline, context-parallel or declared layout "
                               "(record/layouts.py), else null", (dict,), True)
    frozen: list = _opt([], "the parameters the loop froze (requires_grad False)", (list,))
    hf_config: dict | None = _opt(None, "a Hugging Face config's scalar fields (the reference rebuilds the same)",
                                  (dict,), True)
    attrs: dict = _opt({}, "the modules' public plain attributes at the start {module: {name: value}}", (dict,))
    provenance: dict = _opt({}, "what bitwise results depend on besides the options (versions, device, code "
                            "hashes)", (dict,))
    example_corpus_sha256: str | None = _opt(None, "the sha256 of example_corpus when there is one", _STR, True)
    stopped: dict | None = _opt(None, "stop_on_fail's stop: {step, findings}, else null", (dict,), True)

    def __post_init__(self):
        _check_types(self)
        segs = self.segments
        if not all(isinstance(sg, dict) and typed(sg.get("start"), _INT, False) and typed(sg.get("end"), _INT, True)
                   and typed(sg.get("world"), _INT, False) and sg["world"] >= 1 for sg in segs):
            raise RecorderError("segments is not a list of {start, end, world} with integer steps and a world of at "
                                "least 1")
        if self.world < 1:
            raise RecorderError(f"world={self.world}: below 1")
        if segs and self.world != segs[-1]["world"]:
            raise RecorderError(f"world is {self.world} but its last segment ran at world {segs[-1]['world']}")

    def replace(self, **changes) -> "RecordedRun":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------- recording.json

def to_json(spec: RecordingSpec, run: RecordedRun) -> dict:
    """recording.json's object: the schema, the spec's fields, the run's."""
    recorded = {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}
    return {"schema": RECORDING_SCHEMA, "kind": KIND, **spec.json_fields(), **recorded}


def _fields(cls, meta: dict, path) -> dict:
    """`cls`'s fields out of recording.json's object, each of its type (one line on the first that is not);
    a field absent takes its default, a required one absent is one line."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in meta:
            if f.default is _MISSING and f.default_factory is _MISSING:
                raise DormouseError(f"{path}: field {f.name!r} is missing: the recording was edited or is "
                                    "damaged: re-record")
            continue
        v = meta[f.name]
        if not typed(v, f.metadata["types"], f.metadata["nullable"]):
            raise DormouseError(f"{path}: field {f.name!r} is {v!r}, not "
                                f"{kind_words(f.metadata['types'], f.metadata['nullable'])}: the recording was "
                                "edited or is damaged: re-record")
        out[f.name] = v
    return out


def read_recording(meta, path) -> tuple[RecordingSpec, RecordedRun]:
    """recording.json's object (`meta`, read from `path`) as its spec and its run: one line on a file of
    another kind or schema, or on the first field of the wrong type or value."""
    path = Path(path)
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise DormouseError(f"{path} is not a recording (its kind is not {KIND!r}): point --out at the directory "
                            "a Recorder wrote")
    schema = meta.get("schema")
    if schema != RECORDING_SCHEMA:
        if typed(schema, _INT, False) and schema < RECORDING_SCHEMA:
            raise DormouseError(f"{path}: recorded by an older dormouse (schema {schema}): re-record")
        raise DormouseError(f"{path}: recorded by a newer dormouse (schema {schema!r}, this one reads "
                            f"{RECORDING_SCHEMA}): upgrade dormouse")
    try:
        spec = RecordingSpec(**_fields(RecordingSpec, meta, path))
        run = RecordedRun(**_fields(RecordedRun, meta, path))
    except RecorderError as e:
        raise DormouseError(f"{path}: {e}: the recording was edited or is damaged: re-record") from None
    if spec.max_grad_norm is None or spec.dataset_len is None:
        raise DormouseError(f"{path}: field 'max_grad_norm' or 'dataset_len' is null: the recording was edited "
                            "or is damaged: re-record")
    return spec, run


def spec_docs() -> list[tuple[str, str, str]]:
    """(field, its default as the page shows it, its meaning) of every RecordingSpec field, in order."""
    out = []
    for f in dataclasses.fields(RecordingSpec):
        default = ("required" if f.default is _MISSING and f.default_factory is _MISSING else
                   f"`{f.default_factory()!r}`" if f.default is _MISSING else f"`{f.default!r}`")
        out.append((f.name, default, f.metadata["doc"]))
    return out


def recorded_docs() -> list[tuple[str, str]]:
    """(field, its meaning) of every RecordedRun field, in order."""
    return [(f.name, f.metadata["doc"]) for f in dataclasses.fields(RecordedRun)]
