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
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge import causes as C
from dormouse.gate.judge.bounds import (
    FACTOR_AWAY,
    FACTOR_RTOL,
    FLOOR_MULTIPLE,
    GRAD_RTOL,
    PRECISION_CAP,
    ZERO_RTOL,
    floor_bound,
    grad_rtol,
    sketch_detection,
)
from dormouse.gate.judge.gradtools import (
    masks_replayed,
    bf16_tensors,
    bf16_wire,
    factor_words,
    fleet_grad,
    made_up_gradient,
    never_reduced,
    off_the_bf16_grid,
    param_tolerance,
    params_agree,
    parts_at,
    per_tensor,
    rank_mean_words,
    replicas,
    run_tolerance,
    stale_steps,
    step_counts_of,
    wire_ratio,
)
from dormouse.gate.judge.metrics import fit, fit_c, norm, parts, rel, rel_of
from dormouse.gate.judge.precision import (
    arithmetic_bound,
    bound_words,
    precision_floor,
    precision_words,
    too_loose,
    wire_bound,
)
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


_ROWS: dict = {}  # the last recording's rows, by its files' stamp: render_recording asks again (a GB a step at size)


def _stamp(out: Path) -> tuple:
    """Every tensor and JSON file of the recording in `out` and of its reference (not the verdict, the
    figures, locks), with its size and modification time."""
    found = []
    for d in [out, *sorted(p for p in out.iterdir() if p.is_dir() and (p.name.startswith("rank")
                                                                         or p.name == "reference"))]:
        found += [(e.path, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(d) if e.is_file()
                  and e.name.endswith((".json", ".safetensors")) and e.name != "verdict.json"]
    return tuple(sorted(found))


def gradient_rows(rec: A.RecordingSet, ref: ReferenceSet) -> list[dict]:
    """_gradient_rows, remembered for the last recording while none of its files changes."""
    out = Path(rec.out).resolve()
    key = (str(out), _stamp(out))
    if _ROWS.get("key") != key:
        _ROWS.clear()
        _ROWS.update(key=key, rows=_gradient_rows(rec, ref))
    return [dict(r) for r in _ROWS["rows"]]


def _gradient_rows(rec: A.RecordingSet, ref: ReferenceSet) -> list[dict]:
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
    wire = rec.spec.wire == "bf16"
    tol = run_tolerance(rec, ref, A.GRAD, A.NUDGED_GRAD) if run else {}
    tol = {k: {n: max(b, step_bound(rec, ref, k)) for n, b in t.items()} for k, t in tol.items()}
    rows = []
    for k in rec.tensor_steps():
        gb = step_bound(rec, ref, k)
        g_ref = ref.tensors(k, A.GRAD)
        g = fleet_grad(rec, k)
        names = sorted(set(g) & set(g_ref))
        pt = parts(g, g_ref, names)  # one pass a form: the error, the tensor nearest, the fitted c
        x, form = rel_of(pt, names), "g"
        g_n = {} if run else ref.tensors(k, A.GRAD_NORMALISED)
        if g_n and set(g_n) >= set(names):  # the normalised form, where it is the nearer
            ptn = parts(g, g_n, names)
            xn = rel_of(ptn, names)
            if xn < x:
                x, form, g_ref, pt = xn, "gn", g_n, ptn
        if run:
            tx, tn, tb, ratio = per_tensor(g, g_ref, names, tol[k])
            ok = ratio <= 1.0
        else:
            tn = max(names, key=lambda n: rel_of(pt, [n])) if names else None
            tx = rel_of(pt, [tn]) if tn else 0.0
            tb, ok = None, x <= gb  # replay: the tensors are bounded together, not one by one
            per_t = ref.info(k).get("precision_floor_tensors")
            if per_t:  # reduced precision: each tensor also against FLOOR_MULTIPLE x its own floor
                # (a fault in one small tensor is diluted in the global norm, whose bound is a few percent)
                tol_k = {n: floor_bound(per_t.get(n, 0.0), GRAD_RTOL) for n in names}
                tx, tn, tb, ratio = per_tensor(g, g_ref, names, tol_k)
                ok = ok and ratio <= 1.0
        c = fit_c(pt, names) if names else math.nan  # g_fleet ~ c g: the figure draws c beside the error
        row = {"step": k, "error": x, "bound": gb if not run else None, "tensor": tn, "form": form,
               "tensor_error": tx, "tensor_bound": tb, "ok": ok, "scalar": c}
        if wire:  # the declared bf16 wire: every element within its rounding bound, not the float32 one
            wa = ref.tensors(k, A.WIRE_ABS)
            ratio, tn = wire_ratio(g, g_ref, wa, rec.world_at(k), names)
            row.update(ok=ratio <= 1.0, wire_ratio=ratio, tensor=tn,
                       tensor_error=rel({tn: g[tn]}, {tn: g_ref[tn]}, [tn]) if tn else 0.0,
                       wire_rel=wire_bound(rec, ref, k))  # what a fitted factor is held to
        rows.append(row)
    return rows


def gradient_series(out) -> list[dict]:
    """gradient_rows of the recording in `out`, whose reference is made (what
    notebook 04 plots: the per-step gradient error against its bound)."""
    out = Path(out)
    if not A.reference_meta_path(out).exists():
        from dormouse.errors import DormouseError

        raise DormouseError(f"{out} holds no one-process reference: run `dormouse gate check --out {out}`")
    return gradient_rows(A.RecordingSet(out), ReferenceSet(out))


@dataclass
class _Scan:
    """What check_gradient reads off the rows: the worst step, the first failing one, the factor g_fleet = c g
    fitted at the steps the parameters agree, the alternative weightings' fits, and the bound it all states."""

    rows: list[dict]
    run: bool
    wire: bool
    tbounds: list
    per: list = field(default_factory=list)
    worst: float = 0.0
    worst_k: int | None = None
    worst_t: str | None = None
    first_bad: dict | None = None
    ok: bool = True
    fits: list = field(default_factory=list)
    fitted: list = field(default_factory=list)
    alts: dict = field(default_factory=lambda: {"micro_mean": [], "rank_mean": [], "gm": [], "fwd": []})
    alt_far: dict = field(default_factory=dict)
    gm_far: bool = False
    bound: float = GRAD_RTOL
    factor_rtol: float = FACTOR_RTOL
    micro: int = 1
    stated: str = ""
    param_tol: dict = field(default_factory=dict)  # run mode: param_tolerance, the replay's bound per tensor
    shape: str | None = None  # the alternative weighting the failing gradient is (its key), where one is


WHAT = "one process's gradient of the declared objective"


def _not_judged(rows: list[dict], words: str, loose: tuple[int, float]) -> TensorCheck:
    """The check declined in reduced precision: the step's floor makes the bound too loose to judge by."""
    k, f = loose
    return TensorCheck("gradient", False,
                       f"not judged in reduced precision: at step {k} the {words} floor is "
                       f"{f:.2g} (the gradient through the loss / 3 against it), so {FLOOR_MULTIPLE:g} x it "
                       f"exceeds {PRECISION_CAP:g} and a fault of that size would pass as round-off: the network "
                       "amplifies round-off; gate the float32 run",
                       worst=max(r["error"] for r in rows), worst_tensor=None, worst_step=k,
                       bound=FLOOR_MULTIPLE * f, per_step=[r["error"] for r in rows], first_step=k)


def _scan_rows(rec: A.RecordingSet, ref: ReferenceSet, s: _Scan) -> None:
    """The worst step and the first failing one; at the steps where the parameters agree (every step when
    replaying), the fitted factor c and each alternative weighting's fit, and whether each alternative (and
    the rows merged, "gm") is far from the declared objective's own gradient."""
    s.alt_far = dict.fromkeys(s.alts, False)
    # the fits name a failure's shape (_fault_shape): formed only where a step fails (each reads every alternative)
    suspect = not all(row["ok"] for row in s.rows)
    s.param_tol = param_tolerance(rec, ref) if s.run and suspect else {}
    for row in s.rows:
        k = row["step"]
        x = row["error"]
        s.per.append(x)
        if not row["ok"] and s.first_bad is None:
            s.first_bad = row
        s.ok = s.ok and row["ok"]
        if x > s.worst:
            s.worst, s.worst_k, s.worst_t = x, k, row["tensor"]
        # a constant factor is named from steps at the same parameters (all of them when replaying): each
        # tensor within the replay's own bound on it (a sketched AdamW run's parameters drift past the
        # gradient's bound before any fault, and the fault's own step was taken for a step between)
        if not suspect or s.run and not params_agree(rec, ref, k, s.param_tol):
            continue
        g_ref = ref.tensors(k, A.GRAD)
        g = fleet_grad(rec, k)
        names = sorted(set(g) & set(g_ref))
        s.fits.append(fit(g, g_ref, names))
        s.fitted.append(k)
        for alt in s.alts:
            a = ref.tensors(k, A.alternative(alt))
            an = sorted(set(g) & set(a))
            if alt == "gm" and not an and ref.info(k).get("merged") is None:
                continue  # a step the reference's budget did not merge (record/reference/sample.py)
            s.alts[alt].append(fit(g, a, an) if an else (0.0, math.inf))
            # an alternative is named only where it is not the declared objective's own gradient (every
            # rank's own token mean IS the global one when the ranks hold as many tokens)
            s.alt_far[alt] = s.alt_far[alt] or bool(an) and rel(a, g_ref, an) > \
                FACTOR_AWAY * step_bound(rec, ref, k)
        gm = ref.tensors(k, A.GRAD_MERGED)  # the global batch in one forward: named only where it is not the sum's
        s.gm_far = s.gm_far or bool(gm) and rel(gm, g_ref, sorted(set(gm) & set(g_ref))) > \
            FACTOR_AWAY * step_bound(rec, ref, k)


def _state_bound(rec: A.RecordingSet, ref: ReferenceSet, s: _Scan) -> None:
    """The bound a fitted factor is held to, and the words stating the bound the steps were held to;
    under a declared bf16 wire, a gradient off the bfloat16 grid fails."""
    gb = max((step_bound(rec, ref, r["step"]) for r in s.rows), default=GRAD_RTOL)  # the largest step's
    s.bound = gb
    if s.wire:  # a fitted factor, and the alternatives, are judged within the wire's rounding (an L2 analogue)
        s.bound = max(gb, max((r["wire_rel"] for r in s.rows), default=gb))
    s.factor_rtol = max(FACTOR_RTOL, s.bound)  # a fitted constant is as uncertain as the gradients it is fitted to
    s.micro = rec.step_meta(0, rec.steps[0]).get("micro_batches", 1)
    f32 = max((grad_rtol(ref.info(r["step"])) for r in s.rows), default=GRAD_RTOL)  # the bound in float32
    s.stated = (bound_words(rec, ref, max(s.tbounds), f32) + _forms_words(s.rows) if not s.run else
                f"each tensor against its own bound, {FLOOR_MULTIPLE:g} x the one-process run's one-ulp floor of "
                f"that tensor, {min(s.tbounds):.2g} to {max(s.tbounds):.2g}")
    if s.wire:
        top = max(s.rows, key=lambda r: r["wire_ratio"]) if s.rows else None
        s.stated = ("the declared bf16 wire's bound, element by element: W u sum_r |g_r| / T (u = 2^-8, each rank's "
                    f"contribution as one process computes it) + {GRAD_RTOL:g} max|g|"
                    + (f"; worst {top['wire_ratio']:.2g} of it, in {top['tensor']} at step {top['step']}"
                       if top else ""))
        if s.first_bad:
            s.worst_k, s.worst_t = s.first_bad["step"], s.first_bad["tensor"]
        off_grid = off_the_bf16_grid(rec)
        if s.ok and off_grid is not None:
            s.ok = False
            s.first_bad = {"step": off_grid}
    if s.run and s.first_bad is not None:  # the per-tensor finding: which tensor, by how much, against what
        s.worst_k, s.worst_t = s.first_bad["step"], s.first_bad["tensor"]


def _pass_reason(rec: A.RecordingSet, s: _Scan) -> str:
    top = max(s.rows, key=lambda r: r["tensor_error"] / r["tensor_bound"]) if s.run else None
    return (f"the fleet's gradient equals {WHAT} ({rec.spec.objective}) at every recorded step "
            f"(worst {s.worst:.2g}" + (f"; per tensor, worst {top['tensor_error']:.2g} in {top['tensor']} "
                                      f"at step {top['step']} against its {top['tensor_bound']:.2g}"
                                      if top else "") + f"; {s.stated})")


def _off_grid_reason(s: _Scan) -> str:
    return (f"the recording declares a bf16 wire (RecordingSpec(wire='bf16')), but the fleet's gradient at step "
            f"{s.first_bad['step']}, unclipped, holds values that are not bfloat16 (float32 with nonzero low 16 "
            "bits): the gradient was not all-reduced in bfloat16, so the wire's looser bound does not apply; "
            "declare wire='fp32' (or the recording was edited: re-record)")


def _fault_shape(rec: A.RecordingSet, ref: ReferenceSet, s: _Scan) -> dict:
    """The failing gradient's shape, each finding tried where the ones before it did not hold: a constant
    factor (named where it is a count's), the parameters parted first (unit), an alternative weighting at
    every step, the ranks never reduced, the gradients not zeroed, a count off per step, the last
    micro-batch weighted apart."""
    bound, factor_rtol, micro = s.bound, s.factor_rtol, s.micro
    cs = [c for c, _ in s.fits]
    constant = bool(s.fits) and all(r <= bound for _, r in s.fits) and max(cs) - min(cs) <= factor_rtol * abs(cs[0])
    near_one = constant and abs(cs[0] - 1) <= FACTOR_AWAY * bound  # no factor
    constant = constant and not near_one
    # run mode fits only the steps where the parameters still agree: a ratio of 1 there, and the
    # first failing step not among them, puts the fault in a step between
    unit = near_one and s.worst_k not in s.fitted
    named = factor_words(rec, cs[0], micro, factor_rtol) if constant else None
    # a factor exact on some tensors alone: judged in float32 (a reduced-precision floor is no exactness)
    tensors = None if constant or unit or precision_floor(rec, ref) is not None else \
        C.tensor_factor([parts_at(rec, ref, k) for k in s.fitted], bound, factor_rtol)
    # with one micro-batch a rank, the mean of micro-batch means IS each rank's own token mean: named so
    alt_hit = next((alt for alt, fs in sorted(s.alts.items(), key=lambda a: micro == 1 and a[0] == "micro_mean")
                    if fs and all(r <= bound for _, r in fs)
                    and max(c for c, _ in fs) - min(c for c, _ in fs) <= factor_rtol * abs(fs[0][0])
                    and (alt != "gm" or s.gm_far) and s.alt_far[alt]), None)  # one factor at every step
    apart = None if constant or unit or tensors else never_reduced(rec, ref, bound)
    stale = None if constant or unit or apart is not None or s.run else \
        stale_steps(rec, ref, bound, [r["step"] for r in s.rows if not r["ok"]])
    scalars = [(k, c, r) for k, (c, r) in zip(s.fitted, s.fits)]
    per_step = not constant and not unit and C.per_step_scalar(scalars, bound, FACTOR_AWAY * bound)
    lasts = [(k, *C.last_micro_fit(fleet_grad(rec, k), ref.tensors(k, A.GRAD), ref.tensors(k, A.LAST_MICRO),
                                   sorted(set(ref.tensors(k, A.GRAD)) & set(fleet_grad(rec, k)))))
             for k in s.fitted] if not constant and not unit and not per_step and s.fitted and \
        ref.tensors(s.fitted[0], A.LAST_MICRO) else []
    return dict(cs=cs, constant=constant, near_one=near_one, unit=unit, named=named, tensors=tensors,
                alt_hit=alt_hit, apart=apart,
                stale=stale, scalars=scalars, per_step=per_step, lasts=lasts,
                last_apart=C.last_micro_weighted(lasts, bound, FACTOR_AWAY * bound))


def _tensors_reason(rec: A.RecordingSet, s: _Scan, c: float, names: list[str]) -> str:
    """Some tensors' gradient alone times one constant (causes.tensor_factor), named with the constant."""
    named = factor_words(rec, c, s.micro, s.factor_rtol)
    which = f"tensor {names[0]}" if len(names) == 1 else \
        f"tensors {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"the fleet's gradient is {WHAT} times {c:.4g}" + (f" = {named}" if named else "") + f" in {which} "
            f"alone, at every step, and every other tensor agrees ({s.stated}): a scale or a reduction applied to "
            f"{'that tensor' if len(names) == 1 else 'those tensors'} apart from the rest (a tied weight's copies or a "
            "router's gradient summed or averaged once more, or once less, than the other parameters' gradients)")


