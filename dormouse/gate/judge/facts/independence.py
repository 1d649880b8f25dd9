"""Fact 1: the network is a function of each example alone.

Every recording (dormouse's own fleet's too):

independence  fact 1: at every recorded step the per-example gradients of a
              sample of micro-batches (reference.example_sample), summed
              with their weights, equal those micro-batches' gradient,
              ||ex - exb|| / ||exb|| <= INDEP_RTOL, and the gradient does not change
              with the RNG state (active dropout, per-rank RNG); BatchNorm and
              dropout modules are named. And the step's rows in one forward
              (A.GRAD_MERGED, as few merged forwards as memory allows) give the
              micro-batches' gradient within the same bound: else "the rows of
              a forward interact". Declared objective_scope "forward" states
              that distance and passes; "step" has neither check. Where the
              reference drew each micro-batch's masks again from its rank's
              recorded RNG state (judge/facts/draws.py), a gradient that changes
              with the RNG state is said not judged: a row alone draws others.
              Both comparisons compute the same gradient in another shape (a row
              alone, the rows merged), other dot products: each step is held to
              INDEP_RTOL or, where larger, FLOOR_MULTIPLE x the run's float32
              spread so far, the largest distance up to that step between the
              two one-process forms of the gradient (the loss sum differentiated
              then divided, and the loss divided before the backward: equal in
              exact arithmetic, A.GRAD and A.GRAD_NORMALISED). A rows' interaction does not
              move that spread (both forms hold it alike); at a high lr the
              rounding of a reshaped batch does (lr 1.0: spread up to 1.3e-5,
              the merged forward 1.5e-5 from the micro-batches' sum, clean).
"""

from __future__ import annotations

import math

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.bounds import FLOOR_MULTIPLE, INDEP_RTOL, floor_bound
from dormouse.gate.judge.facts import draws
from dormouse.gate.judge.precision import arithmetic_bound, bound_words
from dormouse.gate.judge.metrics import rel
from dormouse.gate.judge.verdict import TensorCheck


def _spread_bounds(rec: A.RecordingSet, ref: ReferenceSet) -> dict[int, tuple[float, float]]:
    """Per tensor step k: (the bound, the spread it was set from): FLOOR_MULTIPLE x the largest distance up to
    k between the one-process forms g and gn, where that exceeds the float32 (or reduced-precision) bound."""
    out, top = {}, 0.0
    for k in rec.tensor_steps():
        gn = ref.tensors(k, A.GRAD_NORMALISED)  # absent where the check made none (judge/forms.py)
        g = ref.tensors(k, A.GRAD) if gn else {}
        names = sorted(set(g) & set(gn))
        if names:
            top = max(top, rel(gn, g, names))
        out[k] = (max(arithmetic_bound(rec, ref, INDEP_RTOL, k), floor_bound(top, INDEP_RTOL)), top)
    return out


def _at(steps: list[int], n: int) -> str:
    """"step 1 of 3", "steps 1, 9, 17 of 40" (the first six named)."""
    named = ", ".join(str(k) for k in steps[:6]) + (", ..." if len(steps) > 6 else "")
    return f"step{'s' if len(steps) != 1 else ''} {named} of {n}"


def _words(rec, ref, bounds: dict, k) -> str:
    bound, spread = bounds.get(k, (INDEP_RTOL, 0.0))
    if k is not None and bound > arithmetic_bound(rec, ref, INDEP_RTOL, k):
        return (f"bound {bound:.2g} = {FLOOR_MULTIPLE:g} x the run's float32 spread up to step {k}, {spread:.2g}, "
                "between the two one-process forms of its gradient")
    return bound_words(rec, ref, bound, INDEP_RTOL, k)


