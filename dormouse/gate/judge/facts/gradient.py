"""Fact 3 for any loop: the synchronised gradient against one process's.

A recording of any loop (entry.judge_recording):

gradient      fact 3: the fleet's synchronised gradient (divided by the clip
              coefficient where the loop clipped first) against the one-process
              gradient of the DECLARED objective over every rank's micro-batches
              at the recorded parameters: ||g_fleet - g|| / ||g|| <= grad_rtol(step)
              (all tensors together), g the NEARER of the one-process forms: each
              micro-batch's loss sum differentiated, summed, / N ("g"), or each
              micro-batch's loss sum / N x W differentiated, summed, / W ("gn":
              what HF's Trainer and DDP loops backpropagate; float32 round-off
              of the backward depends on that seed, amplified at a high lr), each
              within the bound derived from its arithmetic (bounds.py); sketch / every-k recordings hold EACH
              tensor to its own bound (run_tolerance), the bound a sketch's
              detection statement is per tensor for.
              On a failure it fits g_fleet = c g and NAMES c when it is a
              constant clearly away from 1 (|c - 1| > FACTOR_AWAY x bound:
              xW, xK, 1/W, ...), or names the weighting the fleet computed
              (the mean of micro-batch means, each rank its own count).
grad_mask     the parameters with a gradient are the ones one process gives a
              gradient: a zero gradient where one process has none is a FAIL
              (weight decay and the optimizer's moments move them).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge import causes as C
from dormouse.gate.judge.bounds import (
    BF16_UNIT_ROUNDOFF,
    FACTOR_AWAY,
    FACTOR_RTOL,
    FLOOR_MULTIPLE,
    GRAD_RTOL,
    PRECISION_CAP,
    grad_rtol,
    RUN_MIN_RTOL,
    ZERO_RTOL,
    floor_bound,
    sketch_detection,
)
from dormouse.gate.judge.facts.precision import (
    arithmetic_bound,
    bound_words,
    precision_floor,
    precision_words,
    too_loose,
    wire_bound,
)
from dormouse.gate.judge.metrics import factor_name, fit, fit_c, parts, rel, rel_of
from dormouse.gate.judge.verdict import Check, TensorCheck


def step_bound(rec: A.RecordingSet, ref: ReferenceSet, k: int) -> float:
    """Step k's gradient bound: bounds.grad_rtol of the reference's figures of its arithmetic, or in reduced
    precision FLOOR_MULTIPLE x the step's precision floor where that is larger (precision.arithmetic_bound)."""
    return arithmetic_bound(rec, ref, grad_rtol(ref.info(k)), k)


def _forms_words(rows: list[dict]) -> str:
    """Which one-process form each step was nearer to, where any was the normalised one."""
    gn = [r["step"] for r in rows if r.get("form") == "gn"]
    if not gn:
        return ""
    return (f", each step's own, derived from its W x K partial gradients and its longest dot product; nearer "
            f"the form normalised before the backward (each micro-batch's loss sum / N x W, as HF's Trainer and DDP "
            f"loops backpropagate) at {len(gn)} of {len(rows)} step(s)")


def fleet_grad(rec: A.RecordingSet, k: int) -> dict[str, torch.Tensor]:
    g = rec.tensors_at(k, "gs/" if rec.sketch else "g/")
    m = rec.step_meta(0, k)
    if m.get("clipped") and m.get("clip_coef"):
        g = {n: v.double() / m["clip_coef"] for n, v in g.items()}
    return g



def run_tolerance(rec: A.RecordingSet, ref: ReferenceSet, ours: str, nudged: str) -> dict[int, dict[str, float]]:
    """Per tensor step and per tensor n (run mode): FLOOR_MULTIPLE x the
    running maximum over steps <= k of that tensor's one-ulp floor
    rel(nudged[n], ours[n]), at least RUN_MIN_RTOL. Each tensor is held to its
    own floor, so a fault confined to one small tensor is not diluted by the
    others (a sketch's detection bound is per tensor)."""
    out, top = {}, {}
    for k in rec.tensor_steps():
        a, b = ref.tensors(k, nudged), ref.tensors(k, ours)
        for n in b:
            top[n] = max(top.get(n, 0.0), rel({n: a[n]}, {n: b[n]}, [n]) if n in a else 0.0)
        out[k] = {n: floor_bound(x, RUN_MIN_RTOL) for n, x in top.items()}
    return out



def _per_tensor(a: dict, b: dict, names, tol: dict[str, float]) -> tuple[float, str | None, float, float]:
    """The tensor nearest its own bound: (its rel, its name, its bound, rel / bound)."""
    best = (0.0, None, 0.0, -1.0)
    for n in names:
        x = rel({n: a[n]}, {n: b[n]}, [n])
        t = tol.get(n, RUN_MIN_RTOL)
        if x / t > best[3]:
            best = (x, n, t, x / t)
    return best