# the gradient line's words where the fleet's gradient is one forward over the whole step (shape ONE_FORWARD_SHAPE)
ONE_FORWARD_SHAPE = "gm"
ONE_FORWARD = "the fleet's gradient is the gradient of the step's rows in one forward"


def _alt_reason(rec: A.RecordingSet, s: _Scan, alt_hit: str) -> str:
    """The fleet's gradient is an alternative weighting of the objective (at every step, one factor)."""
    c = s.alts[alt_hit][0][0]
    times = f" times {c:.4g}" if abs(c - 1) > s.factor_rtol else ""
    off = f"off by {s.worst:.2g} at step {s.worst_k}"
    if alt_hit == "fwd":
        return ("the fleet's gradient is the causal LM loss with the model's own load-balancing term over each "
                "forward's own routing statistics (router_aux_loss_coef x each micro-batch's aux_loss, each counted "
                "once: what transformers' MoE models compute per forward under the Trainer)" + times
                + f", not the declared objective over the whole step ({off}): the fleet computes the statistics per "
                "micro-batch; declare objective='causal_lm' with objective_scope='forward' if each forward's own "
                "statistics are the objective, or compute them over the step in the loop")
    if alt_hit == ONE_FORWARD_SHAPE:
        return (ONE_FORWARD + " (one process at the global "
                "batch: statistics over every rank's rows, as an all-reduced load-balancing term or negatives "
                "gathered from every rank give)" + times + ", not the sum of the micro-batches' own the declared "
                f"objective gives ({off}): declare objective_scope='step' with fn(model, batches) computing the "
                "statistics over the whole step")
    per_unit = rank_mean_words(rec)
    desc = {"micro_mean": "the mean of per-micro-batch token means (each micro-batch normalised by its own count, "
                          "not the step's)",
            "rank_mean": per_unit + f" (each {'replica' if 'replicas' in per_unit else 'rank'} normalised by its "
                                    "own token count)"}[alt_hit]
    declared = "the global mean the objective declares"
    if alt_hit == "rank_mean" and rec.spec.objective_scope == "step":
        desc = ("the mean over the ranks of the declared objective, each rank's over its own micro-batches alone "
                "(the step's statistics, such as a load-balancing term's routing counts, computed over each rank's "
                "own rows and never reduced over the ranks that share them)")
        declared = "the objective declared over the whole step (objective_scope='step')"
    return f"the fleet's gradient is {desc}" + times + f", not {declared} ({off})"


