"""The clipping the loop applied.

A recording of any loop (entry.judge_recording):

clip          the gradient norm and clip coefficient the loop reported against
              the norm of the nearer one-process form of the gradient (g, or
              gn: see facts/gradient.py), within the bound of torch's float32
              norm of that gradient (bounds.norm_rtol, derived from its element
              counts and magnitudes) plus the gradient's own bound of the step
              (bounds.grad_rtol). A norm off by more than FACTOR_AWAY x that is
              a local or partial norm; one off by less is another arithmetic.
              Where two ranks' gradients must agree (the synchronised
              gradients, a replicated parameter's on a TP group) and one is
              the other over the clip coefficient, the loop clipped them on
              one rank only (causes.clipped_apart): a FAIL naming the ranks.
"""

from __future__ import annotations

import math

from dormouse.clip import clip_coef
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge import causes as C
from dormouse.gate.judge.bounds import FACTOR_AWAY, FP32_UNIT_ROUNDOFF, GRAD_RTOL, NORM_LANES, grad_rtol, norm_rtol, \
    norm_rtol_of_sizes
from dormouse.gate.judge.facts.replay_causes import unclipped_step
from dormouse.gate.judge.gradtools import fleet_grad, never_reduced, rank_grad
from dormouse.gate.judge.precision import (
    arithmetic_bound,
    bound_words,
    precision_floor,
    wire_bound,
)
from dormouse.gate.judge.metrics import norm, rel
from dormouse.gate.judge.verdict import Check


def check_clip(rec: A.RecordingSet, ref: ReferenceSet) -> Check:
    mgn = float(rec.spec.max_grad_norm)
    if mgn <= 0:
        bound = [(k, c) for k in rec.steps if (c := rec.step_meta(0, k).get("clip_coef")) is not None and c < 1]
        if bound:
            return Check("clip", False, f"max_grad_norm is 0 (no clipping declared), but the loop recorded a clip "
                                        f"coefficient {bound[0][1]:.6g} at step {bound[0][0]}: the recording's "
                                        "max_grad_norm is not the one the loop clipped by (edited, or another value "
                                        "given to the Recorder)")
        return Check("clip", True, "no clipping declared (max_grad_norm=0)")
    apart = _clipped_apart(rec, ref)
    if apart:
        return Check("clip", False, apart)
    seen, worst = False, (0.0, 1.0, None)  # the largest error / bound: (error, bound, step)
    for k in rec.steps:
        info = ref.info(k)
        metas = [rec.step_meta(r, k) for r in range(rec.world_at(k))]
        norms = [m.get("grad_norm") for m in metas]
        if norms[0] is None:
            continue
        seen = True
        if ref.meta.get("mode") == "run" and k not in rec.tensor_steps():
            continue
        # the nearer of the two one-process forms (g, gn) to the loop's norm
        forms = [x for x in (info["norm"], info.get("norm_normalised")) if x is not None]
        want = min(forms, key=lambda x: abs(x - norms[0]) if norms[0] is not None and math.isfinite(norms[0]) else 0)
        gb = arithmetic_bound(rec, ref, grad_rtol(info), k)  # | |a| - |b| | <= |a - b|: the gradient's bound
        # holds for its norm (a declared bf16 wire's too); the norm's own float32 arithmetic beside it, derived
        # from the gradient's element counts and magnitudes only where the cheap part does not already hold
        cheap = max(gb + (len(forms) + NORM_LANES + 6) * FP32_UNIT_ROUNDOFF, wire_bound(rec, ref, k))
        # a step with no gradient one process's way (an optimizer step alone): only a zero norm meets it
        off = [abs(x - want) / want if x is not None and want else 0.0 if x == 0 and want == 0 else math.inf
               for x in norms]
        tol = cheap
        if not all(o <= cheap for o in off):
            tol = max(gb + _norm_bound(rec, k), wire_bound(rec, ref, k))
        own = None
        bad = [(r, x) for r, (x, o) in enumerate(zip(norms, off)) if not o <= tol]  # NaN: bad
        if not bad and max(off) / tol > worst[0] / worst[1]:
            worst = (max(off), tol, k)
        if bad:
            per = ", ".join(f"rank {r}: {x:.6g}" for r, x in enumerate(norms) if x is not None)
            differ = len({x for x in norms if x is not None}) > 1
            if not rec.sketch and rec.step_meta(0, k).get("tensors", True):
                g = fleet_grad(rec, k)
                own = norm(g, sorted(g))
            if any(x is not None and not math.isfinite(x) for x in norms) or not math.isfinite(want):
                return Check("clip", False, f"at step {k} the gradient norm is not finite (the loop's: {per}; one "
                                            f"process's: {want:.6g}): not compared (see finite)")
            coefs = f"coefficient {metas[0].get('clip_coef'):.4g}, one process {info['clip_coef']:.4g}"
            far = max(o for o in off if math.isfinite(o)) if any(math.isfinite(o) for o in off) else math.inf
            stated = f"off by {far:.2g}, bound {tol:.2g}: the norm's float32 arithmetic and the gradient's"
            if differ and never_reduced(rec, ref, arithmetic_bound(rec, ref, grad_rtol(info), k)) is not None:
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {per}, each rank "
                                            "its own gradient's: the gradients were not all-reduced over every "
                                            "micro-batch (see gradient), not a clip by a local norm")
            if differ and _own_copies(rec, k, norms, tol):
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {per}, each rank "
                                            "its own synchronised gradient's norm, and those gradients differ "
                                            "between ranks (see ranks): the ranks hold other gradients, not a "
                                            "local-norm clip")
            if differ:
                idle = all(m.get("clip_coef") == 1.0 for m in metas) and info.get("clip_coef") == 1.0
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {per}, each rank "
                                            f"its own, where the global gradient's norm is {want:.6g}: clipping by "
                                            f"a local norm ({coefs})" + (
                                                "; it clipped nothing here (every coefficient 1, one process's "
                                                "too), so the training still matches one process, but the norm "
                                                "the loop computes is each rank's own and will clip wrongly once "
                                                "it passes max_grad_norm" if idle else ""))
            if own is None:
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {norms[0]:.6g} "
                                            f"where one process's gradient has norm {want:.6g} ({stated}; {coefs}; "
                                            "see gradient)")
            if abs(norms[0] - own) <= tol * own:
                return Check("clip", False, f"at step {k} the loop clipped by its own synchronised gradient's norm "
                                            f"{norms[0]:.6g}, but one process's gradient has norm {want:.6g}: the "
                                            "gradient itself is wrong (see gradient)")
            if far <= FACTOR_AWAY * tol and not differ:
                return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {norms[0]:.6g} where "
                                            f"one process's gradient has norm {want:.6g} ({stated} bound; {coefs}): "
                                            f"within {FACTOR_AWAY:g} x the bound, nearer than a local or partial "
                                            "norm would be: a norm computed in another arithmetic (a lower "
                                            "precision, or a coarser float32 sum than torch's), or an edited "
                                            "recording")
            return Check("clip", False, f"at step {k} the loop clipped by a gradient norm of {norms[0]:.6g}, "
                                        f"neither its synchronised gradient's ({own:.6g}) nor one process's "
                                        f"({want:.6g}), {stated}: clipping by a local or partial norm ({coefs})")
        coef, want_c = metas[0].get("clip_coef"), (clip_coef(mgn, want) if info.get("clip_coef") is not None
                                                   else None)
        if coef is not None and want_c is not None and not abs(coef - want_c) <= tol * want_c:
            # the norms agree: the coefficient is max_grad_norm's at that norm, as the reference works it out
            return Check("clip", False, f"at step {k} the loop's clip coefficient {coef:.6g} is not the one "
                                        f"max_grad_norm {mgn:g} gives at the gradient's norm {want:.6g} "
                                        f"({want_c:.6g}): the recording's max_grad_norm is not the one the loop "
                                        "clipped by (edited, or another value given to the Recorder)")
    if not seen:
        unapplied = unclipped_step(rec, ref)
        if unapplied:
            return Check("clip", False, unapplied)
        return Check("clip", True, f"the loop reported no gradient norm: the replay clipped by max_grad_norm "
                                   f"{mgn:g} itself (the replay check covers it)")
    e, t, k = worst
    return Check("clip", True, f"the loop's gradient norm and clip coefficient equal the one-process gradient's at "
                               f"every step (worst {e:.2g} against its bound {t:.2g}" + (f" at step {k}" if k else "")
                               + ": the norm's float32 arithmetic and the gradient's, each step its own"
                               + (f"; {bound_words(rec, ref, t, -1.0, k)}" if precision_floor(rec, ref) is not None
                                  else "") + ")")