def gradient_rows(rec: A.RecordingSet, ref: ReferenceSet) -> list[dict]:
    """Per recorded tensor step, the fleet's gradient (divided by the clip
    coefficient where the loop clipped first) against one process's gradient
    of the declared objective: "error" ||g_fleet - g|| / ||g|| over all tensors
    together, against the nearer of the two one-process forms ("form": "g" or
    "gn", module docstring); replay mode holds that to "bound" = grad_rtol of
    the step. Run mode (sketch
    or every-k) holds EACH tensor n to its own bound (run_tolerance); "tensor",
    "tensor_error", "tensor_bound" are the tensor nearest its bound (replay:
    the tensor that differs most, tensor_bound None). "scalar" the c fitting
    g_fleet = c g (a wrong count shows as a c per step). "ok" whether the step
    passes."""
    run = ref.meta.get("mode") == "run"
    wire = rec.meta.get("wire") == "bf16"
    tol = run_tolerance(rec, ref, "g/", "ng/") if run else {}
    tol = {k: {n: max(b, step_bound(rec, ref, k)) for n, b in t.items()} for k, t in tol.items()}
    rows = []
    for k in rec.tensor_steps():
        gb = step_bound(rec, ref, k)
        g_ref = ref.tensors(k, "g/")
        g = fleet_grad(rec, k)
        names = sorted(set(g) & set(g_ref))
        pt = parts(g, g_ref, names)  # one pass a form: the error, the tensor nearest, the fitted c
        x, form = rel_of(pt, names), "g"
        g_n = {} if run else ref.tensors(k, "gn/")
        if g_n and set(g_n) >= set(names):  # the normalised form, where it is the nearer
            ptn = parts(g, g_n, names)
            xn = rel_of(ptn, names)
            if xn < x:
                x, form, g_ref, pt = xn, "gn", g_n, ptn
        if run:
            tx, tn, tb, ratio = _per_tensor(g, g_ref, names, tol[k])
            ok = ratio <= 1.0
        else:
            tn = max(names, key=lambda n: rel_of(pt, [n])) if names else None
            tx = rel_of(pt, [tn]) if tn else 0.0
            tb, ok = None, x <= gb  # replay: the tensors are bounded together, not one by one
            per_t = ref.info(k).get("precision_floor_tensors")
            if per_t:  # reduced precision: each tensor also against FLOOR_MULTIPLE x its own floor
                # (a fault in one small tensor is diluted in the global norm, whose bound is a few percent)
                tol_k = {n: floor_bound(per_t.get(n, 0.0), GRAD_RTOL) for n in names}
                tx, tn, tb, ratio = _per_tensor(g, g_ref, names, tol_k)
                ok = ok and ratio <= 1.0
        c = fit_c(pt, names) if names else math.nan  # g_fleet ~ c g: the figure draws c beside the error
        row = {"step": k, "error": x, "bound": gb if not run else None, "tensor": tn, "form": form,
               "tensor_error": tx, "tensor_bound": tb, "ok": ok, "scalar": c}
        if wire:  # the declared bf16 wire: every element within its rounding bound, not the float32 one
            wa = ref.tensors(k, "wa/")
            ratio, tn = wire_ratio(g, g_ref, wa, rec.world_at(k), names)
            row.update(ok=ratio <= 1.0, wire_ratio=ratio, tensor=tn,
                       tensor_error=rel({tn: g[tn]}, {tn: g_ref[tn]}, [tn]) if tn else 0.0,
                       wire_rel=wire_bound(rec, ref, k))  # what a fitted factor is held to
        rows.append(row)
    return rows


def wire_ratio(g: dict, g_ref: dict, wa: dict, world: int, names) -> tuple[float, str | None]:
    """The largest max_e |g - g_ref| / (W u wa + GRAD_RTOL max|g_ref|) over the
    tensors (wa = sum_r |g_r| / T: every rank's contribution the bf16 wire
    rounds, each summand and partial sum within u of itself; the float32 term
    for the rest), and the tensor where it is: <= 1 passes."""
    worst, where = 0.0, None
    for n in names:
        if n not in wa:
            return math.inf, n
        d = (g[n].double() - g_ref[n].double()).abs()
        b = world * BF16_UNIT_ROUNDOFF * wa[n].double() + GRAD_RTOL * float(g_ref[n].double().abs().max())
        keep = b > 0
        x = float((d[keep] / b[keep]).max()) if keep.any() else 0.0
        x = math.inf if bool((d[~keep] > 0).any()) or not math.isfinite(x) else x
        if x > worst or where is None:
            worst, where = x, n
    return worst, where