def _residual_reason(rec: A.RecordingSet, ref: ReferenceSet, s: _Scan, near_one: bool) -> str:
    """No shape named: how far, where, and what the recording says of a bfloat16 reduction or the RNG."""
    first_bad, run = s.first_bad, s.run
    factor = "" if near_one else ", not by a constant factor"
    if first_bad is not None and first_bad.get("tensor_bound") is not None and \
            first_bad["tensor_error"] > first_bad["tensor_bound"]:  # run mode, or a tensor's own floor
        return (f"the fleet's gradient differs from {WHAT} in tensor {first_bad['tensor']} by "
                f"{first_bad['tensor_error']:.2g} at step {first_bad['step']}, above that tensor's bound "
                f"{first_bad['tensor_bound']:.2g}" + ("" if run else f" ({FLOOR_MULTIPLE:g} x that tensor's own floor)")
                + f" (all tensors together: {s.worst:.2g}; {s.stated})" + factor)
    reason = (f"the fleet's gradient differs from {WHAT} by {s.worst:.2g} at step {s.worst_k} (tensor "
              f"{s.worst_t}; {s.stated})" + factor)
    if not rec.sketch and not s.wire and bf16_wire(rec):
        reason += ("; every element of the fleet's gradient is a bfloat16 value (float32 with its low 16 bits "
                   "zero) at every step it was not clipped: the gradient was all-reduced in bfloat16 (a bf16 "
                   "compress hook, or FSDP2's reduce_dtype=torch.bfloat16), whose round-off (~4e-3 relative) "
                   "the float32 bound does not allow; "
                   "declare it, RecordingSpec(wire='bf16'), to judge it against that rounding's bound")
    elif not rec.sketch and not s.wire and precision_floor(rec, ref) is None and (lowp := bf16_tensors(rec)):
        # a float32 run (no autocast, cast or low-precision parameters, whose gradients are bf16 values)
        reason += (f"; the gradients of {len(lowp)} tensor(s) ({', '.join(lowp[:3])}"
                   + (", ..." if len(lowp) > 3 else "") + ") are bfloat16 values in every element at every "
                   "step it was not clipped, the others' are not: their reduction ran in bfloat16 where the "
                   "rest ran in float32 (a reduce dtype applied on one mesh dimension only: pytorch #190626, "
                   "FSDP2's all-reduce over TP of the replicated parameters' gradients in their bfloat16)")
    info, _ = ref.step(rec.tensor_steps()[0])
    if info.get("rng_sensitive") and masks_replayed(rec, ref):
        reason += ("; one process drew each micro-batch's masks again from the RNG state its rank recorded (the "
                   "difference is not the draws, unless the model draws from a generator of its own, which the "
                   "reference cannot replay)")
    elif info.get("rng_sensitive"):
        reason += "; the one-process gradient itself changes with the RNG state (see independence)"
    return reason


