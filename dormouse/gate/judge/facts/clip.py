"""The clipping the loop applied.

A recording of any loop (entry.judge_recording):

clip          the gradient norm and clip coefficient the loop reported against
              the one-process gradient's norm (CLIP_RTOL).
"""

from __future__ import annotations

import math

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.bounds import CLIP_RTOL, GRAD_RTOL
from dormouse.gate.judge.facts.gradient import _never_reduced, fleet_grad
from dormouse.gate.judge.facts.precision import (
    arithmetic_bound,
    bound_words,
    precision_floor,
    wire_bound,
)
from dormouse.gate.judge.metrics import norm
from dormouse.gate.judge.verdict import Check


def check_clip(rec: A.RecordingSet, ref: ReferenceSet) -> Check:
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    if mgn <= 0:
        bound = [(k, c) for k in rec.steps if (c := rec.step_meta(0, k).get("clip_coef")) is not None and c < 1]
        if bound:
            return Check("clip", False, f"max_grad_norm is 0 (no clipping declared), but the loop recorded a clip "
                                        f"coefficient {bound[0][1]:.6g} at step {bound[0][0]}: the recording's "
                                        "max_grad_norm is not the one the loop clipped by (edited, or another value "
                                        "given to the Recorder)")
        return Check("clip", True, "no clipping declared (max_grad_norm=0)")
    seen = False
    for k in rec.steps:
        # | |a| - |b| | <= |a - b|: the gradient's bound holds for its norm (a declared bf16 wire's too)
        tol = max(arithmetic_bound(rec, ref, CLIP_RTOL, k), wire_bound(rec, ref, k))
        info = ref.info(k)
        metas = [rec.step_meta(r, k) for r in range(rec.world_at(k))]
        norms = [m.get("grad_norm") for m in metas]
        if norms[0] is None:
            continue
        seen = True
        want = info["norm"]
        if ref.meta.get("mode") == "run" and k not in rec.tensor_steps():
            continue
        bad = [(r, x) for r, x in enumerate(norms) if x is None or not abs(x - want) <= tol * want]  # NaN: bad
        if bad:
            per = ", ".join(f"rank {r}: {x:.6g}" for r, x in enumerate(norms) if x is not None)
            differ = len({x for x in norms if x is not None}) > 1
            own = None
            if not rec.sketch and rec.step_meta(0, k).get("tensors", True):
                g = fleet_grad(rec, k)
                own = norm(g, sorted(g))
            if any(x is not None and not math.isfinite(x) for x in norms) or not math.isfinite(want):
                return Check("clip", False, f"at step {k} the gradient norm is not finite (the loop's: {per}; one "
                                            f"process's: {want:.6g}): not compared (see finite)")
            coefs = f"coefficient {metas[0].get('clip_coef'):.4g}, one process {info['clip_coef']:.4g}"
            if differ and _never_reduced(rec, ref, arithmetic_bound(rec, ref, GRAD_RTOL, k)) is not None:
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {per}, each rank "
                                            "its own gradient's: the gradients were never all-reduced (see gradient),"
                                            " not a clip by a local norm")
            if differ:
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {per}, each rank "
                                            f"its own, where the global gradient's norm is {want:.6g}: clipping by "
                                            f"a local norm ({coefs})")
            if own is None:
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {norms[0]:.6g} "
                                            f"where one process's gradient has norm {want:.6g} ({coefs}; see "
                                            "gradient)")
            if abs(norms[0] - own) <= tol * own:
                return Check("clip", False, f"at step {k} the loop clipped by its own synchronised gradient's norm "
                                            f"{norms[0]:.6g}, but one process's gradient has norm {want:.6g}: the "
                                            "gradient itself is wrong (see gradient)")
            return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {norms[0]:.6g}, "
                                        f"neither its synchronised gradient's ({own:.6g}) nor one process's "
                                        f"({want:.6g}): clipping by a local or partial norm ({coefs})")
        coef, want_c = metas[0].get("clip_coef"), info.get("clip_coef")
        if coef is not None and want_c is not None and not abs(coef - want_c) <= tol * want_c:
            # the norms agree: the coefficient is max_grad_norm's at that norm, as the reference works it out
            return Check("clip", False, f"at step {k} the loop's clip coefficient {coef:.6g} is not the one "
                                        f"max_grad_norm {mgn:g} gives at the gradient's norm {want:.6g} "
                                        f"({want_c:.6g}): the recording's max_grad_norm is not the one the loop "
                                        "clipped by (edited, or another value given to the Recorder)")
    if not seen:
        return Check("clip", True, f"the loop reported no gradient norm: the replay clipped by max_grad_norm "
                                   f"{mgn:g} itself (the replay check covers it)")
    return Check("clip", True, f"the loop's gradient norm and clip coefficient equal the one-process gradient's at "
                               f"every step ({bound_words(rec, ref, arithmetic_bound(rec, ref, CLIP_RTOL), CLIP_RTOL)}"
                               + (", each step against its own" if precision_floor(rec, ref) is not None else "")
                               + ")")
