"""What the Recorder can be asked to record, checked before any model exists:
the built-in objectives, the batch keys, the objective's scopes, the wire, and
check_options (the HF and Lightning clients call it when they are built)."""

from __future__ import annotations

import json

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A

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


WIRES = A.WIRES  # how the loop's gradient reduce rounds (artifacts.WIRES)


LOSS_LABELS = A.LOSS_LABELS  # rec.labels's key (artifacts.layout)


# Plain attribute values of the model's modules the Recorder records (and the reference sets)
PLAIN = (bool, int, float, str, type(None))


# attributes that change how a forward is computed, not what: not recorded (gradient checkpointing
# needs a function the loop installed beside the flag)
NEUTRAL_ATTRS = ("training", "gradient_checkpointing")


class RecorderError(DormouseError):
    """The Recorder was asked for something it cannot record."""


def check_options(*, build_model: str, build_optimizer: str, objective: str = "causal_lm", max_grad_norm: float = 0.0,
                  dataset_len: int = 0, sketch: int = 0, every: int = 1, build_kwargs: dict | None = None,
                  buffer_update: str | None = None, objective_scope: str = "example", wire: str = "fp32",
                  extra: dict | None = None) -> None:
    """The Recorder's arguments that can be judged before any model exists
    (the HF callback checks them when it is built, before training starts)."""
    for value, what in ((build_model, "build_model"), (build_optimizer, "build_optimizer"), (objective, "objective"),
                        (buffer_update, "buffer_update")):
        if isinstance(value, str) and value.split(":")[0] == "__main__":
            raise RecorderError(f"{what} {value!r} names the script being run, which the check cannot import in "
                                "another process: name its module instead ('mytrain:fn', with its folder on "
                                "PYTHONPATH), or move the function into an importable module")
    for value, what in ((build_model, "build_model"), (build_optimizer, "build_optimizer"),
                        *(((buffer_update, "buffer_update"),) if buffer_update is not None else ())):
        if not isinstance(value, str) or value.count(":") != 1:
            raise RecorderError(f"{what} {value!r} is not an import path: write it as 'package.module:function'")
    if objective not in OBJECTIVES and (not isinstance(objective, str) or objective.count(":") != 1):
        raise RecorderError(f"objective {objective!r} is none of {', '.join(OBJECTIVES)} and not an import "
                            "path 'package.module:function' of fn(model, batch) -> (loss_sum, count)")
    if extra is not None:
        try:
            json.dumps(extra)
            assert isinstance(extra, dict)
        except (TypeError, ValueError, AssertionError):
            raise RecorderError(f"extra is a {type(extra).__name__} that is not a JSON object: pass a dict of "
                                "JSON values (strings, numbers, lists, dicts)") from None
    if objective_scope not in SCOPES:
        raise RecorderError(f"objective_scope {objective_scope!r} is none of {', '.join(SCOPES)}")
    if wire not in WIRES:
        raise RecorderError(f"wire {wire!r} is none of {', '.join(WIRES)}: 'bf16' when the gradient is all-reduced "
                            "in bfloat16 (a bf16 compress hook), else 'fp32'")
    if wire == "bf16" and int(sketch):
        raise RecorderError(f"wire='bf16' with sketch={sketch}: the bf16 wire's bound holds element by element, "
                            "which a sketch cannot show; record full tensors (sketch=0)")
    if objective_scope == "step" and objective in OBJECTIVES:
        raise RecorderError(f"objective_scope='step' needs objective='pkg.mod:fn' with fn(model, batches) -> "
                            f"(loss_sum, count) over the step's micro-batches, not the built-in {objective!r}")
    if int(sketch) < 0 or int(every) < 1:
        raise RecorderError(f"sketch={sketch}, every={every}: sketch is 0 (full tensors) or the number of "
                            "projections per tensor, every a whole number >= 1")
    if max_grad_norm < 0 or dataset_len < 0:
        raise RecorderError(f"max_grad_norm={max_grad_norm}, dataset_len={dataset_len}: both must be >= 0")
    try:
        json.dumps(build_kwargs or {})
    except TypeError as e:
        raise RecorderError(f"build_kwargs must be JSON-able ({e})") from None