def _rescaled_words(rec: A.RecordingSet) -> str | None:
    """A pipeline step whose schedule divided the stage's accumulated gradients more than once (each
    schedule.step() with scale_grads on: torchtitan #1733), as the failing gradient's cause; None where
    no step did."""
    if not (rec.recorded.layout or {}).get("pipeline"):
        return None
    for k in rec.tensor_steps():
        each = {r: rec.step_meta(r, k).get("grad_scalings") or [] for r in range(rec.world_at(k))}
        ranks = [r for r, got in each.items() if len(got) > 1]
        if ranks:
            got = each[ranks[0]]
            who = f"rank {ranks[0]}'s" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}' stages'"
            return (f"at step {k} the pipeline schedule divided {who} accumulated gradients {len(got)} times (by "
                    f"{', '.join(f'{x:g}' for x in got)}: PipelineStage.scale_grads, once per schedule.step() call, "
                    "the schedule's scale_grads=True, torch's default): each call divides the gradients the calls "
                    "before it accumulated again, so the first call's micro-batches weigh less than the last's "
                    "(torchtitan #1733); build the schedule with scale_grads=False and divide each loss by the "
                    "micro-batches times the calls a step")
    return None


def _fail_reason(rec: A.RecordingSet, ref: ReferenceSet, s: _Scan) -> str:
    """The failing gradient's words: the first of its shapes (_fault_shape) that holds, named."""
    if (rescaled := _rescaled_words(rec)) is not None:
        return f"the fleet's gradient differs from {WHAT} by {s.worst:.2g} at step {s.worst_k} ({s.stated}): " \
            + rescaled
    f = _fault_shape(rec, ref, s)
    worst, worst_k, stated, first_bad = s.worst, s.worst_k, s.stated, s.first_bad
    if first_bad is not None and math.isinf(first_bad["error"]):
        return (f"the fleet's gradient at step {first_bad['step']} is not finite, or one process's at the "
                "recorded parameters is not: NaN or inf (see finite)")
    if f["unit"]:
        return (f"the fleet's gradient equals {WHAT} at the {len(s.fits)} recorded step(s) where the fleet's "
                f"parameters equal the one-process run's, but differs by {worst:.2g} at step {worst_k} "
                f"(tensor {s.worst_t}; {stated}), after the parameters parted: the fault is in a step between "
                "(see replay)")
    if f["constant"] and f["named"] and f["named"].startswith("a clip at"):  # no size: the threshold alone
        return (f"the fleet's gradient is {WHAT} times {f['cs'][0]:.4g} at every step = {f['named']}: the loop "
                "clipped by another threshold than the declared one (clip by the declared max_grad_norm, or "
                "declare the one the loop clips by)")
    if f["constant"] and f["named"]:
        return (f"the fleet's gradient is {WHAT} times {f['cs'][0]:.4g} = {f['named']} ({replicas(rec)[1]}, "
                f"K = {s.micro} micro-batches) at every step: a normalisation applied the wrong number of times"
                + (" (or, every step clipped, a clip by another threshold than the declared one)"
                   if "a clip at" in f["named"] else ""))
    if f["constant"]:
        return f"the fleet's gradient is {WHAT} times a constant {f['cs'][0]:.4g} at every step"
    if f["tensors"] is not None:
        return _tensors_reason(rec, s, *f["tensors"])
    if f["apart"] is not None:
        k0, (far, off) = f["apart"]
        return (f"the gradients were not all-reduced over every micro-batch: at step {k0} the ranks' gradients "
                f"differ from each other (by {far:.2g}) and their mean equals {WHAT} (within {off:.2g}; {stated}): "
                "no_sync on every micro-batch, or on the last one (DDP reduces in the backward run outside no_sync, "
                "which must be the step's last), or a hand-written all-reduce that never ran; each rank steps on "
                "its own gradient and the ranks drift apart")
    if f["stale"] is not None:
        k0, off, c = f["stale"]
        named = factor_words(rec, c, s.micro, s.factor_rtol)
        share = "" if abs(c - 1) <= s.factor_rtol else f" times {c:.4g}" + (f" = {named}" if named else "")
        fail = [r["step"] for r in s.rows if not r["ok"]]  # "from step k0 on" only when every later step fails
        when = (f"from step {k0} on" if fail == [k for k in rec.tensor_steps() if k >= k0] else
                f"at step{'s' if len(fail) > 1 else ''} {', '.join(map(str, fail))}")
        return (f"the gradients were not zeroed between steps: {when}, the fleet's gradient of "
                f"{len(off)} tensor(s) ({', '.join(off[:3])}{', ...' if len(off) > 3 else ''}) is {WHAT} plus "
                f"the gradient the loop applied at the step before{share}, and every other tensor agrees "
                f"({stated}): optimizer.zero_grad() is missing where those tensors live, or the optimizer whose "
                "zero_grad() the loop calls does not hold them (see replay) ("
                + (f"one rank of {W}: its stale gradient enters the ranks' mean once, times 1/{W})"
                   if (W := rec.world_at(k0)) > 1 and abs(c * W - 1) <= s.factor_rtol * W else
                   "every rank, or one pipeline stage)"))
    if f["per_step"] and not f["alt_hit"]:
        told = any(rec.step_meta(0, k).get("grad_norm") is not None for k, _, _ in f["scalars"])
        return C.describe_scalars(f["scalars"], step_counts_of(rec, s.fitted), s.factor_rtol,
                                  norms=[ref.info(k).get("norm") for k, _, _ in f["scalars"]],
                                  declared=float(rec.spec.max_grad_norm) if told else None) + f" ({stated})"
    if f["alt_hit"]:
        s.shape = f["alt_hit"]
        return _alt_reason(rec, s, f["alt_hit"])
    if f["last_apart"]:
        lasts = f["lasts"]
        micros = [rec.step_meta(0, k).get("micro_batches", 1) for k, *_ in lasts]
        return (f"the fleet's gradient differs from {WHAT} by {worst:.2g} at step {worst_k} ({stated}): "
                + C.describe_last(lasts, micros, step_counts_of(rec, [k for k, *_ in lasts]), s.factor_rtol))
    return _residual_reason(rec, ref, s, f["near_one"])


