"""The gradient toolkit the facts share: the fleet's gradient as the judge reads it, the per-tensor
bounds of a run-mode reference, the bf16 wire's element bound, and the cause-finders a failing
gradient check (facts/gradient.py), the clip check (facts/clip.py) and the loss check name a fault
with (ranks never reduced, gradients not zeroed, a count off, a made-up gradient, a bfloat16
reduction). Pure reads of a recording and its reference; no verdict is made here."""

from __future__ import annotations

import math

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge import causes as C
from dormouse.gate.judge.bounds import BF16_UNIT_ROUNDOFF, GRAD_RTOL, RUN_MIN_RTOL, ZERO_RTOL, floor_bound
from dormouse.gate.judge.metrics import factor_name, fit, parts, rel
from dormouse.gate.judge.precision import arithmetic_bound


def rank_grad(rec: A.RecordingSet, r: int, k: int) -> dict[str, torch.Tensor]:
    """Rank r's recorded (full) gradient at step k over its own clip coefficient, in float64."""
    m = rec.step_meta(r, k)
    coef = m["clip_coef"] if m.get("clipped") and m.get("clip_coef") else 1.0
    return {n: v.double() / coef for n, v in A.prefixed(A.GRAD, rec.step_tensors(r, k)).items()}


def fleet_grad(rec: A.RecordingSet, k: int) -> dict[str, torch.Tensor]:
    g = rec.tensors_at(k, A.SKETCHED_GRAD if rec.sketch else A.GRAD)
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


def param_tolerance(rec: A.RecordingSet, ref: ReferenceSet) -> dict[int, dict[str, float]]:
    """Run mode's bound on each tensor of the parameters before each step (the replay's, and where the
    gradient check asks whether the parameters still agree): run_tolerance of the replayed parameters, at
    least the step's precision bound (in reduced precision a one-ulp nudge mostly vanishes in the cast, so
    the run's own drift under-measures; a gradient's bound, so loose for parameters)."""
    tol = run_tolerance(rec, ref, A.REPLAY_PARAM, A.NUDGED_PARAM)
    return {k: {n: max(b, arithmetic_bound(rec, ref, RUN_MIN_RTOL, k)) for n, b in t.items()} for k, t in tol.items()}


def params_agree(rec: A.RecordingSet, ref: ReferenceSet, k: int, tol: dict[int, dict[str, float]]) -> bool:
    """Whether the fleet's parameters before step k are the one-process run's, each tensor within its own
    bound (param_tolerance's tol)."""
    a, b = rec.tensors_at(k, A.SKETCHED_PARAM if rec.sketch else A.PARAM), ref.tensors(k, A.REPLAY_PARAM)
    return per_tensor(a, b, sorted(set(a) & set(b)), tol[k])[3] <= 1.0


def masks_replayed(rec: A.RecordingSet, ref: ReferenceSet) -> bool:
    """Every step's forwards drew again from the RNG states their ranks started from (a CPU run, its
    states recorded, no tensor-parallel or other layout, whose shards draw masks of their own)."""
    return {ref.info(k).get("rng_states") for k in rec.tensor_steps()} == {"replayed"} and not rec.recorded.layout


def parts_at(rec: A.RecordingSet, ref: ReferenceSet, k: int) -> dict:
    """metrics.parts of the fleet's gradient at step k against one process's, tensor by tensor (what
    causes.tensor_factor reads)."""
    g, g_ref = fleet_grad(rec, k), ref.tensors(k, A.GRAD)
    return parts(g, g_ref, sorted(set(g) & set(g_ref)))


def per_tensor(a: dict, b: dict, names, tol: dict[str, float]) -> tuple[float, str | None, float, float]:
    """The tensor nearest its own bound: (its rel, its name, its bound, rel / bound)."""
    best = (0.0, None, 0.0, -1.0)
    for n in names:
        x = rel({n: a[n]}, {n: b[n]}, [n])
        t = tol.get(n, RUN_MIN_RTOL)
        if x / t > best[3]:
            best = (x, n, t, x / t)
    return best


def wire_element_bound(g_ref: torch.Tensor, wa: torch.Tensor, world: int) -> torch.Tensor:
    """The bf16 wire's bound on each element of the reduced gradient: W u wa + GRAD_RTOL max|g_ref| (wa = sum_r
    |g_r| / T, every rank's contribution the wire rounds, each summand and partial sum within u of itself; the
    float32 term keeps elements whose contributions nearly vanish from weighing in by their round-off alone)."""
    return world * BF16_UNIT_ROUNDOFF * wa.double() + GRAD_RTOL * float(g_ref.double().abs().max())


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
        b = wire_element_bound(g_ref[n], wa[n], world)
        keep = b > 0
        x = float((d[keep] / b[keep]).max()) if keep.any() else 0.0
        x = math.inf if bool((d[~keep] > 0).any()) or not math.isfinite(x) else x
        if x > worst or where is None:
            worst, where = x, n
    return worst, where


def never_reduced(rec: A.RecordingSet, ref: ReferenceSet, bound: float):
    """(the first step, (ranks apart, mean against one process)) where the
    ranks' recorded gradients differ and their mean is one process's
    (causes.never_reduced): DDP's gradients never all-reduced. None under
    FSDP2 (each rank holds a shard) or sketches, or where it does not hold."""
    if rec.recorded.fsdp or rec.sketch:
        return None
    for k in rec.tensor_steps():
        w = rec.world_at(k)
        grads = [rank_grad(rec, r, k) for r in range(w)]
        found = C.never_reduced(grads, ref.tensors(k, A.GRAD), rel, bound)
        if found is not None:
            return k, found
    return None