def check_independence(rec: A.RecordingSet, ref: ReferenceSet) -> TensorCheck:
    per, worst, worst_k = [], 0.0, None
    rng, sampled, total = False, 0, 0
    over = False
    scope = rec.spec.objective_scope
    # the step's rows in as few forwards as memory allows (A.GRAD_MERGED) against the micro-batches' sum (A.GRAD)
    gm_worst, gm_k, gm_words, gm_err, gm_over = 0.0, None, None, None, False
    bounds = _spread_bounds(rec, ref)
    ex_steps, gm_steps, budget = [], [], None
    for k in rec.tensor_steps():
        info, _ = ref.step(k)
        rng = rng or bool(info.get("rng_sensitive"))
        total += sum(len(c) for c in info.get("counts", []))
        budget = info.get("extras_budget", budget)
        if budget is not None and not info.get("ex_micro") and not info.get("merged"):
            per.append(0.0)  # a step the reference's budget did not take (sample.py): nothing read
            continue
        ex_steps.extend([k] if info.get("ex_micro") else [])
        ex = ref.tensors(k, A.SAMPLED)
        g = ref.tensors(k, A.SAMPLED_GRAD) or ref.tensors(k, A.GRAD)  # the sampled micro-batches' own gradient
        x = rel(ex, g, sorted(set(g) & set(ex)))
        sampled += len(info.get("ex_micro") or [])
        per.append(x)
        over = over or x > bounds[k][0]
        merged = info.get("merged") or {}
        if merged.get("error") and gm_err is None:
            gm_err = (k, merged["error"], merged.get("words"))
        elif merged:
            gm, full = ref.tensors(k, A.GRAD_MERGED), ref.tensors(k, A.GRAD)
            y = rel(gm, full, sorted(set(gm) & set(full)))
            gm_words = merged.get("words")
            gm_steps.append(k)
            gm_over = gm_over or y > bounds[k][0]
            if y >= gm_worst:
                gm_worst, gm_k = y, k
        if x > worst:
            worst, worst_k = x, k
    bn, drop = ref.meta.get("batchnorm", []), ref.meta.get("dropout", [])
    bound = bounds.get(worst_k, (arithmetic_bound(rec, ref, INDEP_RTOL, worst_k), 0.0))[0]
    said = _words(rec, ref, bounds, worst_k)
    ok = not over and not rng and not gm_over and gm_err is None
    n_steps = len(rec.tensor_steps())
    one = (f"{gm_words} give a gradient {gm_worst:.2g} away from the micro-batches' sum (step {gm_k}"
           + (f"; merged at {_at(gm_steps, n_steps)}" if budget is not None else "") + ")"
           if gm_k is not None else None)
    if math.isinf(worst):
        ok = False
        reason = (f"not judged at step {worst_k}: the per-example or the micro-batch gradients there are not finite "
                  "(computed at recorded parameters holding NaN or inf: see finite)")
    elif scope == "step":
        ok = not rng
        reason = ("the objective is declared over the whole step (objective_scope='step'): one process "
                  "differentiates it once over every rank's micro-batches of the step, so neither the per-example "
                  "nor the per-forward check applies" + ("" if ok else "; but the gradient changes with the RNG "
                                                              "state (active dropout or other unkeyed randomness)"))
    elif scope == "forward" and not rng:
        ok = True
        reason = ("the objective is declared per forward (objective_scope='forward': each forward's own "
                  "statistics), so one process differentiates each micro-batch as the fleet split the batch, and "
                  "the split is part of the objective"
                  + (f"; {one} (what one process at the global batch would train instead)" if one else "")
                  + f"; each row alone {worst:.2g} from its micro-batch's")
    elif ok:
        taken = "" if budget is None else " taken"
        where = ("every recorded step" if budget is None else
                 f"{_at(ex_steps, n_steps)}, the steps a budget of {budget:g} x the gradient's rows took")
        reason = (f"the per-example gradients sum to their micro-batch's at {where} (worst "
                  f"{worst:.2g}, {said}; {sampled} of {total} micro-batches differentiated row by "
                  f"row: every rank's first at the first step, one at each later step{taken}, rotating) and do not "
                  "change with the RNG state" + (f"; {one}" if one else ""))
    elif bn:
        reason = (f"BatchNorm ({', '.join(bn)}) computes statistics over the batch: the per-example gradients "
                  f"differ from the batch's by {worst:.2g} (step {worst_k}; {said}), so splitting "
                  "the batch over ranks changes the mathematics (SyncBN too: use a per-example norm)")
    elif rng and draws.replayed(rec, ref):  # gradient, loss and clip judged at the ranks' own masks
        ok = True
        reason = ("not judged: the gradient changes with the RNG state (active dropout"
                  + (f" ({', '.join(drop[:3])}{', ...' if len(drop) > 3 else ''})" if drop else
                     " or other unkeyed randomness")
                  + "): one process drew each micro-batch's masks again from the RNG state its rank's forward "
                  "started from (gradient, loss and clip judge those), but a row alone or the step's rows in one "
                  f"forward draw other masks, of their own shape (per-example vs batch {worst:.2g})")
    elif rng or drop:
        reason = ("the gradient changes with the RNG state: active dropout"
                  + (f" ({', '.join(drop)})" if drop else " or other unkeyed randomness")
                  + f": its masks are random draws, which no split of the batch draws as one process does, "
                  f"whether or not the ranks share a seed (per-example vs batch {worst:.2g}); switch it off "
                  "(p = 0 or the module in eval mode) to gate the loop"
                  + ("; this recording keeps no RNG states (made before the Recorder kept them): record it again "
                     "to judge it at the masks each rank drew" if rng and draws.unrecorded(rec, ref) else ""))
    else:
        reason = (f"the network is not a function of each example alone: per-example gradients (each row alone, "
                  f"trimmed to its attention_mask) differ from the batch's by {worst:.2g} at step {worst_k} "
                  f"({said}): a forward that depends on the other rows, or on its padding (left padding with "
                  "absolute positions), computes another function at another split of the batch")
    if not ok and scope == "example" and not over and not rng and not bn and not drop:
        if gm_err is not None:
            reason = (f"the step's rows could not be computed in one forward at step {gm_err[0]} ({gm_err[2]}): "
                      f"{gm_err[1]}; declare objective_scope='forward' if each forward's own rows are the objective")
        else:
            reason = (f"the rows of a forward interact: {one} ({_words(rec, ref, bounds, gm_k)}), "
                      "though each row's gradient alone sums to its micro-batch's: the network or the objective "
                      "depends on which rows share a forward (statistics over a forward's rows: a load-balancing "
                      "term, in-batch negatives), so one process at the global batch trains another gradient than "
                      "the fleet's split; declare objective_scope='step' with fn(model, batches) if the statistics "
                      "are meant over the global batch (and the fleet computes them so), or "
                      "objective_scope='forward' if each forward's own statistics are the objective")
    elif not ok and scope == "example" and gm_over and one:
        reason += f"; {one}"
    return TensorCheck("independence", ok, reason, worst=worst, worst_step=worst_k, bound=bound, per_step=per)
