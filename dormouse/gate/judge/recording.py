"""The judge of a recorded training loop (issue 13): pure functions from a
recording (record/recorder.py) and its one-process references
(record/reference.py, already written to <out>/reference/) to typed checks and
a Verdict. It reads artifacts only and runs no user code.

Each check says in one sentence why it passed or failed:

independence  fact 1: at every recorded step the per-example gradients of a
              sample of micro-batches (reference.example_sample), summed
              with their weights, equal those micro-batches' gradient,
              ||ex - exb|| / ||exb|| <= INDEP_RTOL, and the gradient does not change
              with the RNG state (active dropout, per-rank RNG); BatchNorm and
              dropout modules are named. And the step's rows in one forward
              ("gm/", as few merged forwards as memory allows) give the
              micro-batches' gradient within the same bound: else "the rows of
              a forward interact". Declared objective_scope "forward" states
              that distance and passes; "step" has neither check.
gradient      fact 3: the fleet's synchronised gradient (divided by the clip
              coefficient where the loop clipped first) against the one-process
              gradient of the DECLARED objective over every rank's micro-batches
              at the recorded parameters: ||g_fleet - g|| / ||g|| <= GRAD_RTOL
              (all tensors together); sketch / every-k recordings hold EACH
              tensor to its own bound (run_tolerance), the bound a sketch's
              detection statement is per tensor for.
              On a failure it fits g_fleet = c g and NAMES c when it is a
              constant clearly away from 1 (|c - 1| > FACTOR_AWAY x bound:
              xW, xK, 1/W, ...), or names the weighting the fleet computed
              (the mean of micro-batch means, each rank its own count).
grad_mask     the parameters with a gradient are the ones one process gives a
              gradient: a zero gradient where one process has none is a FAIL
              (weight decay and the optimizer's moments move them).
replay        fact 4: the user's optimizer and scheduler replayed in one process
              from the initial state on the recorded gradients give the recorded
              parameters BITWISE before every step and after the last, across
              resumes, and the recorded lr; a resume that reset the scheduler is
              named. (Sketch / every-k recordings: the one-process run trained
              on the declared objective instead, within FLOOR_MULTIPLE x its
              own drift from a copy started one ulp away.)
buffers       (when the loop declared buffer_update: state outside the optimizer
              that moves by a rule of its own, dormouse's routing bias) the
              rule applied in one process at the recorded state before every
              step k to every rank's micro-batches of k gives the buffers
              recorded before k + 1 (after the last step: the final ones)
              BITWISE; the buffer and the rule are named.
data          no example read by two ranks (or twice) in one step; none twice
              within an epoch: the loop's (rec.step(epoch=...)) or inferred
              from dataset_len (check_data states the rule; skipped, and said,
              when neither is known). Examples are their ids when given, else
              their tokens' hash: identical rows are then named as such.
loss          the loss the loop reported against the declared objective
              (LOSS_RTOL): reported apart, since a wrong metric is not a wrong
              training; the weighting it computed instead is named.
ranks         every rank's parameters equal before every step and after the
              last (sha256); under FSDP2 each shard exists once (said so);
              every micro-batch of a step under one autocast (or none).
clip          the gradient norm and clip coefficient the loop reported against
              the one-process gradient's norm (CLIP_RTOL).

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

import hashlib
import math
from pathlib import Path

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.bounds import (CLIP_RTOL, FACTOR_AWAY, FACTOR_RTOL, FLOOR_MULTIPLE, GRAD_RTOL,  # noqa: F401
                                        INDEP_RTOL, LOSS_RTOL, PRECISION_CAP, RUN_MIN_RTOL, SKETCH_DELTA,
                                        floor_bound)
from dormouse.gate.judge.verdict import Check, TensorCheck
from dormouse.gate.judge import causes as C


def _norm(d: dict[str, torch.Tensor], names) -> float:
    return math.sqrt(sum(float((d[n].double() ** 2).sum()) for n in names))


def _dot(a, b, names) -> float:
    return sum(float((a[n].double().reshape(-1) * b[n].double().reshape(-1)).sum()) for n in names)


def rel(a: dict, b: dict, names=None) -> float:
    """||a - b|| / ||b|| over the tensors `names` (all of b's) taken as one vector."""
    names = sorted(b) if names is None else names
    den = _norm(b, names)
    num = math.sqrt(sum(float(((a[n].double() - b[n].double()) ** 2).sum()) for n in names))
    x = num / den if den > 0 else num
    return x if math.isfinite(x) else math.inf  # NaN compares false with every bound: above all of them


def fit(a: dict, b: dict, names) -> tuple[float, float]:
    """The c minimising ||a - c b|| and the residual ||a - c b|| / ||c b||."""
    bb = _dot(b, b, names)
    c = _dot(a, b, names) / bb if bb > 0 else 0.0
    scaled = {n: b[n].double() * c for n in names}
    return c, (rel(a, scaled, names) if c else math.inf)


def factor_name(c: float, world: int, micro: int, rtol: float = FACTOR_RTOL) -> str | None:
    """W, K, 1/W, ... : the named constant c is, within rtol (None if none fits)."""
    W, K = world, micro
    cands = [("W", W), ("1/W", 1 / W), ("K", K), ("1/K", 1 / K), ("W·K", W * K), ("1/(W·K)", 1 / (W * K)),
             ("W/K", W / K), ("K/W", K / W), ("W²", W * W), ("1/W²", 1 / (W * W))]
    names = [n for n, v in cands if v != 1 and abs(c / v - 1) <= rtol]
    return " = ".join(names) if names else None


def sketch_detection(k: int, bound: float) -> tuple[float, str]:
    """CountSketch with k buckets: ||S d||^2 / ||d||^2 has mean 1 and variance
    <= 2/k, so by Chebyshev it lies in [1 - e, 1 + e], e = sqrt(2 / (k delta)),
    with probability >= 1 - delta; a relative difference r between two tensors
    then shows as at least r sqrt((1 - e) / (1 + e)). The checks hold each
    tensor's sketch to its own bound, so `bound` is the largest tensor bound.
    Returns the smallest r detected at `bound` and the sentence that says so."""
    e = math.sqrt(2.0 / (k * SKETCH_DELTA))
    if e >= 1:
        return math.inf, (f"sketch k={k}: too few projections for a bound at {1 - SKETCH_DELTA:.0%} "
                          "(use k >= 64)")
    r = bound * math.sqrt((1 + e) / (1 - e))
    return r, (f"sketch k={k}, each tensor's sketch against its own bound: a relative difference above {r:.2g} "
               f"in any one tensor is detected with probability >= {1 - SKETCH_DELTA:.0%} per tensor and step "
               f"(e = {e:.2f}; the largest tensor bound {bound:.2g} x sqrt((1 + e) / (1 - e)))")


class _Ref:
    """The reference artifacts of a recording, read once."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.meta = A.read_json(A.reference_meta_path(out), "reference")
        self._cache: dict = {}
        self._infos: dict = {}

    def step(self, k: int) -> tuple[dict, dict]:
        if k not in self._cache:
            t, _ = A.read_tensors(A.reference_step_tensors_path(self.out, k), "reference tensors")
            self._cache = {k: (A.read_json(A.reference_step_meta_path(self.out, k), "reference step"), t)}
        return self._cache[k]

    def info(self, k: int) -> dict:
        """Step k's reference JSON alone (no tensors read)."""
        if k not in self._infos:
            self._infos[k] = A.read_json(A.reference_step_meta_path(self.out, k), "reference step")
        return self._infos[k]

    def tensors(self, k: int, prefix: str) -> dict[str, torch.Tensor]:
        t = self.step(k)[1]
        return {n[len(prefix):]: v for n, v in t.items() if n.startswith(prefix)}

    def final(self) -> dict[str, torch.Tensor]:
        t, _ = A.read_tensors(A.reference_final_path(self.out), "reference final")
        return {n[3:]: v for n, v in t.items() if n.startswith("rp/")}


def precision_floor(rec: A.RecordingSet, ref: _Ref, k: int | None = None) -> float | None:
    """Step k's measured precision floor (the reference's "precision_floor":
    under autocast, cast or bfloat16/float16 parameters), or with k None the
    largest over the recorded steps; None where the step computed in float32."""
    floors = [f for j in (rec.steps if k is None else [k]) if (f := ref.info(j).get("precision_floor")) is not None]
    return max(floors) if floors else None


def arithmetic_bound(rec: A.RecordingSet, ref: _Ref, float32: float, k: int | None = None) -> float:
    """`float32`, or at a step in reduced precision FLOOR_MULTIPLE x that
    step's measured floor where that is larger (k None: the largest over the
    steps): the gradient the loop reduces carries the round-off of a
    reduced-precision backward at the loop's own loss scale. Each step has its
    own: a float32 step keeps the float32 bound."""
    floor = precision_floor(rec, ref, k)
    return float32 if floor is None else floor_bound(floor, float32)


def too_loose(rec: A.RecordingSet, ref: _Ref) -> tuple[int, float] | None:
    """The first step whose precision bound FLOOR_MULTIPLE x floor exceeds
    PRECISION_CAP (a network that amplifies round-off until a fault of that
    size could not be told from it), with its floor; None if none does."""
    for k in rec.steps:
        f = precision_floor(rec, ref, k)
        if f is not None and FLOOR_MULTIPLE * f > PRECISION_CAP:
            return k, f
    return None


def _precision_words(rec: A.RecordingSet, ref: _Ref) -> str:
    dtypes = rec.autocast_dtypes()
    if dtypes:
        return f"{' and '.join(dtypes)} autocast"
    if rec.compute_dtypes():
        return f"{' and '.join(rec.compute_dtypes())} compute"
    lowp = ref.info(rec.steps[0]).get("low_precision_params") or []
    return f"{' and '.join(lowp)} parameters'"


def _bound_words(rec: A.RecordingSet, ref: _Ref, bound: float, float32: float, k: int | None = None) -> str:
    """How `bound` was set: the float32 bound, or FLOOR_MULTIPLE x the
    precision floor (of step k; k None: the largest, which `bound` then is)."""
    floor = precision_floor(rec, ref, k)
    if floor is None or bound == float32:
        return f"bound {bound:g}"
    return (f"bound {bound:.2g} = {FLOOR_MULTIPLE:g} x the {_precision_words(rec, ref)} floor {floor:.2g}, the "
            "one-process gradient through a loss scaled by 1/3 against it")


# --------------------------------------------------------------------------- the checks


def check_independence(rec: A.RecordingSet, ref: _Ref) -> TensorCheck:
    per, worst, worst_k = [], 0.0, None
    rng, sampled, total = False, 0, 0
    over = False
    scope = rec.meta.get("objective_scope") or "example"
    # the step's rows in as few forwards as memory allows ("gm/") against the micro-batches' sum ("g/")
    gm_worst, gm_k, gm_words, gm_err, gm_over = 0.0, None, None, None, False
    for k in rec.tensor_steps():
        info, _ = ref.step(k)
        rng = rng or bool(info.get("rng_sensitive"))
        ex = ref.tensors(k, "ex/")
        g = ref.tensors(k, "exb/") or ref.tensors(k, "g/")  # the sampled micro-batches' own gradient
        x = rel(ex, g, sorted(set(g) & set(ex)))
        sampled += len(info.get("ex_micro") or [])
        total += sum(len(c) for c in info.get("counts", []))
        per.append(x)
        over = over or x > arithmetic_bound(rec, ref, INDEP_RTOL, k)
        merged = info.get("merged") or {}
        if merged.get("error") and gm_err is None:
            gm_err = (k, merged["error"], merged.get("words"))
        elif merged:
            gm, full = ref.tensors(k, "gm/"), ref.tensors(k, "g/")
            y = rel(gm, full, sorted(set(gm) & set(full)))
            gm_words = merged.get("words")
            gm_over = gm_over or y > arithmetic_bound(rec, ref, INDEP_RTOL, k)
            if y >= gm_worst:
                gm_worst, gm_k = y, k
        if x > worst:
            worst, worst_k = x, k
    bn, drop = ref.meta.get("batchnorm", []), ref.meta.get("dropout", [])
    bound = arithmetic_bound(rec, ref, INDEP_RTOL, worst_k)
    said = _bound_words(rec, ref, bound, INDEP_RTOL, worst_k)
    ok = not over and not rng and not gm_over and gm_err is None
    one = (f"{gm_words} give a gradient {gm_worst:.2g} away from the micro-batches' sum (step {gm_k})"
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
        reason = (f"the per-example gradients sum to their micro-batch's at every recorded step (worst "
                  f"{worst:.2g}, {said}; {sampled} of {total} micro-batches differentiated row by "
                  "row: every rank's first at the first step, one a step after, rotating) and do not change with "
                  "the RNG state" + (f"; {one}" if one else ""))
    elif bn:
        reason = (f"BatchNorm ({', '.join(bn)}) computes statistics over the batch: the per-example gradients "
                  f"differ from the batch's by {worst:.2g} (step {worst_k}; {said}), so splitting "
                  "the batch over ranks changes the mathematics (SyncBN too: use a per-example norm)")
    elif rng or drop:
        reason = ("the gradient changes with the RNG state: active dropout"
                  + (f" ({', '.join(drop)})" if drop else " or other unkeyed randomness")
                  + f": its masks are random draws, which no split of the batch draws as one process does, "
                  f"whether or not the ranks share a seed (per-example vs batch {worst:.2g}); switch it off "
                  "(p = 0 or the module in eval mode) to gate the loop")
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
            reason = (f"the rows of a forward interact: {one} ({_bound_words(rec, ref, arithmetic_bound(rec, ref, INDEP_RTOL, gm_k), INDEP_RTOL, gm_k)}), "
                      "though each row's gradient alone sums to its micro-batch's: the network or the objective "
                      "depends on which rows share a forward (statistics over a forward's rows: a load-balancing "
                      "term, in-batch negatives), so one process at the global batch trains another gradient than "
                      "the fleet's split; declare objective_scope='step' with fn(model, batches) if the statistics "
                      "are meant over the global batch (and the fleet computes them so), or "
                      "objective_scope='forward' if each forward's own statistics are the objective")
    elif not ok and scope == "example" and gm_over and one:
        reason += f"; {one}"
    return TensorCheck("independence", ok, reason, worst=worst, worst_step=worst_k, bound=bound, per_step=per)


def _fleet_grad(rec: A.RecordingSet, k: int) -> dict[str, torch.Tensor]:
    g = rec.tensors_at(k, "gs/" if rec.sketch else "g/")
    m = rec.step_meta(0, k)
    if m.get("clipped") and m.get("clip_coef"):
        g = {n: v.double() / m["clip_coef"] for n, v in g.items()}
    return g


def run_tolerance(rec: A.RecordingSet, ref: _Ref, ours: str, nudged: str) -> dict[int, dict[str, float]]:
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


def gradient_rows(rec: A.RecordingSet, ref: _Ref) -> list[dict]:
    """Per recorded tensor step, the fleet's gradient (divided by the clip
    coefficient where the loop clipped first) against one process's gradient
    of the declared objective: "error" ||g_fleet - g|| / ||g|| over all tensors
    together; replay mode holds that to "bound" = GRAD_RTOL. Run mode (sketch
    or every-k) holds EACH tensor n to its own bound (run_tolerance); "tensor",
    "tensor_error", "tensor_bound" are the tensor nearest its bound (replay:
    the tensor that differs most, tensor_bound None). "scalar" the c fitting
    g_fleet = c g (a wrong count shows as a c per step). "ok" whether the step
    passes."""
    run = ref.meta.get("mode") == "run"
    tol = run_tolerance(rec, ref, "g/", "ng/") if run else {}
    tol = {k: {n: max(b, arithmetic_bound(rec, ref, GRAD_RTOL, k)) for n, b in t.items()} for k, t in tol.items()}
    rows = []
    for k in rec.tensor_steps():
        gb = arithmetic_bound(rec, ref, GRAD_RTOL, k)
        g_ref = ref.tensors(k, "g/")
        g = _fleet_grad(rec, k)
        names = sorted(set(g) & set(g_ref))
        x = rel(g, g_ref, names)
        if run:
            tx, tn, tb, ratio = _per_tensor(g, g_ref, names, tol[k])
            ok = ratio <= 1.0
        else:
            tn = max(names, key=lambda n: rel({n: g[n]}, {n: g_ref[n]}, [n])) if names else None
            tx = rel({tn: g[tn]}, {tn: g_ref[tn]}, [tn]) if tn else 0.0
            tb, ok = None, x <= gb  # replay: the tensors are bounded together, not one by one
            per_t = ref.info(k).get("precision_floor_tensors")
            if per_t:  # reduced precision: each tensor also against FLOOR_MULTIPLE x its own floor
                # (a fault in one small tensor is diluted in the global norm, whose bound is a few percent)
                tol_k = {n: floor_bound(per_t.get(n, 0.0), GRAD_RTOL) for n in names}
                tx, tn, tb, ratio = _per_tensor(g, g_ref, names, tol_k)
                ok = ok and ratio <= 1.0
        c = fit(g, g_ref, names)[0] if names else math.nan  # g_fleet ~ c g: the figure draws c beside the error
        rows.append({"step": k, "error": x, "bound": gb if not run else None, "tensor": tn,
                     "tensor_error": tx, "tensor_bound": tb, "ok": ok, "scalar": c})
    return rows


def gradient_series(out) -> list[dict]:
    """gradient_rows of the recording in `out`, whose reference is made (what
    notebook 04 plots: the per-step gradient error against its bound)."""
    out = Path(out)
    if not A.reference_meta_path(out).exists():
        from dormouse.errors import DormouseError

        raise DormouseError(f"{out} holds no one-process reference: run `dormouse gate check --out {out}`")
    return gradient_rows(A.RecordingSet(out), _Ref(out))


def _never_reduced(rec: A.RecordingSet, ref: _Ref, bound: float):
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


def _step_counts(rec: A.RecordingSet, steps: list[int]) -> list[dict] | None:
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


def _bf16_wire(rec: A.RecordingSet) -> bool:
    """Every element of the fleet's recorded gradient a bfloat16 value at
    every tensor step the loop did not clip (clip coefficient 1 or none: a
    clip multiplies it off the bfloat16 grid); False where no step qualifies."""
    steps = [k for k in rec.tensor_steps() if rec.step_meta(0, k).get("clip_coef") in (None, 1.0)]
    return bool(steps) and all(C.bf16_representable(rec.tensors_at(k, "g/")) for k in steps)


def check_gradient(rec: A.RecordingSet, ref: _Ref) -> TensorCheck:
    run = ref.meta.get("mode") == "run"
    rows = gradient_rows(rec, ref)
    loose = too_loose(rec, ref)
    if loose is not None:
        k, f = loose
        return TensorCheck("gradient", False,
                           f"not judged in reduced precision: at step {k} the {_precision_words(rec, ref)} floor is "
                           f"{f:.2g} (the gradient through the loss / 3 against it), so {FLOOR_MULTIPLE:g} x it "
                           f"exceeds {PRECISION_CAP:g} and a fault of that size would pass as round-off: the network "
                           "amplifies round-off; gate the float32 run",
                           worst=max(r["error"] for r in rows), worst_tensor=None, worst_step=k,
                           bound=FLOOR_MULTIPLE * f, per_step=[r["error"] for r in rows], first_step=k)
    gb = arithmetic_bound(rec, ref, GRAD_RTOL)  # the largest step's (one bound per step in the rows)
    tbounds = [r["tensor_bound"] for r in rows] if run else [r["bound"] for r in rows]
    per, worst, worst_k, worst_t, over = [], 0.0, None, None, False
    fits, fitted, alts = [], [], {"micro_mean": [], "rank_mean": [], "gm": []}
    first_bad, gm_far = None, False
    for row in rows:
        k = row["step"]
        g_ref = ref.tensors(k, "g/")
        g = _fleet_grad(rec, k)
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
                arithmetic_bound(rec, ref, GRAD_RTOL, k):
            continue
        fits.append(fit(g, g_ref, names))
        fitted.append(k)
        for alt in alts:
            a = ref.tensors(k, f"{alt}/")
            an = sorted(set(g) & set(a))
            alts[alt].append(fit(g, a, an) if an else (0.0, math.inf))
        gm = ref.tensors(k, "gm/")  # the global batch in one forward: named only where it is not the sum's
        gm_far = gm_far or bool(gm) and rel(gm, g_ref, sorted(set(gm) & set(g_ref))) > \
            FACTOR_AWAY * arithmetic_bound(rec, ref, GRAD_RTOL, k)
    ok = not over
    bound = gb
    factor_rtol = max(FACTOR_RTOL, gb)  # a fitted constant is as uncertain as the gradients it is fitted to
    world, micro = rec.world_at(rec.steps[0]), rec.step_meta(0, rec.steps[0]).get("micro_batches", 1)
    what = "one process's gradient of the declared objective"
    stated = (_bound_words(rec, ref, max(tbounds), GRAD_RTOL) if not run else
              f"each tensor against its own bound, {FLOOR_MULTIPLE:g} x the one-process run's one-ulp floor of "
              f"that tensor, {min(tbounds):.2g} to {max(tbounds):.2g}")
    if run and first_bad is not None:  # the per-tensor finding: which tensor, by how much, against what
        worst_k, worst_t = first_bad["step"], first_bad["tensor"]
    if ok:
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
        named = factor_name(cs[0], world, micro, factor_rtol) if constant else None
        alt_hit = next((alt for alt, fs in alts.items() if fs and all(r <= bound for _, r in fs)
                        and (alt != "gm" or gm_far)), None)
        apart = None if constant or unit else _never_reduced(rec, ref, bound)
        scalars = [(k, c, r) for k, (c, r) in zip(fitted, fits)]
        per_step = not constant and not unit and C.per_step_scalar(scalars, bound, FACTOR_AWAY * bound)
        if first_bad is not None and math.isinf(first_bad["error"]):
            reason = (f"the fleet's gradient at step {first_bad['step']} is not finite, or one process's at the "
                      "recorded parameters is not: NaN or inf (see finite)")
        elif unit:
            reason = (f"the fleet's gradient equals {what} at the {len(fits)} recorded step(s) where the fleet's "
                      f"parameters equal the one-process run's, but differs by {worst:.2g} at step {worst_k} "
                      f"(tensor {worst_t}; {stated}), after the parameters parted: the fault is in a step between "
                      "(see replay)")
        elif constant and named:
            reason = (f"the fleet's gradient is {what} times {cs[0]:.4g} = {named} (W = {world} ranks, "
                      f"K = {micro} micro-batches) at every step: a normalisation applied the wrong number of times")
        elif constant:
            reason = f"the fleet's gradient is {what} times a constant {cs[0]:.4g} at every step"
        elif apart is not None:
            k0, (far, off) = apart
            reason = (f"the gradients were never all-reduced: at step {k0} the ranks' gradients differ from each other "
                      f"(by {far:.2g}), each its own micro-batches' gradient, and their mean equals {what} (within "
                      f"{off:.2g}; {stated}): no_sync on every micro-batch (or a hand-written all-reduce that never "
                      "ran), so each rank steps on its own gradient and the ranks drift apart")
        elif per_step and not alt_hit:
            reason = C.describe_scalars(scalars, _step_counts(rec, fitted), factor_rtol) + f" ({stated})"
        elif alt_hit:
            c = alts[alt_hit][0][0]
            desc = {"gm": "the gradient of the step's rows in one forward (one process at the global batch: "
                          "statistics over every rank's rows, as an all-reduced load-balancing term or negatives "
                          "gathered from every rank give)",
                    "micro_mean": "the mean of per-micro-batch token means (each micro-batch normalised by its "
                                  "own count, not the step's)",
                    "rank_mean": "the mean of the ranks' own token means (each rank normalised by its own "
                                 "token count)"}[alt_hit]
            reason = (f"the fleet's gradient is {desc}" + (f" times {c:.4g}" if abs(c - 1) > factor_rtol else "")
                      + f", not the global mean the objective declares (off by {worst:.2g} at step {worst_k})")
            if alt_hit == "gm":
                reason = (f"the fleet's gradient is {desc}" + (f" times {c:.4g}" if abs(c - 1) > factor_rtol else "")
                          + f", not the sum of the micro-batches' own the declared objective gives (off by "
                          f"{worst:.2g} at step {worst_k}): declare objective_scope='step' with fn(model, batches) "
                          "computing the statistics over the whole step")
        elif run and first_bad is not None:
            reason = (f"the fleet's gradient differs from {what} in tensor {first_bad['tensor']} by "
                      f"{first_bad['tensor_error']:.2g} at step {first_bad['step']}, above that tensor's bound "
                      f"{first_bad['tensor_bound']:.2g} (all tensors together: {worst:.2g}; {stated})"
                      + ("" if near_one else ", not by a constant factor"))
        else:
            reason = (f"the fleet's gradient differs from {what} by {worst:.2g} at step {worst_k} (tensor "
                      f"{worst_t}; {stated})" + ("" if near_one else ", not by a constant factor"))
            if not rec.sketch and _bf16_wire(rec):
                reason += ("; every element of the fleet's gradient is a bfloat16 value (float32 with its low 16 bits "
                           "zero) at every step it was not clipped: the gradient was all-reduced in bfloat16 (a bf16 "
                           "compress hook), whose round-off (~4e-3 relative) the float32 bound does not allow")
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
    if rec.every > 1:
        reason += f"; tensors every {rec.every} steps: a fault confined to fewer steps can be missed"
    return TensorCheck("gradient", ok, reason, worst=worst, worst_tensor=worst_t, worst_step=worst_k,
                       bound=max(tbounds), per_step=per, first_step=first_bad["step"] if first_bad else None)


def check_grad_mask(rec: A.RecordingSet, ref: _Ref) -> Check:
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


def _first_unequal(a: dict, b: dict) -> tuple[str, float] | None:
    for n in sorted(b):
        if n not in a or a[n].shape != b[n].shape or not torch.equal(a[n].to(b[n].dtype), b[n]):
            return n, (rel({n: a[n]}, {n: b[n]}, [n]) if n in a and a[n].shape == b[n].shape else math.inf)
    return None


def check_replay(rec: A.RecordingSet, ref: _Ref) -> Check:
    resumed = set(rec.resumed_at())
    steps = rec.steps
    # the lr the loop used against the uninterrupted scheduler's
    for k in steps:
        lr, want = rec.step_meta(0, k).get("lr"), ref.step(k)[0].get("replay_lr")
        if lr is not None and want is not None and abs(lr - want) > 1e-12 * max(abs(want), 1e-30):
            if k in resumed or any(s <= k for s in resumed):
                first = min(s for s in resumed if s <= k)
                return Check("replay", False,
                             f"after the resume at step {first} the loop's lr at step {k} is {lr:.6g} where the "
                             f"uninterrupted scheduler gives {want:.6g}: the resume dropped the lr scheduler's state")
            return Check("replay", False, f"the loop's lr at step {k} is {lr:.6g} where its scheduler, replayed, "
                                          f"gives {want:.6g}")
    if ref.meta.get("mode") == "run":
        tol = run_tolerance(rec, ref, "rp/", "np/")
        # reduced precision: a one-ulp nudge mostly vanishes in the cast, so the run's own drift
        # under-measures; each step's precision bound (a gradient's, so loose for parameters) instead
        tol = {k: {n: max(b, arithmetic_bound(rec, ref, RUN_MIN_RTOL, k)) for n, b in t.items()}
               for k, t in tol.items()}
        worst, at, name, ok = (0.0, 0.0), None, None, True
        pre = "ps/" if rec.sketch else "p/"
        for k in rec.tensor_steps():
            a, b = rec.tensors_at(k, pre), ref.tensors(k, "rp/")
            x, n, t, ratio = _per_tensor(a, b, sorted(set(a) & set(b)), tol[k])
            ok = ok and ratio <= 1.0
            if ratio > worst[1]:
                worst, at, name = (x, ratio), k, n
        last = tol[rec.tensor_steps()[-1]]
        a, b = rec.final(pre), ref.final()
        x, n, t, ratio = _per_tensor(a, b, sorted(set(a) & set(b)), last)
        ok = ok and ratio <= 1.0
        if ratio > worst[1]:
            worst, at, name = (x, ratio), "final", n
        bounds = [v for d in tol.values() for v in d.values()]
        why = (f"the recorded parameters {'match' if ok else 'differ from'} one process trained on the declared "
               f"objective over the recorded micro-batches (each tensor against its own bound, {FLOOR_MULTIPLE:g} "
               f"x that run's one-ulp floor of the tensor, {min(bounds):.2g} to {max(bounds):.2g}; nearest its "
               f"bound: {name} at step {at}, {worst[0]:.2g}, {worst[1]:.2g} x its bound; the recording keeps no "
               "full gradients to replay, so facts 3 and 4 are judged together)")
        if rec.sketch:
            why += "; " + sketch_detection(rec.sketch, max(bounds))[1]
        return Check("replay", ok, why)
    for k in steps:
        diff = _first_unequal(rec.tensors_at(k, "p/"), ref.tensors(k, "rp/"))
        if diff:
            where = ("the parameters the resume loaded" if k in resumed else
                     f"the fleet's update at step {k - 1}" if k > steps[0] else "the recorded initial state")
            return Check("replay", False,
                         f"{where} differs from the replay of the user's optimizer on the recorded gradients: "
                         f"parameters before step {k} differ (first: {diff[0]}, relative {diff[1]:.2g})")
    diff = _first_unequal(rec.final("p/"), ref.final())
    if diff:
        return Check("replay", False, f"the fleet's update at step {steps[-1]} differs from the replay: final "
                                      f"parameters differ (first: {diff[0]}, relative {diff[1]:.2g})")
    segs = len(rec.meta["segments"])
    return Check("replay", True, f"the user's optimizer and scheduler, replayed from the initial state on the "
                                 f"recorded gradients, give the recorded parameters bitwise at all {len(steps)} "
                                 f"steps" + (f", across {segs - 1} resume(s)" if segs > 1 else ""))


def check_buffers(rec: A.RecordingSet, ref: _Ref) -> Check | None:
    """None when the recording declares no buffer_update (the check is not part of its verdict)."""
    path = rec.meta.get("buffer_update")
    if not path:
        return None
    rule = ref.meta.get("buffer_rule")
    if ref.meta.get("mode") != "replay" or rule is None:
        return Check("buffers", True, f"the buffers' declared update ({path}) is not checked: the recording keeps "
                                      "no full tensors at every step (sketch or every > 1)")
    steps, names = rec.steps, set()
    for i, k in enumerate(steps):
        want = ref.tensors(k, "bu/")
        after = f"before step {steps[i + 1]}" if i + 1 < len(steps) else "after the last step"
        got = rec.tensors_at(steps[i + 1], "b/") if i + 1 < len(steps) else rec.final("b/")
        for n in sorted(want):
            names.add(n)
            if n not in got:
                return Check("buffers", False, f"the recording holds no buffer {n} {after}, which its declared "
                                               f"update ({rule}) moves: record the model's persistent buffers")
            if got[n].shape != want[n].shape or not torch.equal(got[n].to(want[n].dtype), want[n]):
                d = (float((got[n].double() - want[n].double()).abs().max()) if got[n].shape == want[n].shape
                     else math.inf)
                return Check("buffers", False, f"{n} {after} is not its declared update of step {k} ({rule}; max "
                                               f"difference {d:.3g}): the loop moved it by other inputs or by "
                                               "another rule")
    shown = ", ".join(sorted(names)) or "no buffer"
    return Check("buffers", True, f"{shown} follow{'s' if len(names) < 2 else ''} the declared update ({rule}) from every rank's recorded "
                                  f"micro-batches, bitwise, at all {len(steps)} steps")


def _row_ids(batch: dict[str, torch.Tensor]) -> list[str]:
    """Each row's identity: its "idx"/"example_id" (exact), else a sha1 of its
    tokens (input_ids where attention_mask is 1): identical content, one id."""
    for key in ("idx", "example_id"):
        if key in batch:
            return [f"id:{int(x)}" for x in batch[key].reshape(-1)]
    return _row_hashes(batch)


def _row_hashes(batch: dict[str, torch.Tensor]) -> list[str]:
    """A sha1 of each row's tokens (input_ids where attention_mask is 1)."""
    ids = batch.get("input_ids", batch.get("arg0"))
    if ids is None:
        return []
    mask = batch.get("attention_mask")
    out = []
    for i in range(ids.shape[0]):
        row = ids[i] if mask is None else ids[i][mask[i].bool()]
        out.append(hashlib.sha1(row.to(torch.int64).contiguous().numpy().tobytes()).hexdigest())
    return out


def _identical_ranks(rec: A.RecordingSet, k: int) -> tuple[tuple[int, int], int] | None:
    """Two ranks whose rows at step k are identical token for token (every
    row, in order; by _row_hashes): ((q, r), rows), else None."""
    seen: dict[tuple[str, ...], int] = {}
    for r in range(rec.world_at(k)):
        rows = tuple(h for rr, _, b in rec.micro_batches(k) if rr == r for h in _row_hashes(b))
        if not rows:
            continue
        if rows in seen:
            return (seen[rows], r), len(rows)
        seen[rows] = r
    return None


def _reads(rec: A.RecordingSet, k: int) -> tuple[list[tuple[int, list[str]]], bool]:
    """Step k's reads: (rank, the row ids it read in the step, micro-batches
    in order) per rank, and whether every id is exact (given) rather than a
    content hash."""
    groups, exact = [], True
    for r in range(rec.world_at(k)):
        given = rec.example_ids(r, k)
        if given is not None:
            groups.append((r, [f"id:{int(x)}" for x in given]))
            continue
        ids = [i for rr, _, b in rec.micro_batches(k) if rr == r for i in _row_ids(b)]
        exact = exact and all(i.startswith("id:") for i in ids)
        groups.append((r, ids))
    return groups, exact


def _ids_against_corpus(rec: A.RecordingSet) -> tuple[str | None, str]:
    """Where the recording names the corpus its example ids are byte offsets
    into: (the first recorded row whose inputs or targets are not the
    corpus's bytes at its id -- a read below the offsets the loop reports, a
    micro-batch re-read, a read that ignores its start -- or None; why the
    ids could not be checked, or ""). A corpus no longer at its path, or
    changed since the recording (its sha256), leaves the ids as given and
    says so: the run is not blamed for a file moved or edited after it."""
    import numpy as np

    path = rec.meta.get("example_corpus")
    if not path:
        return None, ""
    p = Path(path)
    if not p.is_file():
        return None, f"not checked against the corpus: {str(p)!r} is no longer there"
    if rec.meta.get("example_corpus_sha256") not in (None, A.corpus_digest(p)):
        return None, f"not checked against the corpus: {str(p)!r} changed since the recording (sha256)"
    corpus = np.memmap(p, dtype=np.uint8, mode="r")
    windows: dict = {}  # epoch -> [(first byte, end, step, rank)] of every window read in it
    for k in rec.steps:
        epoch = rec.step_meta(0, k).get("epoch")
        for r in range(rec.world_at(k)):
            ids = rec.example_ids(r, k)
            if ids is None:
                continue
            rows = []  # (inputs, targets or None) of each row, in micro-batch order
            for rr, _, b in rec.micro_batches(k):
                x, y = b.get("input_ids", b.get("arg0")), b.get("labels", b.get("arg1"))
                if rr == r and x is not None:
                    rows += [(x[i], None if y is None else y[i]) for i in range(x.shape[0])]
            if len(rows) != ids.numel():
                return (f"at step {k} rank {r} recorded {len(rows)} rows under {ids.numel()} example ids: the "
                        "loop's ids do not match its reads (give one id per row, in the order read)"), ""
            for i, (at, (x, y)) in enumerate(zip(ids.tolist(), rows)):
                T, at = x.shape[0], int(at)
                for part, got, start in (("inputs", x, at), ("targets", y, at + 1)):
                    want = corpus[start:start + T]
                    if got is not None and (want.shape[0] != T or not np.array_equal(want, got.numpy())):
                        return (f"at step {k} rank {r}'s row {i}: its {part} are not the {T} bytes of {p.name} "
                                f"at byte {start} (its example id {at}): the loop read other bytes than its ids "
                                "say (a micro-batch read twice, a read that ignores its offset, another "
                                "window's targets)"), ""
                windows.setdefault(epoch, []).append((at, at + T + 1, k, r))
    for epoch, spans in windows.items():  # a window is read once an epoch, and none overlaps another
        spans.sort()
        for (a0, e0, k0, r0), (a1, _, k1, r1) in zip(spans, spans[1:]):
            if a0 < a1 < e0:  # an exact repeat is the id check's (an example read twice)
                return (f"windows overlap within epoch {epoch}: rank {r0}'s at byte {a0} (step {k0}) runs to byte "
                        f"{e0}, past the start of rank {r1}'s at byte {a1} (step {k1}): the loop's reads are not "
                        "the disjoint windows one process reads (a wrong offset between ranks or steps)"), ""
    return None, ""


EVEN_BATCHES = ("a read twice is what HF's Trainer does at an uneven end of an epoch: accelerate's even_batches "
                "fills the last step's batch on every rank with the epoch's first examples, which one process "
                "does not read again (dataloader_drop_last=True, or a dataset that divides by the global batch, "
                "trains each example once an epoch)")
IDENTICAL = ("the data check identifies examples by a hash of their tokens, so identical rows (duplicates in "
             "the dataset) cannot be told from one example read twice: identical rows: pass example_ids=... to "
             "rec.step (the sampler's indices) to tell them apart")


def check_data(rec: A.RecordingSet) -> Check:
    """No example read twice in one step (by two ranks, or one rank twice),
    none twice within an epoch.

    Identity: example ids (rec.step(example_ids=...) or an "idx"/"example_id"
    input) are exact; without them a row is its tokens' hash. A repeat of
    content is then called a double read (a data-order bug) only when all of
    a rank's rows in a step, in order, repeat another rank's in that step or
    a rank's in an earlier step of the epoch (every rank reading the same
    data, an epoch replayed after a resume); a repeat of single rows is named as
    identical rows, which the hash cannot tell from one example read twice.

    Epochs: the loop's own (rec.step(epoch=...)) when every step carries one;
    else inferred from dataset_len n: an epoch runs from its first step while
    its reads stay within n, and the next epoch begins at the first step whose
    reads would take it past n. A DataLoader with drop_last (and a
    DistributedSampler with drop_last) leaves fewer than one step's reads R of
    an epoch unread (at most (W - 1) + W (K B - 1) = R - 1), so each epoch's
    reads plus the next step's exceed n and the rule finds the loop's epochs;
    a loop that leaves more unread must pass epoch=.

    Ids are taken as given, unless the recording names the corpus they are
    byte offsets into (Recorder(example_corpus=...), dormouse's own loop):
    then every recorded row must be the corpus's bytes at its id first
    (_ids_against_corpus), so the ids describe what was read."""
    wrong, unverified = _ids_against_corpus(rec)
    if wrong:
        return Check("data", False, wrong)
    n = int(rec.meta.get("dataset_len", 0))
    epochs = [rec.step_meta(0, k).get("epoch") for k in rec.steps]
    given_epochs = all(e is not None for e in epochs)
    all_exact, reads = True, 0
    cur: dict[str, int] = {}  # id -> step, within the current epoch
    cur_groups: set[tuple[str, ...]] = set()
    cur_reads, epoch, prev = 0, 0, None
    for k, ep in zip(rec.steps, epochs):
        groups, exact = _reads(rec, k)
        all_exact = all_exact and exact
        same = _identical_ranks(rec, k) if exact else None
        if same:  # ids given: they never overrule the tokens
            (q, r), rows = same
            return Check("data", False, f"at step {k} ranks {q} and {r} read identical rows, token for token (all "
                                        f"{rows} of them, in order), though the example ids the loop gave differ: "
                                        "every rank read the same data (no DistributedSampler?) and the ids do not "
                                        "describe the reads; only a dataset that repeats every one of those rows, in "
                                        "that order, under other ids would read so")
        step_n = sum(len(ids) for _, ids in groups)
        reads += step_n
        if given_epochs:
            if prev is not None and ep != prev:
                cur, cur_groups, cur_reads = {}, set(), 0
            epoch, prev = ep, ep
        elif not n:  # no epochs known: only the step itself is checked
            cur, cur_groups, cur_reads = {}, set(), 0
        elif cur_reads and cur_reads + step_n > n:
            cur, cur_groups, cur_reads, epoch = {}, set(), 0, epoch + 1
        seen: dict[str, int] = {}  # id -> rank, within this step
        step_groups: dict[tuple[str, ...], int] = {}
        for r, ids in groups:
            whole = tuple(ids)
            replayed = exact or whole in step_groups or whole in cur_groups
            for e in ids:
                if e in seen:
                    if not replayed:
                        return Check("data", False, f"at step {k} ranks {seen[e]} and {r} read identical rows "
                                                    f"(equal tokens); {IDENTICAL}")
                    if seen[e] != r:
                        if exact and tuple(dict(groups)[seen[e]]) != whole:
                            return Check("data", False, f"at step {k} example {e.removeprefix('id:')} was read by "
                                                        f"ranks {seen[e]} and {r}: the ranks' reads overlap (each "
                                                        "rank must read its own share: a DistributedSampler, or "
                                                        "shards of the data)")
                        ident = "" if exact else " (all its rows, in order: the same step's reads)"
                        return Check("data", False, f"at step {k} an example was read by ranks {seen[e]} and {r}"
                                                    f"{ident}: every rank read the same data (no "
                                                    "DistributedSampler?)")
                    return Check("data", False, f"at step {k} an example was read by rank {r} twice in one step")
                if e in cur:
                    if not replayed:
                        return Check("data", False, f"rows read at steps {cur[e]} and {k} are identical (equal "
                                                    f"tokens) within epoch {epoch}; {EVEN_BATCHES}; {IDENTICAL}")
                    src = "the loop's epochs" if given_epochs else f"dataset_len {n}"
                    return Check("data", False, f"an example was read twice within epoch {epoch} (steps {cur[e]} "
                                                f"and {k}, {src})")
                seen[e] = r
            step_groups[whole] = r
        for r, ids in groups:
            for e in ids:
                cur[e] = k
            cur_groups.add(tuple(ids))
        cur_reads += step_n
        if given_epochs and n and cur_reads > n:
            return Check("data", False, f"epoch {ep} read {cur_reads} examples by step {k}, more than dataset_len "
                                        f"{n}")
    how = "by the example ids given" if all_exact else "by their tokens' hash (no example_ids given)"
    if all_exact and rec.meta.get("example_corpus"):
        how += f" ({unverified})" if unverified else ", every row the corpus's bytes at its id"
    if given_epochs:
        return Check("data", True, f"no example was read by two ranks in any step, none twice within any of the "
                                   f"loop's epochs (rec.step(epoch=...): {len(set(epochs))} epoch(s), {reads} reads; "
                                   f"examples identified {how})")
    if not n:
        return Check("data", True, f"no example was read by two ranks in any step (examples identified {how}); "
                                   "dataset_len unknown and no rec.step(epoch=...): the once-per-epoch check was "
                                   "skipped")
    return Check("data", True, f"no example was read by two ranks in any step, none twice within an epoch of at "
                               f"most {n} examples ({reads} reads; epochs inferred from dataset_len: a new one at "
                               f"the first step that would pass it; examples identified {how})")


def check_loss(rec: A.RecordingSet, ref: _Ref, training_ok: bool) -> Check:
    worst, at, alt_hits = 0.0, None, None
    reported_any, over, floor = False, False, 0.0
    # reduced precision: the loss as a loop computing it in the forward's dtype gives it (measured per step)
    lowp = max((f for k in rec.steps if (f := ref.info(k).get("loss_floor")) is not None), default=None)
    for k in rec.steps:
        info, _ = ref.step(k)
        if info.get("nudged_loss") is not None:  # run mode: the one-process run's own one-ulp floor
            floor = max(floor, abs(info["nudged_loss"] - info["loss"]) / max(abs(info["loss"]), 1e-30))
        # a step in reduced precision: the largest loss floor of such steps (one scalar a step is a noisy
        # measure of a rounding); a float32 step keeps its own bound
        tol = floor_bound(max(floor, lowp if info.get("loss_floor") is not None else 0.0), LOSS_RTOL)
        losses = [rec.step_meta(r, k).get("loss") for r in range(rec.world_at(k))]
        if losses[0] is None:
            continue
        reported_any = True
        x = abs(losses[0] - info["loss"]) / max(abs(info["loss"]), 1e-30)
        x = x if math.isfinite(x) else math.inf  # a NaN logged (or a NaN reference): above every bound
        if x > worst:
            worst, at = x, k
        if x > tol:
            over = True
            hits = {a for a, v in (("micro_mean", info["loss_alt"]["micro_mean"]),
                                   ("rank_mean", info["loss_alt"]["rank_mean"]),
                                   ("rank_local", (info["loss_alt"]["rank_local"] or [None])[0]))
                    if v is not None and abs(losses[0] - v) <= tol * abs(v)}
            alt_hits = hits if alt_hits is None else alt_hits & hits
    if not reported_any:
        return Check("loss", True, "the loop reported no loss (rec.step(loss=...)): not checked")
    if not over:
        tol = floor_bound(max(floor, lowp or 0.0), LOSS_RTOL)
        said = f"bound {tol:.2g}"
        if lowp is not None and FLOOR_MULTIPLE * lowp > max(LOSS_RTOL, FLOOR_MULTIPLE * floor):
            said += (f" = {FLOOR_MULTIPLE:g} x the {_precision_words(rec, ref)} loss floor {lowp:.2g}, the loss "
                     "from logits left in the forward's dtype against it, at the largest; each step its own")
        return Check("loss", True, f"the logged loss equals the declared objective over the global batch at every "
                                   f"step (worst {worst:.2g}, {said})")
    desc = {"micro_mean": "the mean of per-micro-batch token means", "rank_mean": "the mean of the ranks' own "
            "token means", "rank_local": "rank 0's own token mean"}
    named = next((desc[a] for a in ("rank_mean", "micro_mean", "rank_local") if alt_hits and a in alt_hits), None)
    reason = (f"the logged loss differs from the declared objective by {worst:.2g} at step {at}"
              + (f": it is {named}, not the global token mean" if named else ""))
    if math.isinf(worst):
        logged = rec.step_meta(0, at).get("loss")
        reason = (f"the logged loss at step {at} is {logged}" if isinstance(logged, float) and not math.isfinite(logged)
                  else f"the declared objective at step {at} is not finite (the recorded parameters hold NaN or inf)"
                  ) + ": not compared (see finite)"
    reason += ("; the training itself matches one process (gradient and replay pass): the logged loss is wrong, "
               "not the training" if training_ok else "")
    return Check("loss", False, reason)


def _autocast_words(state: tuple) -> str:
    a, cast = state
    words = "no autocast" if a is None else f"{a['device_type']} {a['dtype']} autocast"
    return words + (f" on parameters cast to {cast}" if cast else "")


def _precision_split(rec: A.RecordingSet) -> str | None:
    """Where a rank's micro-batches ran in other precisions than rank 0's
    same micro-batches (one rank without the others' autocast, or on
    parameters cast otherwise): the sentence that says so, else None. A
    pattern every rank follows alike (the first micro-batch under autocast
    on each) is the fleet's own, and the reference mirrors it."""
    for k in rec.steps:
        states = [[(rec.autocast(r, k, m), rec.compute_dtype(r, k, m))
                   for m in range(rec.step_meta(r, k).get("micro_batches", 0))] for r in range(rec.world_at(k))]
        for r, st in enumerate(states):
            for m, a in enumerate(st):
                want = states[0][m] if m < len(states[0]) else states[0][-1] if states[0] else a
                if a != want:
                    return (f"at step {k} rank {r} ran micro-batch {m} under {_autocast_words(a)}, rank 0 under "
                            f"{_autocast_words(want)}: the fleet's ranks do not compute in one precision")
    return None


def _mode_split(rec: A.RecordingSet) -> str | None:
    """Where a micro-batch ran other submodules in eval mode than rank 0's
    first micro-batch of the step (whose modes the reference sets): the
    sentence that says so, else None."""
    for k in rec.steps:
        want = set(rec.eval_modules(k))
        for r in range(rec.world_at(k)):
            for m in range(rec.step_meta(r, k).get("micro_batches", 0)):
                got = set(rec.eval_modules(k, r, m))
                if got != want:
                    words = lambda s: ", ".join(sorted(s)) or "none"  # noqa: E731
                    return (f"at step {k} rank {r}'s micro-batch {m} ran other submodules in eval mode ({words(got)}) "
                            f"than rank 0's first ({words(want)}): the fleet's ranks do not run one network")
    return None


def _call_split(rec: A.RecordingSet) -> str | None:
    """Where a rank's micro-batch got other non-tensor forward arguments or ran
    with other plain attributes than rank 0's same micro-batch (a branch switch
    one rank sets alone): the sentence that says so, else None. As with the
    precision, a pattern every rank follows alike is the fleet's own, and the
    reference reproduces it micro-batch by micro-batch. Integer arguments are
    compared by name only: their values are lengths and counts of the
    micro-batch's own data (TRL's padding-free collator passes the longest
    packed sequence, max_length_q), which differ between ranks as the data does."""

    def switches(key, x):
        return {a: (v if type(v) is not int else "an int") for a, v in x.items()} if key == "call" and x else x

    for k in rec.steps:
        for key, what in (("call", "non-tensor forward arguments"), ("attrs", "plain attributes")):
            states = [[x or None for x in (rec.step_meta(r, k).get(key) or [])][:rec.step_meta(r, k).get(
                "micro_batches", 0)] for r in range(rec.world_at(k))]
            for r, st in enumerate(states):
                for m, a in enumerate(st):
                    want = states[0][m] if m < len(states[0]) else states[0][-1] if states[0] else a
                    if switches(key, a) != switches(key, want):
                        return (f"at step {k} rank {r}'s micro-batch {m} ran with other {what} ({a}) than rank 0's "
                                f"same micro-batch ({want}): the fleet's ranks do not run one network (a branch "
                                "one rank switches alone)")
    return None


def check_ranks(rec: A.RecordingSet) -> Check:
    split = _precision_split(rec) or _mode_split(rec) or _call_split(rec)
    if split:
        return Check("ranks", False, split)
    if rec.meta.get("fsdp"):
        return Check("ranks", True, "FSDP2: each rank holds its own shard (each parameter exists once); the "
                                    "assembled tensors are what the other checks judge")
    if (rec.meta.get("layout") or {}).get("pipeline"):  # judge/layouts.py: each stage's parameters exist once
        return Check("ranks", True, "pipeline: each rank holds its own stage's parameters (each exists once); "
                                    "merged by name, they are what the other checks judge")
    for k in rec.tensor_steps():
        hashes = [rec.step_meta(r, k).get("param_hash") for r in range(rec.world_at(k))]
        bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
        if bad:
            return Check("ranks", False, f"rank {bad[0]}'s parameters or persistent buffers differ from rank 0's "
                                         f"before step {k}")
    w = rec.world_at(rec.steps[-1])
    finals = [A.read_json(A.final_meta_path(rec.out, r), "final").get("param_hash") for r in range(w)]
    if any(h != finals[0] for h in finals):
        return Check("ranks", False, "the ranks' parameters or persistent buffers differ after the last step")
    return Check("ranks", True, "every rank's parameters and persistent buffers are equal before every "
                                "recorded step and after the last")


def check_clip(rec: A.RecordingSet, ref: _Ref) -> Check:
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
        tol = arithmetic_bound(rec, ref, CLIP_RTOL, k)  # | |a| - |b| | <= |a - b|: the gradient's bound holds for its norm
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
                g = _fleet_grad(rec, k)
                own = _norm(g, sorted(g))
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
                               f"every step ({_bound_words(rec, ref, arithmetic_bound(rec, ref, CLIP_RTOL), CLIP_RTOL)}"
                               + (", each step against its own" if precision_floor(rec, ref) is not None else "")
                               + ")")


def provenance(rec: A.RecordingSet) -> dict:
    """The verdict's provenance (docs/verdict.schema.json's keys): the
    recording's code, torch, device and threads; "corpus" the sha256 of every
    micro-batch the fleet read (step JSONs and input tensors, in step and rank
    order), "init" the fingerprint of the recorded initial state."""
    import hashlib as _h

    p = dict(rec.meta.get("provenance", {}))
    h = _h.sha256()
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            for key, t in sorted(rec.step_tensors(r, k).items()):
                if key.startswith("in/") or key == "ids":
                    h.update(f"{k}:{r}:{key}:{tuple(t.shape)}".encode())
                    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    p.update({"corpus": h.hexdigest(), "init": A.fingerprint(rec.init())})
    for key, default in (("dormouse", ""), ("source", "0" * 64), ("cpu_capability", ""), ("device", "cpu"),
                         ("threads", 1)):
        p.setdefault(key, default)
    return p
