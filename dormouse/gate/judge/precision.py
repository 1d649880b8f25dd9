"""The bounds of a step computed in reduced precision (autocast, bfloat16/float16
parameters): the reference's measured floor, shared by the independence, gradient,
clip and loss facts.

Under a recorded autocast (the reference computes each micro-batch under the
same one) or with bfloat16/float16 parameters, the independence, gradient
and clip bounds of a step are FLOOR_MULTIPLE x that step's measured
"precision_floor" where that is larger (arithmetic_bound; a float32 step
keeps the float32 bounds): the backward's round-off at the loop's own loss
scale, which the reference measures but cannot reproduce. The gradient is
also held tensor by tensor to FLOOR_MULTIPLE x each tensor's own floor (a
fault in one small tensor is diluted in the global norm), the tolerance a
fitted factor is named within widens with the bound, and past PRECISION_CAP
the gradient check fails as not judged (too_loose). The logged loss of such
a step is held to FLOOR_MULTIPLE x the largest measured "loss_floor".
"""

from __future__ import annotations

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.bounds import (
    BF16_UNIT_ROUNDOFF,
    FLOOR_MULTIPLE,
    PRECISION_CAP,
    floor_bound,
)
from dormouse.gate.judge.metrics import norm


def precision_floor(rec: A.RecordingSet, ref: ReferenceSet, k: int | None = None) -> float | None:
    """Step k's measured precision floor (the reference's "precision_floor":
    under autocast, cast or bfloat16/float16 parameters), or with k None the
    largest over the recorded steps; None where the step computed in float32."""
    floors = [f for j in (rec.steps if k is None else [k]) if (f := ref.info(j).get("precision_floor")) is not None]
    return max(floors) if floors else None



def arithmetic_bound(rec: A.RecordingSet, ref: ReferenceSet, float32: float, k: int | None = None) -> float:
    """`float32`, or at a step in reduced precision FLOOR_MULTIPLE x that
    step's measured floor where that is larger (k None: the largest over the
    steps): the gradient the loop reduces carries the round-off of a
    reduced-precision backward at the loop's own loss scale. Each step has its
    own: a float32 step keeps the float32 bound."""
    floor = precision_floor(rec, ref, k)
    return float32 if floor is None else floor_bound(floor, float32)



def wire_bound(rec: A.RecordingSet, ref: ReferenceSet, k: int) -> float:
    """A declared bf16 wire's rounding at step k as one relative difference:
    W u ||sum_r |g_r| / T|| / ||g|| (the element bound W u sum_r |g_r| / T,
    A.WIRE_ABS, taken as a vector), what it lets the gradient's norm, a fitted
    factor or the clip coefficient move by; 0 without a declared bf16 wire."""
    if rec.spec.wire != "bf16":
        return 0.0
    wa, g = ref.tensors(k, A.WIRE_ABS), ref.tensors(k, A.GRAD)
    return rec.world_at(k) * BF16_UNIT_ROUNDOFF * norm(wa, sorted(wa)) / max(norm(g, sorted(g)), 1e-300)


def too_loose(rec: A.RecordingSet, ref: ReferenceSet) -> tuple[int, float] | None:
    """The first step whose precision bound FLOOR_MULTIPLE x floor exceeds
    PRECISION_CAP (a network that amplifies round-off until a fault of that
    size could not be told from it), with its floor; None if none does."""
    for k in rec.steps:
        f = precision_floor(rec, ref, k)
        if f is not None and FLOOR_MULTIPLE * f > PRECISION_CAP:
            return k, f
    return None



def precision_words(rec: A.RecordingSet, ref: ReferenceSet) -> str:
    dtypes = rec.autocast_dtypes()
    if dtypes:
        return f"{' and '.join(dtypes)} autocast"
    if rec.compute_dtypes():
        return f"{' and '.join(rec.compute_dtypes())} compute"
    lowp = ref.info(rec.steps[0]).get("low_precision_params") or []
    return f"{' and '.join(lowp)} parameters'"



def bound_words(rec: A.RecordingSet, ref: ReferenceSet, bound: float, float32: float, k: int | None = None) -> str:
    """How `bound` was set: the float32 bound, or FLOOR_MULTIPLE x the
    precision floor (of step k; k None: the largest, which `bound` then is)."""
    floor = precision_floor(rec, ref, k)
    if floor is None or bound == float32:
        return f"bound {bound:g}"
    return (f"bound {bound:.2g} = {FLOOR_MULTIPLE:g} x the {precision_words(rec, ref)} floor {floor:.2g}, the "
            "one-process gradient through a loss scaled by 1/3 against it")