def _recording_notes(rec: A.RecordingSet, ref: ReferenceSet, s: _Scan) -> str:
    """What the recording says the reference followed: autocast, a cast, a sketch's detection, the labels
    the objective was judged against, a MoE model's own load-balancing term, tensors every k steps."""
    notes = ""
    if rec.autocast_dtypes():
        notes += (f"; every micro-batch's forward ran under {' and '.join(rec.autocast_dtypes())} autocast, "
                  "as the recording says, in the reference too")
    if rec.compute_dtypes():
        notes += (f"; every micro-batch's forward ran on parameters cast to {' and '.join(rec.compute_dtypes())} "
                  "(mixed precision, e.g. FSDP2's MixedPrecisionPolicy), as the recording says, in the reference too")
    if rec.sketch:
        notes += "; " + sketch_detection(rec.sketch, max(s.tbounds))[1]
    src = ref.info(rec.steps[0]).get("labels") if rec.steps else None
    if src in ("input_ids", "arg0"):
        notes += (f"; the objective was judged against {src} as its labels (none were recorded: a loop that "
                  "gives its loss labels the model is not given records them with rec.labels(labels))")
    aux = ref.info(rec.steps[0]).get("router_aux") if rec.steps else None
    if aux is not None:  # record/routeraux.py: a transformers MoE model's own per-forward term
        k0 = rec.steps[0]
        forwards = sum(rec.step_meta(r, k0).get("micro_batches", 1) for r in range(rec.world_at(k0)))
        notes += (f"; the objective holds the model's own load-balancing term as transformers' MoE models add it to "
                  f"their loss: router_aux_loss_coef {aux:g} x each forward's aux_loss (over that forward's own "
                  f"routing statistics), each forward's term counted once ({forwards} forwards at step {k0}: the "
                  "term weighs that many times one forward's, where one process at the global batch computes it "
                  "once)")
    if rec.every > 1:
        notes += f"; tensors every {rec.every} steps: a fault confined to fewer steps can be missed"
    return notes