def _own_copies(rec: A.RecordingSet, k: int, norms: list, tol: float) -> bool:
    """Whether each rank's reported norm is the norm of its own recorded gradient (over its clip
    coefficient), full tensors only: ranks whose gradients differ, each clipping by its own copy's norm."""
    if rec.sketch or not rec.step_meta(0, k).get("tensors", True) or rec.recorded.fsdp or rec.recorded.layout:
        return False  # replicas only: a shard's norm is a local norm

    for r, x in enumerate(norms):
        if x is None:
            return False
        g = rank_grad(rec, r, k)
        own = norm(g, sorted(g))
        if not abs(own - x) <= tol * max(own, 1e-30):
            return False
    return True


def _clipped_apart(rec: A.RecordingSet, ref: ReferenceSet) -> str | None:
    """The first step where a rank's gradient of some tensors is rank 0's over the clip coefficient (or
    rank 0's is its), tensors the two ranks hold alike and must agree on, as a sentence; None otherwise."""
    if rec.sketch:
        return None
    for k in rec.tensor_steps():
        coef = rec.step_meta(0, k).get("clip_coef")
        if coef is None or not coef < 1:
            continue
        first = A.prefixed(A.GRAD, rec.step_tensors(0, k))
        for r in range(1, rec.world_at(k)):
            found = C.clipped_apart(first, A.prefixed(A.GRAD, rec.step_tensors(r, k)), coef, rel,
                                    arithmetic_bound(rec, ref, GRAD_RTOL, k))
            if found:
                names, other_unclipped = found
                clipped, not_clipped = (0, r) if other_unclipped else (r, 0)
                return (f"at step {k} rank {not_clipped}'s gradient of {len(names)} tensor(s) ("
                        f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) is rank {clipped}'s over the clip "
                        f"coefficient {coef:.4g}, where the two must agree: the loop clipped those tensors on rank "
                        f"{clipped} and not on rank {not_clipped} (a replicated parameter's gradient clipped on one TP "
                        "rank only: DeepSpeed #1801's mechanism), so the replicas step apart (see ranks); clip every "
                        "rank's copy by the same coefficient")
    return None


def _norm_bound(rec: A.RecordingSet, k: int) -> float:
    """bounds.norm_rtol of the fleet's gradient at step k (what the loop took the norm of), or from its
    element counts alone where the recording holds no full tensors there."""
    if not rec.sketch and rec.step_meta(0, k).get("tensors", True) and k in rec.tensor_steps():
        return norm_rtol(fleet_grad(rec, k))
    return norm_rtol_of_sizes([v.numel() for v in rec.init().values() if v.is_floating_point()])