def gradient_series(out) -> list[dict]:
    """gradient_rows of the recording in `out`, whose reference is made (what
    notebook 04 plots: the per-step gradient error against its bound)."""
    out = Path(out)
    if not A.reference_meta_path(out).exists():
        from dormouse.errors import DormouseError

        raise DormouseError(f"{out} holds no one-process reference: run `dormouse gate check --out {out}`")
    return gradient_rows(A.RecordingSet(out), ReferenceSet(out))



def _never_reduced(rec: A.RecordingSet, ref: ReferenceSet, bound: float):
    """(the first step, (ranks apart, mean against one process)) where the
    ranks' recorded gradients differ and their mean is one process's
    (causes.never_reduced): DDP's gradients never all-reduced. None under
    FSDP2 (each rank holds a shard) or sketches, or where it does not hold."""
    if rec.meta.get("fsdp") or rec.sketch:
        return None
    for k in rec.tensor_steps():
        w = rec.world_at(k)
        grads = []
        for r in range(w):
            m = rec.step_meta(r, k)
            coef = m.get("clip_coef") if m.get("clipped") and m.get("clip_coef") else 1.0
            grads.append({n[2:]: v.double() / coef for n, v in rec.step_tensors(r, k).items() if n.startswith("g/")})
        found = C.never_reduced(grads, ref.tensors(k, "g/"), rel, bound)
        if found is not None:
            return k, found
    return None



def _stale(rec: A.RecordingSet, ref: ReferenceSet, bound: float, failing: list[int]) -> tuple[int, list[str], float] | None:
    """(the first failing step, its stale tensors) when every failing step's gradient is one process's
    plus the gradient applied at the step before in the tensors that differ (causes.stale_gradient),
    each failing step right after a recorded one of the same segment; None otherwise (or sketches)."""
    steps = rec.tensor_steps()
    if rec.sketch or not failing:
        return None
    found = []
    for k in failing:
        i = steps.index(k)
        if i == 0 or steps[i - 1] != k - 1 or k in rec.resumed_at():
            return None
        off = C.stale_gradient(rec.tensors_at(k - 1, "g/"), fleet_grad(rec, k), ref.tensors(k, "g/"), rel, fit, bound)
        if off is None:
            return None
        found.append(off)
    return failing[0], found[0][0], found[0][1]


def step_counts_of(rec: A.RecordingSet, steps: list[int]) -> list[dict] | None:
    """causes.step_counts at each of `steps` (a built-in token objective only;
    causal_lm shifts by one), or None where a step's targets are not [rows, T]."""
    objective = rec.meta.get("objective")
    if objective not in ("causal_lm", "token_mean"):
        return None
    micro_max = max(rec.step_meta(0, k).get("micro_batches", 1) for k in rec.steps)
    out = []
    for k in steps:
        batches = [(r, C.targets_of(b)) for r, _, b in rec.micro_batches(k)]
        c = C.step_counts(batches, rec.world_at(k), rec.step_meta(0, k).get("micro_batches", 1), micro_max,
                          shift=1 if objective == "causal_lm" else 0)
        if c is None:
            return None
        out.append(c)
    return out



def bf16_wire(rec: A.RecordingSet) -> bool:
    """Every element of the fleet's recorded gradient a bfloat16 value at
    every tensor step the loop did not clip (clip coefficient 1 or none: a
    clip multiplies it off the bfloat16 grid); False where no step qualifies."""
    steps = [k for k in rec.tensor_steps() if rec.step_meta(0, k).get("clip_coef") in (None, 1.0)]
    return bool(steps) and all(C.bf16_representable(rec.tensors_at(k, "g/")) for k in steps)



def bf16_tensors(rec: A.RecordingSet, least: int = 16) -> list[str]:
    """The tensors whose gradient is a bfloat16 value in every element (at least `least` of them nonzero: an
    all-zero or near-empty gradient says nothing) at every tensor step the loop did not clip, where some
    other tensor's is not: a reduction run in bfloat16 for those tensors alone; [] otherwise."""
    steps = [k for k in rec.tensor_steps() if rec.step_meta(0, k).get("clip_coef") in (None, 1.0)]
    names, total = None, 0
    for k in steps:
        g = rec.tensors_at(k, "g/")
        total = len(g)
        on = {n for n, v in g.items() if int((v != 0).sum()) >= least and C.bf16_representable({n: v})}
        names = on if names is None else names & on
    return sorted(names) if names and len(names) < total else []