def _with_made_up(rec: A.RecordingSet, ref: ReferenceSet, s: _Scan, reason: str) -> str:
    """Exactly, beside the relative bound: a nonzero fleet gradient where one process's is zero every way
    fails (gradient where there is none to reduce); a pass says how many element-steps were held to zero."""
    found = made_up_gradient(rec, ref)
    if isinstance(found, tuple):
        k0, n, stray = found
        s.first_bad = s.first_bad if s.first_bad is not None and s.first_bad["step"] < k0 else {"step": k0}
        reason = (f"the fleet's gradient is nonzero at {stray} element(s) of {n} at step {k0} where one process's "
                  f"gradient is exactly zero every way it computes it (each micro-batch, and the rows merged), beyond "
                  f"{ZERO_RTOL:.2g} of the tensor's largest element (nothing there to reduce: the fleet made gradient "
                  f"up{', within the relative bound' if s.ok else ''}); {reason}")
        s.ok = False
    elif s.ok and found:
        reason += f"; zero wherever one process's is exactly zero every way ({found} element-steps)"
    return reason


def _gradient_without_backward(rec: A.RecordingSet, ref: ReferenceSet) -> TensorCheck | None:
    """A step at which no rank ran a forward (an optimizer step alone, where one process computes no
    gradient) while the fleet's parameters held one: a gradient left from an earlier step, named where it
    is that step's recorded gradient again (zero_grad missing)."""
    for k in rec.steps:
        if not ref.info(k).get("no_forward"):
            continue
        g = fleet_grad(rec, k)
        if not g:
            continue
        held = sorted(g)
        size = norm(g, held)
        why = f"at step {k} no rank ran a forward or a backward, yet the parameters held a gradient (norm {size:.6g}) " \
              "that the optimizer applied, where one process has none"
        before = [j for j in rec.steps if j < k]
        if before and rec.step_meta(0, before[-1]).get("tensors", True) and rec.step_meta(0, k).get("tensors", True):
            prev = fleet_grad(rec, before[-1])
            if set(prev) == set(g) and all(torch.equal(prev[n], g[n]) for n in held):
                why += (f": step {before[-1]}'s gradient, applied again (the gradients were not zeroed after "
                        f"step {before[-1]})")
        return TensorCheck("gradient", False, why, worst=math.inf, worst_step=k, first_step=k)
    return None


