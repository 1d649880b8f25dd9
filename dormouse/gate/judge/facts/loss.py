"""The reported loss (a wrong metric is its own finding, not a wrong training).

Every recording (dormouse's own fleet's too; its eval losses are gradref's, facts/gradref.py):

loss          the loss the loop reported against the declared objective
              (LOSS_RTOL): reported apart, since a wrong metric is not a wrong
              training; the weighting it computed instead is named.
"""

from __future__ import annotations

import math

from dormouse.numerics import scalar_relative
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.bounds import (
    FLOOR_MULTIPLE,
    LOSS_RTOL,
    floor_bound,
)
from dormouse.gate.judge.gradtools import rank_mean_words
from dormouse.gate.judge.precision import precision_words
from dormouse.gate.judge.verdict import Check, TensorCheck


def mesh_sizes(rec: A.RecordingSet) -> tuple[int, int]:
    """(TP, DP): the model-parallel group size and the data-parallel replicas of a recorded DTensor layout
    or declared sharding; (1, 1) without one, or in a pipeline."""
    lay = rec.recorded.layout or {}
    groups = [] if lay.get("pipeline") else lay.get("groups", [])
    return max((len(g) for g in groups), default=1), max(len(groups), 1)


def mesh_named(pairs: list[tuple[float, float, float]], tp: int, dp: int) -> str | None:
    """The logged loss named by the mesh where it is, at every step that logged one (pairs: logged,
    objective, bound), within the loss's bound: the objective + log(TP) (a log-sum-exp summed over the TP
    group on logits each rank holds whole), or the objective times TP, 1/TP, DP or 1/DP (every size it
    equals listed: one factor cannot tell coinciding sizes apart); None otherwise."""
    if not pairs:
        return None
    if tp > 1 and all(abs((x - r) - math.log(tp)) <= t * abs(r) for x, r, t in pairs):
        return (f"the declared objective + log({tp}) = + {math.log(tp):.4f}, log of the TP size {tp}, at every step: "
                f"a log-sum-exp whose sum of exponentials was all-reduced over the TP group on logits each rank "
                "already held whole (a vocabulary-parallel cross-entropy applied to gathered logits)")
    cands = [(v, w) for size, what in ((tp, "TP"), (dp, "DP")) if size > 1
             for v, w in ((size, f"the {what} size {size}"), (1 / size, f"1 / the {what} size {size}"))]
    for v in sorted({v for v, _ in cands}):
        if all(abs(x - v * r) <= t * abs(v * r) for x, r, t in pairs):
            return (f"the declared objective times {v:.4g} = {' = '.join(w for u, w in cands if u == v)} at every "
                    "step: a loss reduced over a mesh dimension (summed where averaged, or divided once too often)")
    return None


def loss_relative(logged: float, info: dict) -> float:
    """|logged - objective| on the loss's own scale: over |objective|, or over the magnitude of its terms where
    they cancel (GRPO's advantages sum to zero over each group: a clean run logs a loss near 0, whose float32
    rounding is relative to its terms, not to itself): the reference's "loss_scale", the sum over the step's
    micro-batches of |its loss sum|, over the step's count."""
    return scalar_relative(logged, info["loss"], info.get("loss_scale") or 0.0)


def check_loss(rec: A.RecordingSet, ref: ReferenceSet, training_ok: bool) -> Check:
    worst, at, alt_hits, first = 0.0, None, None, None
    reported_any, over, floor = False, False, 0.0
    no_forward = []  # steps whose logged loss has no objective to meet: no micro-batch (an optimizer step alone)
    pairs: list[tuple[float, float, float]] = []  # (logged, objective, bound) at every step that logged one
    # reduced precision: the loss as a loop computing it in the forward's dtype gives it (measured per step)
    lowp = max((f for k in rec.steps if (f := ref.info(k).get("loss_floor")) is not None), default=None)
    for k in rec.steps:
        info, _ = ref.step(k)
        if info.get("nudged_loss") is not None:  # run mode: the one-process run's own one-ulp floor
            floor = max(floor, scalar_relative(info["nudged_loss"], info["loss"]))
        # a step in reduced precision: the largest loss floor of such steps (one scalar a step is a noisy
        # measure of a rounding); a float32 step keeps its own bound
        tol = floor_bound(max(floor, lowp if info.get("loss_floor") is not None else 0.0), LOSS_RTOL)
        losses = [rec.step_meta(r, k).get("loss") for r in range(rec.world_at(k))]
        if losses[0] is None:
            continue
        if info.get("loss") is None:
            no_forward.append(k)
            continue
        reported_any = True
        pairs.append((losses[0], info["loss"], tol))
        x = loss_relative(losses[0], info)
        x = x if math.isfinite(x) else math.inf  # a NaN logged (or a NaN reference): above every bound
        if x > worst:
            worst, at = x, k
        if x > tol:
            over, first = True, first or k
            hits = {a for a, v in (("micro_mean", info["loss_alt"]["micro_mean"]),
                                   ("rank_mean", info["loss_alt"]["rank_mean"]),
                                   ("rank_local", (info["loss_alt"]["rank_local"] or [None])[0]))
                    if v is not None and abs(losses[0] - v) <= tol * abs(v)}
            alt_hits = hits if alt_hits is None else alt_hits & hits
    apart = (f"; step(s) {', '.join(map(str, no_forward[:5]))} ran no forward (an optimizer step alone): "
             "the loss logged there is not compared") if no_forward else ""
    if not reported_any:
        return Check("loss", True, "the loop reported no loss (rec.step(loss=...)): not checked" + apart)
    if not over:
        tol = floor_bound(max(floor, lowp or 0.0), LOSS_RTOL)
        said = f"bound {tol:.2g}"
        if lowp is not None and FLOOR_MULTIPLE * lowp > max(LOSS_RTOL, FLOOR_MULTIPLE * floor):
            said += (f" = {FLOOR_MULTIPLE:g} x the {precision_words(rec, ref)} loss floor {lowp:.2g}, the loss "
                     "from logits left in the forward's dtype against it, at the largest; each step its own")
        return TensorCheck("loss", True, f"the logged loss equals the declared objective over the global batch at "
                                         f"every step (worst {worst:.2g}, {said}){apart}", worst=worst,
                           worst_step=at, bound=tol)
    desc = {"micro_mean": "the mean of per-micro-batch token means", "rank_mean": rank_mean_words(rec),
            "rank_local": "rank 0's own token mean"}
    named = next((desc[a] for a in ("rank_mean", "micro_mean", "rank_local") if alt_hits and a in alt_hits), None)
    by_mesh = None if named else mesh_named(pairs, *mesh_sizes(rec))
    reason = (f"the logged loss differs from the declared objective by {worst:.2g} at step {at}"
              + (f": it is {named}, not the global token mean" if named else f": it is {by_mesh}" if by_mesh else ""))
    if math.isinf(worst):
        logged = rec.step_meta(0, at).get("loss")
        reason = (f"the logged loss at step {at} is {logged}" if isinstance(logged, float) and not math.isfinite(logged)
                  else f"the declared objective at step {at} is not finite (the recorded parameters hold NaN or inf)"
                  ) + ": not compared (see finite)"
    reason += ("; the training itself matches one process (gradient and replay pass): the logged loss is wrong, "
               "not the training" if training_ok else "")
    return TensorCheck("loss", False, reason, worst=worst, worst_step=at, first_step=first)