def _off_the_bf16_grid(rec: A.RecordingSet) -> int | None:
    """Under a declared bf16 wire: the first recorded step the loop did not
    clip whose gradient holds a value that is not a bfloat16 (what a bf16
    all-reduce cannot give), else None."""
    for k in rec.tensor_steps():
        if rec.step_meta(0, k).get("clip_coef") in (None, 1.0) and not C.bf16_representable(rec.tensors_at(k, "g/")):
            return k
    return None


def replicas(rec: A.RecordingSet) -> tuple[int, str]:
    """W, the count a data-parallel normalisation divides by, and its words: a plain data-parallel run's
    ranks; under a layout with a model-parallel dimension (TP, 2-D) or a pipeline, its data-parallel
    replicas (the layout's groups), the ranks of each named."""
    lay = rec.meta.get("layout") or {}
    if not lay.get("groups"):
        world = rec.world_at(rec.steps[0])
        return world, f"W = {world} ranks"
    n, size = len(lay["groups"]), max(len(g) for g in lay["groups"])
    each = f"{size} pipeline stages" if lay.get("pipeline") else f"{size} model-parallel ranks"
    return n, f"W = {n} data-parallel replica(s) of {each}"


def rank_mean_words(rec: A.RecordingSet) -> str:
    """The alternative weighting "each data-parallel unit normalised by its own count", in the run's terms."""
    return ("the mean of the data-parallel replicas' own token means" if replicas(rec)[0] < rec.world_at(rec.steps[0])
            else "the mean of the ranks' own token means")


def _factor_words(rec: A.RecordingSet, c: float, micro: int, rtol: float) -> str | None:
    """factor_name over W = the data-parallel replicas (replicas), then the TP size where the layout
    has a model-parallel dimension and c is it or its reciprocal."""
    lay = rec.meta.get("layout") or {}
    tp = max((len(g) for g in lay.get("groups", [])), default=1) if not lay.get("pipeline") else 1
    w = replicas(rec)[0]
    names = [n for n in (factor_name(c, w, micro, rtol) or "").split(" = ") if n and (w > 1 or "W" not in n)]
    names += [f"the TP size {tp}"] if tp > 1 and abs(c / tp - 1) <= rtol else []
    names += [f"1 / the TP size {tp}"] if tp > 1 and abs(c * tp - 1) <= rtol else []
    return " = ".join(names) or None