def _first_failing(s: _Scan) -> str:
    """Where the failure begins, when the words above name a later step (the worst): a fault that grows, or
    that a resume or a schedule brings in, is found from its first step."""
    first = s.first_bad
    if first is None or first["step"] == s.worst_k:
        return ""
    err, bound = ((first.get("error"), first.get("bound")) if first.get("bound") is not None else
                  (first.get("tensor_error"), first.get("tensor_bound")))  # run mode: the tensor's own bound
    if err is None or bound is None or math.isinf(err):
        return ""
    return f"; it first fails at step {first['step']} (off by {err:.2g} against its bound {bound:.2g})"


def check_gradient(rec: A.RecordingSet, ref: ReferenceSet) -> TensorCheck:
    """Fact 3 (module docstring): the rows, then the bound stated, then the pass or the failure's shape named,
    then what the recording says the reference followed, then a made-up gradient held exactly."""
    stale = _gradient_without_backward(rec, ref)
    if stale is not None:
        return stale
    run = ref.meta.get("mode") == "run"
    rows = gradient_rows(rec, ref)
    loose = too_loose(rec, ref)
    if loose is not None:
        return _not_judged(rows, precision_words(rec, ref), loose)
    s = _Scan(rows=rows, run=run, wire=rec.spec.wire == "bf16",
              tbounds=[r["tensor_bound"] for r in rows] if run else [r["bound"] for r in rows])
    _scan_rows(rec, ref, s)
    _state_bound(rec, ref, s)
    if s.wire and not s.ok and s.first_bad.get("error") is None:
        reason = _off_grid_reason(s)
    elif s.ok:
        reason = _pass_reason(rec, s)
    else:
        reason = _fail_reason(rec, ref, s) + _first_failing(s)
    reason = _with_made_up(rec, ref, s, reason + _recording_notes(rec, ref, s))
    return TensorCheck("gradient", s.ok, reason, worst=s.worst, worst_tensor=s.worst_t, worst_step=s.worst_k,
                       bound=max(s.tbounds), per_step=s.per,
                       first_step=s.first_bad["step"] if s.first_bad else None, shape=s.shape)