def stale_steps(rec: A.RecordingSet, ref: ReferenceSet, bound: float, failing: list[int]) -> tuple[int, list[str], float] | None:
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
        off = C.stale_gradient(rec.tensors_at(k - 1, A.GRAD), fleet_grad(rec, k), ref.tensors(k, A.GRAD), rel, fit, bound)
        if off is None:
            return None
        found.append(off)
    return failing[0], found[0][0], found[0][1]


def step_counts_of(rec: A.RecordingSet, steps: list[int]) -> list[dict] | None:
    """causes.step_counts at each of `steps` (a built-in token objective only;
    causal_lm shifts by one), or None where a step's targets are not [rows, T]."""
    objective = rec.spec.objective
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
    return bool(steps) and all(C.bf16_representable(rec.tensors_at(k, A.GRAD)) for k in steps)


def bf16_tensors(rec: A.RecordingSet, least: int = 16) -> list[str]:
    """The tensors whose gradient is a bfloat16 value in every element (at least `least` of them nonzero: an
    all-zero or near-empty gradient says nothing) at every tensor step the loop did not clip, where some
    other tensor's is not: a reduction run in bfloat16 for those tensors alone; [] otherwise."""
    steps = [k for k in rec.tensor_steps() if rec.step_meta(0, k).get("clip_coef") in (None, 1.0)]
    names, total = None, 0
    for k in steps:
        g = rec.tensors_at(k, A.GRAD)
        total = len(g)
        on = {n for n, v in g.items() if int((v != 0).sum()) >= least and C.bf16_representable({n: v})}
        names = on if names is None else names & on
    return sorted(names) if names and len(names) < total else []


def off_the_bf16_grid(rec: A.RecordingSet) -> int | None:
    """Under a declared bf16 wire: the first recorded step the loop did not
    clip whose gradient holds a value that is not a bfloat16 (what a bf16
    all-reduce cannot give), else None."""
    for k in rec.tensor_steps():
        if rec.step_meta(0, k).get("clip_coef") in (None, 1.0) and not C.bf16_representable(rec.tensors_at(k, A.GRAD)):
            return k
    return None


def replicas(rec: A.RecordingSet) -> tuple[int, str]:
    """W, the count a data-parallel normalisation divides by, and its words: a plain data-parallel run's
    ranks; under a layout with a model-parallel dimension (TP, 2-D) or a pipeline, its data-parallel
    replicas (the layout's groups), the ranks of each named."""
    lay = rec.recorded.layout or {}
    if not lay.get("groups"):
        world = rec.world_at(rec.steps[0])
        return world, f"W = {world} ranks"
    n, size = len(lay["groups"]), max(len(g) for g in lay["groups"])
    each = (f"{size} pipeline stages" if lay.get("pipeline") else
            f"{size} context-parallel ranks" if lay.get("context_parallel") else f"{size} model-parallel ranks")
    return n, f"W = {n} data-parallel replica(s) of {each}"


def rank_mean_words(rec: A.RecordingSet) -> str:
    """The alternative weighting "each data-parallel unit normalised by its own count", in the run's terms."""
    return ("the mean of the data-parallel replicas' own token means" if replicas(rec)[0] < rec.world_at(rec.steps[0])
            else "the mean of the ranks' own token means")


def factor_words(rec: A.RecordingSet, c: float, micro: int, rtol: float) -> str | None:
    """factor_name over W = the data-parallel replicas (replicas), then the TP (or CP) size where the
    layout has a model-parallel (or context-parallel) dimension and c is it or its reciprocal."""
    lay = rec.recorded.layout or {}
    tp = max((len(g) for g in lay.get("groups", [])), default=1) if not lay.get("pipeline") else 1
    w = replicas(rec)[0]
    names = [n for n in (factor_name(c, w, micro, rtol) or "").split(" = ") if n and (w > 1 or "W" not in n)]
    group = "CP" if lay.get("context_parallel") else "TP"
    names += [f"the {group} size {tp}"] if tp > 1 and abs(c / tp - 1) <= rtol else []
    names += [f"1 / the {group} size {tp}"] if tp > 1 and abs(c * tp - 1) <= rtol else []
    names += [clip_words] if (clip_words := _clipped_by(rec, c)) else []
    return " = ".join(names) or None


def _clipped_by(rec: A.RecordingSet, c: float) -> str | None:
    """A constant factor c < 1 where the declared max_grad_norm clipped every step: the loop may have clipped
    by c x that threshold (the same factor at every clipped step), named beside the sizes c equals."""
    mgn = float(rec.spec.max_grad_norm or 0)
    coefs = [rec.step_meta(0, k).get("clip_coef") for k in rec.steps]
    if not (mgn > 0 and 0 < c < 1 and coefs and all(x is not None and x < 1 for x in coefs)):
        return None
    return f"a clip at max_grad_norm {c * mgn:.6g} where {mgn:g} is declared (every step clipped)"


def made_up_gradient(rec: A.RecordingSet, ref: ReferenceSet):
    """Where one process gives an element an exactly zero gradient every way
    it computes it, micro-batch by micro-batch (sum_r |g_r| = 0, the
    reference's A.WIRE_ABS) and the step's rows merged (A.GRAD_MERGED): an embedding row of
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
        wa, gm = ref.tensors(k, A.WIRE_ABS), ref.tensors(k, A.GRAD_MERGED)
        if not wa or not gm:
            continue
        g = fleet_grad(rec, k)
        g_ref = ref.tensors(k, A.GRAD)
        for n in sorted(set(g) & set(wa) & set(gm) & set(g_ref)):
            mask = (wa[n] == 0) & (gm[n] == 0)
            stray = int((g[n][mask].abs() > ZERO_RTOL * float(g_ref[n].abs().max())).sum())
            if stray:
                return k, n, stray
            zeros += int(mask.sum())
    return zeros