def check_gradient(rec: A.RecordingSet, ref: ReferenceSet) -> TensorCheck:
    run = ref.meta.get("mode") == "run"
    rows = gradient_rows(rec, ref)
    loose = too_loose(rec, ref)
    if loose is not None:
        k, f = loose
        return TensorCheck("gradient", False,
                           f"not judged in reduced precision: at step {k} the {precision_words(rec, ref)} floor is "
                           f"{f:.2g} (the gradient through the loss / 3 against it), so {FLOOR_MULTIPLE:g} x it "
                           f"exceeds {PRECISION_CAP:g} and a fault of that size would pass as round-off: the network "
                           "amplifies round-off; gate the float32 run",
                           worst=max(r["error"] for r in rows), worst_tensor=None, worst_step=k,
                           bound=FLOOR_MULTIPLE * f, per_step=[r["error"] for r in rows], first_step=k)
    gb = max((step_bound(rec, ref, r["step"]) for r in rows), default=GRAD_RTOL)  # the largest step's
    tbounds = [r["tensor_bound"] for r in rows] if run else [r["bound"] for r in rows]
    per, worst, worst_k, worst_t, over = [], 0.0, None, None, False
    fits, fitted, alts = [], [], {"micro_mean": [], "rank_mean": [], "gm": [], "fwd": []}
    alt_far = dict.fromkeys(alts, False)
    first_bad, gm_far = None, False
    for row in rows:
        k = row["step"]
        g_ref = ref.tensors(k, "g/")
        g = fleet_grad(rec, k)
        names = sorted(set(g) & set(g_ref))
        x = row["error"]
        per.append(x)
        if not row["ok"] and first_bad is None:
            first_bad = row
        over = over or not row["ok"]
        if x > worst:
            worst, worst_k, worst_t = x, k, row["tensor"]
        # a constant factor is named from steps at the same parameters (all of them when replaying)
        if run and rel(rec.tensors_at(k, "ps/" if rec.sketch else "p/"), ref.tensors(k, "rp/")) > \
                step_bound(rec, ref, k):
            continue
        fits.append(fit(g, g_ref, names))
        fitted.append(k)
        for alt in alts:
            a = ref.tensors(k, f"{alt}/")
            an = sorted(set(g) & set(a))
            alts[alt].append(fit(g, a, an) if an else (0.0, math.inf))
            # an alternative is named only where it is not the declared objective's own gradient (every
            # rank's own token mean IS the global one when the ranks hold as many tokens)
            alt_far[alt] = alt_far[alt] or bool(an) and rel(a, g_ref, an) > \
                FACTOR_AWAY * step_bound(rec, ref, k)
        gm = ref.tensors(k, "gm/")  # the global batch in one forward: named only where it is not the sum's
        gm_far = gm_far or bool(gm) and rel(gm, g_ref, sorted(set(gm) & set(g_ref))) > \
            FACTOR_AWAY * step_bound(rec, ref, k)
    ok = not over
    bound = gb
    wire = rec.meta.get("wire") == "bf16"
    if wire:  # a fitted factor, and the alternatives, are judged within the wire's rounding (an L2 analogue)
        bound = max(gb, max((r["wire_rel"] for r in rows), default=gb))
    factor_rtol = max(FACTOR_RTOL, bound)  # a fitted constant is as uncertain as the gradients it is fitted to
    micro = rec.step_meta(0, rec.steps[0]).get("micro_batches", 1)
    what = "one process's gradient of the declared objective"
    f32 = max((grad_rtol(ref.info(r["step"])) for r in rows), default=GRAD_RTOL)  # the bound in float32
    stated = (bound_words(rec, ref, max(tbounds), f32) + _forms_words(rows) if not run else
              f"each tensor against its own bound, {FLOOR_MULTIPLE:g} x the one-process run's one-ulp floor of "
              f"that tensor, {min(tbounds):.2g} to {max(tbounds):.2g}")
    if wire:
        top = max(rows, key=lambda r: r["wire_ratio"]) if rows else None
        stated = ("the declared bf16 wire's bound, element by element: W u sum_r |g_r| / T (u = 2^-8, each rank's "
                  f"contribution as one process computes it) + {GRAD_RTOL:g} max|g|"
                  + (f"; worst {top['wire_ratio']:.2g} of it, in {top['tensor']} at step {top['step']}" if top else ""))
        worst_k, worst_t = (first_bad["step"], first_bad["tensor"]) if first_bad else (worst_k, worst_t)
        off_grid = _off_the_bf16_grid(rec)
        if ok and off_grid is not None:
            ok = False
            first_bad = {"step": off_grid}
    if run and first_bad is not None:  # the per-tensor finding: which tensor, by how much, against what
        worst_k, worst_t = first_bad["step"], first_bad["tensor"]
    if wire and not ok and first_bad.get("error") is None:
        reason = (f"the recording declares a bf16 wire (Recorder(wire='bf16')), but the fleet's gradient at step "
                  f"{first_bad['step']}, unclipped, holds values that are not bfloat16 (float32 with nonzero low 16 "
                  "bits): the gradient was not all-reduced in bfloat16, so the wire's looser bound does not apply; "
                  "declare wire='fp32' (or the recording was edited: re-record)")
    elif ok:
        top = max(rows, key=lambda r: r["tensor_error"] / r["tensor_bound"]) if run else None
        reason = (f"the fleet's gradient equals {what} ({rec.meta['objective']}) at every recorded step "
                  f"(worst {worst:.2g}" + (f"; per tensor, worst {top['tensor_error']:.2g} in {top['tensor']} "
                                          f"at step {top['step']} against its {top['tensor_bound']:.2g}"
                                          if top else "") + f"; {stated})")
    else:
        cs = [c for c, _ in fits]
        constant = bool(fits) and all(r <= bound for _, r in fits) and max(cs) - min(cs) <= factor_rtol * abs(cs[0])
        near_one = constant and abs(cs[0] - 1) <= FACTOR_AWAY * bound  # no factor
        constant = constant and not near_one
        # run mode fits only the steps where the parameters still agree: a ratio of 1 there, and the
        # first failing step not among them, puts the fault in a step between
        unit = near_one and worst_k not in fitted
        named = _factor_words(rec, cs[0], micro, factor_rtol) if constant else None
        # with one micro-batch a rank, the mean of micro-batch means IS each rank's own token mean: named so
        alt_hit = next((alt for alt, fs in sorted(alts.items(), key=lambda a: micro == 1 and a[0] == "micro_mean")
                        if fs and all(r <= bound for _, r in fs)
                        and max(c for c, _ in fs) - min(c for c, _ in fs) <= factor_rtol * abs(fs[0][0])
                        and (alt != "gm" or gm_far) and alt_far[alt]), None)  # one factor at every step
        apart = None if constant or unit else _never_reduced(rec, ref, bound)
        stale = None if constant or unit or apart is not None or run else \
            _stale(rec, ref, bound, [r["step"] for r in rows if not r["ok"]])
        scalars = [(k, c, r) for k, (c, r) in zip(fitted, fits)]
        per_step = not constant and not unit and C.per_step_scalar(scalars, bound, FACTOR_AWAY * bound)
        lasts = [(k, *C.last_micro_fit(fleet_grad(rec, k), ref.tensors(k, "g/"), ref.tensors(k, "last/"),
                                       sorted(set(ref.tensors(k, "g/")) & set(fleet_grad(rec, k)))))
                 for k in fitted] if not constant and not unit and not per_step and fitted and ref.tensors(fitted[0], "last/") \
            else []
        last_apart = C.last_micro_weighted(lasts, bound, FACTOR_AWAY * bound)
        if first_bad is not None and math.isinf(first_bad["error"]):
            reason = (f"the fleet's gradient at step {first_bad['step']} is not finite, or one process's at the "
                      "recorded parameters is not: NaN or inf (see finite)")
        elif unit:
            reason = (f"the fleet's gradient equals {what} at the {len(fits)} recorded step(s) where the fleet's "
                      f"parameters equal the one-process run's, but differs by {worst:.2g} at step {worst_k} "
                      f"(tensor {worst_t}; {stated}), after the parameters parted: the fault is in a step between "
                      "(see replay)")
        elif constant and named:
            reason = (f"the fleet's gradient is {what} times {cs[0]:.4g} = {named} ({replicas(rec)[1]}, "
                      f"K = {micro} micro-batches) at every step: a normalisation applied the wrong number of times")
        elif constant:
            reason = f"the fleet's gradient is {what} times a constant {cs[0]:.4g} at every step"
        elif apart is not None:
            k0, (far, off) = apart
            reason = (f"the gradients were never all-reduced: at step {k0} the ranks' gradients differ from each other "
                      f"(by {far:.2g}), each its own micro-batches' gradient, and their mean equals {what} (within "
                      f"{off:.2g}; {stated}): no_sync on every micro-batch (or a hand-written all-reduce that never "
                      "ran), so each rank steps on its own gradient and the ranks drift apart")
        elif stale is not None:
            k0, off, c = stale
            share = "" if abs(c - 1) <= factor_rtol else f" times {c:.4g}" + (
                f" = {_factor_words(rec, c, micro, factor_rtol)}" if _factor_words(rec, c, micro, factor_rtol) else "")
            reason = (f"the gradients were not zeroed between steps: from step {k0} on, the fleet's gradient of "
                      f"{len(off)} tensor(s) ({', '.join(off[:3])}{', ...' if len(off) > 3 else ''}) is {what} plus "
                      f"the gradient the loop applied at the step before{share}, and every other tensor agrees "
                      f"({stated}): optimizer.zero_grad() is missing where those tensors live (every rank, or one "
                      "pipeline stage)")
        elif per_step and not alt_hit:
            reason = C.describe_scalars(scalars, step_counts_of(rec, fitted), factor_rtol,
                                        norms=[ref.info(k).get("norm") for k, _, _ in scalars]) + f" ({stated})"
        elif alt_hit:
            c = alts[alt_hit][0][0]
            per_unit = rank_mean_words(rec)
            desc = {"gm": "the gradient of the step's rows in one forward (one process at the global batch: "
                          "statistics over every rank's rows, as an all-reduced load-balancing term or negatives "
                          "gathered from every rank give)",
                    "micro_mean": "the mean of per-micro-batch token means (each micro-batch normalised by its "
                                  "own count, not the step's)",
                    "rank_mean": per_unit + f" (each {'replica' if 'replicas' in per_unit else 'rank'} normalised by "
                                            "its own token count)",
                    "fwd": "the causal LM loss with the model's own load-balancing term over each forward's own "
                           "routing statistics (router_aux_loss_coef x each micro-batch's aux_loss, each counted "
                           "once: what transformers' MoE models compute per forward under the Trainer)"}[alt_hit]
            declared = "the global mean the objective declares"
            if alt_hit == "rank_mean" and rec.meta.get("objective_scope") == "step":
                desc = ("the mean over the ranks of the declared objective, each rank's over its own micro-batches "
                        "alone (the step's statistics, such as a load-balancing term's routing counts, computed "
                        "over each rank's own rows and never reduced over the ranks that share them)")
                declared = "the objective declared over the whole step (objective_scope='step')"
            reason = (f"the fleet's gradient is {desc}" + (f" times {c:.4g}" if abs(c - 1) > factor_rtol else "")
                      + f", not {declared} (off by {worst:.2g} at step {worst_k})")
            if alt_hit == "fwd":
                reason = (f"the fleet's gradient is {desc}" + (f" times {c:.4g}" if abs(c - 1) > factor_rtol else "")
                          + f", not the declared objective over the whole step (off by {worst:.2g} at step "
                          f"{worst_k}): the fleet computes the statistics per micro-batch; declare objective="
                          "'causal_lm' with objective_scope='forward' if each forward's own statistics are the "
                          "objective, or compute them over the step in the loop")
            if alt_hit == "gm":
                reason = (f"the fleet's gradient is {desc}" + (f" times {c:.4g}" if abs(c - 1) > factor_rtol else "")
                          + f", not the sum of the micro-batches' own the declared objective gives (off by "
                          f"{worst:.2g} at step {worst_k}): declare objective_scope='step' with fn(model, batches) "
                          "computing the statistics over the whole step")
        elif last_apart:
            micros = [rec.step_meta(0, k).get("micro_batches", 1) for k, *_ in lasts]
            reason = (f"the fleet's gradient differs from {what} by {worst:.2g} at step {worst_k} ({stated}): "
                      + C.describe_last(lasts, micros, step_counts_of(rec, [k for k, *_ in lasts]), factor_rtol))
        elif first_bad is not None and first_bad.get("tensor_bound") is not None and \
                first_bad["tensor_error"] > first_bad["tensor_bound"]:  # run mode, or a tensor's own floor
            reason = (f"the fleet's gradient differs from {what} in tensor {first_bad['tensor']} by "
                      f"{first_bad['tensor_error']:.2g} at step {first_bad['step']}, above that tensor's bound "
                      f"{first_bad['tensor_bound']:.2g}" + ("" if run else
                                                           f" ({FLOOR_MULTIPLE:g} x that tensor's own floor)")
                      + f" (all tensors together: {worst:.2g}; {stated})"
                      + ("" if near_one else ", not by a constant factor"))
        else:
            reason = (f"the fleet's gradient differs from {what} by {worst:.2g} at step {worst_k} (tensor "
                      f"{worst_t}; {stated})" + ("" if near_one else ", not by a constant factor"))
            if not rec.sketch and not wire and bf16_wire(rec):
                reason += ("; every element of the fleet's gradient is a bfloat16 value (float32 with its low 16 bits "
                           "zero) at every step it was not clipped: the gradient was all-reduced in bfloat16 (a bf16 "
                           "compress hook, or FSDP2's reduce_dtype=torch.bfloat16), whose round-off (~4e-3 relative) "
                           "the float32 bound does not allow; "
                           "declare it, Recorder(wire='bf16'), to judge it against that rounding's bound")
            elif not rec.sketch and not wire and precision_floor(rec, ref) is None and (lowp := bf16_tensors(rec)):
                # a float32 run (no autocast, cast or low-precision parameters, whose gradients are bf16 values)
                reason += (f"; the gradients of {len(lowp)} tensor(s) ({', '.join(lowp[:3])}"
                           + (", ..." if len(lowp) > 3 else "") + ") are bfloat16 values in every element at every "
                           "step it was not clipped, the others' are not: their reduction ran in bfloat16 where the "
                           "rest ran in float32 (a reduce dtype applied on one mesh dimension only: pytorch #190626, "
                           "FSDP2's all-reduce over TP of the replicated parameters' gradients in their bfloat16)")
            info, _ = ref.step(rec.tensor_steps()[0])
            if info.get("rng_sensitive"):
                reason += "; the one-process gradient itself changes with the RNG state (see independence)"
    if rec.autocast_dtypes():
        reason += (f"; every micro-batch's forward ran under {' and '.join(rec.autocast_dtypes())} autocast, "
                   "as the recording says, in the reference too")
    if rec.compute_dtypes():
        reason += (f"; every micro-batch's forward ran on parameters cast to {' and '.join(rec.compute_dtypes())} "
                   "(mixed precision, e.g. FSDP2's MixedPrecisionPolicy), as the recording says, in the reference too")
    if rec.sketch:
        reason += "; " + sketch_detection(rec.sketch, max(tbounds))[1]
    src = ref.info(rec.steps[0]).get("labels") if rec.steps else None
    if src in ("input_ids", "arg0"):
        reason += (f"; the objective was judged against {src} as its labels (none were recorded: a loop that "
                   "gives its loss labels the model is not given records them with rec.labels(labels))")
    aux = ref.info(rec.steps[0]).get("router_aux") if rec.steps else None
    if aux is not None:  # record/routeraux.py: a transformers MoE model's own per-forward term
        k0 = rec.steps[0]
        forwards = sum(rec.step_meta(r, k0).get("micro_batches", 1) for r in range(rec.world_at(k0)))
        reason += (f"; the objective holds the model's own load-balancing term as transformers' MoE models add it to "
                   f"their loss: router_aux_loss_coef {aux:g} x each forward's aux_loss (over that forward's own "
                   f"routing statistics), each forward's term counted once ({forwards} forwards at step {k0}: the "
                   "term weighs that many times one forward's, where one process at the global batch computes it "
                   "once)")
    if rec.every > 1:
        reason += f"; tensors every {rec.every} steps: a fault confined to fewer steps can be missed"
    made_up = _made_up(rec, ref)  # exactly, beside the relative bound: gradient where there is none to reduce
    if isinstance(made_up, tuple):
        k0, n, stray = made_up
        first_bad = first_bad if first_bad is not None and first_bad["step"] < k0 else {"step": k0}
        reason = (f"the fleet's gradient is nonzero at {stray} element(s) of {n} at step {k0} where one process's "
                  f"gradient is exactly zero every way it computes it (each micro-batch, and the rows merged), beyond "
                  f"{ZERO_RTOL:.2g} of the tensor's largest element (nothing there to reduce: the fleet made gradient "
                  f"up{', within the relative bound' if ok else ''}); {reason}")
        ok = False
    elif ok and made_up:
            reason += f"; zero wherever one process's is exactly zero every way ({made_up} element-steps)"
    return TensorCheck("gradient", ok, reason, worst=worst, worst_tensor=worst_t, worst_step=worst_k,
                       bound=max(tbounds), per_step=per, first_step=first_bad["step"] if first_bad else None)