def check_grad_mask(rec: A.RecordingSet, ref: ReferenceSet) -> Check:
    for k in rec.steps:
        info, _ = ref.step(k)
        fleet_none = set(rec.step_meta(0, k).get("no_grad", []))
        ref_none = set(info.get("no_grad", []))
        extra = sorted(ref_none - fleet_none)
        if extra:
            zero = ""
            if rec.step_meta(0, k).get("tensors", True) and not rec.sketch:
                g = rec.tensors_at(k, A.GRAD)
                if all(n in g and not g[n].any() for n in extra):
                    zero = " (all zeros)"
            if info.get("no_forward") and not zero:
                return Check("grad_mask", False, f"{', '.join(extra)} had a gradient in the fleet at step {k}, which "
                                                 "ran no forward or backward: one left from an earlier step (see "
                                                 "gradient)")
            return Check("grad_mask", False,
                         f"{', '.join(extra)} had a gradient{zero} in the fleet at step {k} where one process has "
                         "none: with weight decay or momentum the optimizer moves them (set them to None)")
        missing = sorted(fleet_none - ref_none)
        if missing:
            return Check("grad_mask", False, f"{', '.join(missing)} had no gradient in the fleet at step {k} "
                                             "where one process has one")
    return Check("grad_mask", True, "the parameters with a gradient are the ones one process gives a gradient, "
                                    "at every step")