def _made_up(rec: A.RecordingSet, ref: ReferenceSet):
    """Where one process gives an element an exactly zero gradient every way
    it computes it, micro-batch by micro-batch (sum_r |g_r| = 0, the
    reference's "wa/") and the step's rows merged ("gm/"): an embedding row of
    a byte no window read, an expert no token chose, LoRA's A while B is 0;
    not a gradient that is zero in exact arithmetic only (a key bias, which
    softmax ignores: exactly 0 in one summation order, 6.5e-9 of the tensor's
    largest element in another, seen in a clean one-process loop, which
    ZERO_RTOL, float32's unit round-off, allows), the fleet's must be zero
    there too: any reduce of zeros,
    in any order, at any width, gives zero, and clipping keeps it. The relative
    bound is scaled by the tensor's largest element and lets a small made-up
    value through there, and Adam turns any nonzero into a step of ~lr (a
    review's fleet that filled zeros with 4e-6 max|g| sign(p) passed
    dormouse's own gate under mixed window lengths). In float32 arithmetic and
    full tensors only: a reduced-precision forward can round a micro-batch's
    gradient to an exact zero where the fleet's batched one does not (measured
    on a bfloat16 model). Returns (step, tensor, count) at the first stray
    value, else the number of element-steps held to zero (0: not judged)."""
    if rec.sketch or rec.autocast_dtypes() or rec.compute_dtypes() or \
            any(t.is_floating_point() and t.dtype != torch.float32 for t in rec.init().values()):
        return 0
    zeros = 0
    for k in rec.tensor_steps():
        wa, gm = ref.tensors(k, "wa/"), ref.tensors(k, "gm/")
        if not wa or not gm:
            continue
        g = fleet_grad(rec, k)
        g_ref = ref.tensors(k, "g/")
        for n in sorted(set(g) & set(wa) & set(gm) & set(g_ref)):
            mask = (wa[n] == 0) & (gm[n] == 0)
            stray = int((g[n][mask].abs() > ZERO_RTOL * float(g_ref[n].abs().max())).sum())
            if stray:
                return k, n, stray
            zeros += int(mask.sum())
    return zeros



def check_grad_mask(rec: A.RecordingSet, ref: ReferenceSet) -> Check:
    for k in rec.steps:
        info, _ = ref.step(k)
        fleet_none = set(rec.step_meta(0, k).get("no_grad", []))
        ref_none = set(info.get("no_grad", []))
        extra = sorted(ref_none - fleet_none)
        if extra:
            zero = ""
            if rec.step_meta(0, k).get("tensors", True) and not rec.sketch:
                g = rec.tensors_at(k, "g/")
                if all(n in g and not g[n].any() for n in extra):
                    zero = " (all zeros)"
            return Check("grad_mask", False,
                         f"{', '.join(extra)} had a gradient{zero} in the fleet at step {k} where one process has "
                         "none: with weight decay or momentum the optimizer moves them (set them to None)")
        missing = sorted(fleet_none - ref_none)
        if missing:
            return Check("grad_mask", False, f"{', '.join(missing)} had no gradient in the fleet at step {k} "
                                             "where one process has one")
    return Check("grad_mask", True, "the parameters with a gradient are the ones one process gives a gradient, "
                                    "at every step")


