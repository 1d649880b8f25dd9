"""Every tolerance of the judge, in one table: each bound with the reason it
has the value it has. A check imports its bound from here; no other module
types a tolerance. The floors the bounds multiply are measured per run by the
references (one-ulp nudges, the precision floor): never by a run that shares
the code under test (docs/gate.md, "The checks", says how each was measured).

| bound | value | holds | why this value |
|---|---|---|---|
| grad_rtol(step) | (WK + 1) u A + L u sqrt(R); L = LAMBDA where products are split across ranks, sqrt(1 + LAMBDA sqrt(2 / n)) over n elements under data parallelism | a float32 step's gradient against the NEARER of its two one-process forms (L2, all tensors): g, each micro-batch's loss sum differentiated then / N, and gn, each micro-batch's loss sum / N x W differentiated (HF's Trainer, DDP loops), then / W | derived: the fleet adds W x K float32 partial gradients (each element within gamma_{WK-1} sum_rm abs(G_rm), so in L2 within (WK - 1) u A, A = sum_rm norm(G_rm) / norm(sum_rm G_rm), the reference's "partials"), plus the seed and the / W (2u); a micro-batch's own backward, recomputed by other kernels or threads, within LAMBDA u sqrt(R) (R the longest dot product of the backward: the micro-batch's tokens or the widest parameter dimension, the reference's "dot_length"; mean-zero rounding, Higham and Mary 2019). Where the arithmetic is unknown (an objective over the whole step) GRAD_RTOL |
| LAMBDA | sqrt(2 ln(2 / 1e-6)) = 5.39 | grad_rtol's kernel term: a sum of mean-zero roundings beyond LAMBDA standard bounds | probability <= 1e-6 (Higham and Mary 2019, Theorem 2.4) |
| NORM_DELTA | 1e-6 | the probability that the Hoeffding part of norm_rtol fails, per tensor | |
| NORM_LANES | 8 | the lanes of torch's float32 norm kernel norm_rtol assumes | 8 (AVX2, default) or 16 (AVX-512): fewer lanes round coarser, so 8 bounds both; CUDA's tree reduction rounds less |
| GRAD_RTOL | 1e-5 | the independence, loss and probe checks' float32 bound; the gradient's where grad_rtol's figures are absent | clean: <= 9.1e-7 (dormouse fleet, seeds 1-10), <= 1.4e-7 (DDP loop); a weighting fault is 1e-2 |
| INDEP_RTOL | 1e-5 | a recording's per-example gradients summed against their micro-batch's | clean <= 6e-8 |
| LOSS_RTOL | 1e-5 | a logged loss against the token-weighted mean of the reference's | clean <= 3e-8; a plain mean of two ranks' losses under 4x32,1x64 is 5.8e-4 |
| norm_rtol(g) + grad_rtol(step) | per step | a reported gradient norm / clip coefficient against the norm of the nearer one-process form | derived: torch's clip_grad_norm_ sums each tensor's squares in float32 (8 or more lanes, each sequential: numerics.sum_squares_roundoff bounds it on the gradient's own magnitudes: terms under an ulp of their lane's running sum deterministically, the rest by Hoeffding at NORM_DELTA), then the norm of the T norms (T + 4) u; the gradient's own bound moves its norm by at most as much. Off by more than FACTOR_AWAY x it: a local or partial norm; between: another arithmetic |
| FLOOR_MULTIPLE | 10 | a bound measured as a floor (one-ulp nudge spread, precision floor) is this many floors | clean runs sit at 0.9-1.6 floors |
| CURVE_MIN_RTOL | 1e-6 | the least curve tolerance (dormouse's single process at the global batch) | a few float32 ulps of the loss: the floor of the floor |
| RUN_MIN_RTOL | 1e-5 | the least per-tensor tolerance of a recording's one-process run (sketch / every-k) | each tensor's drift, not the loss: one float32 tensor's rounding over a few steps |
| FACTOR_RTOL | 1e-3 | a fitted constant within this of a named factor (W, K, 1/W, ...) is that factor | a wrong denominator is exact up to float32 sums |
| FACTOR_AWAY | 10 | a fitted constant is a factor only when abs(c - 1) > this x the gradient bound | within that of 1 the fleet is right, not off by a factor |
| PRECISION_CAP | 0.1 | past this a reduced-precision bound is not judged (the gradient check fails) | a doubled tensor could hide in round-off that large |
| BF16_MODEL_RTOL | 5e-2 | a bfloat16 model's first-step gradient against the single process's, and its eval loss (dormouse's own gate) | measured <= 2.0e-2 of a tensor's largest element; a weighting fault is 1e-1 |
| BIAS_SIGMAS | 6 | the bf16 wire's rounding bias: |S| above this many standard errors fails | a false alarm in ~1e9 per direction |
| BIAS_FLOOR | offset 2e-3, scale 1e-2, decay 2e-3 | ... when the mean scaled error is also above this | 12 clean bf16 fleets: scale -1e-4..-5e-4, offset/decay <= 2.5e-4 |
| ZERO_RTOL | 2^-24 | where one process's gradient is exactly zero every way it computes it, the fleet's within this of the tensor's largest element | float32's unit round-off of the largest summand: a zero in exact arithmetic only (a key bias softmax ignores) came out 6.5e-9 (0.11 of it) in a clean loop; 15 clean fleets of dormouse's trainer are exactly 0 there; a made-up fill at 2^-22 (2.4e-7), which AdamW turns into steps of ~lr on never-read embedding rows, fails |
| PROBE_RTOL | 1e-5 | the least bound a module's output (or output gradient) is held to in the probe | the gradient check's float32 bound; each module's own bound is FLOOR_MULTIPLE x its one-ulp floor |
| SKETCH_DELTA | 0.05 | the per-tensor, per-step failure probability a sketch's detection bound is stated at | |
| LR_RTOL | 1e-9 | a rank's recorded lr against the scheduler's (at its own step, or named as another step's) | python floats the same schedule computes alike: equal but for the last bits |
| LR_RATIO_RTOL | 1e-4 | the update ratios of tensors fitted against the replay's agree (one constant), and the lr one implies names a scheduler step, within this | a fitted ratio is exact to the float32 parameters' rounding over the update's size (~1e-5 at lr 1e-3); a step's lr named only where one step alone is that near |
"""

from __future__ import annotations

import math

from dormouse.numerics import BF16_UNIT_ROUNDOFF, FP32_UNIT_ROUNDOFF  # noqa: F401  (the bounds' units)

GRAD_RTOL = 1e-5
INDEP_RTOL = 1e-5
# The fleet's logged loss against the token-weighted mean of the reference's
# per-token losses at the same parameters (float32 slice means summed in
# float64, against a float64 mean of float32 per-token losses); eval losses alike.
LOSS_RTOL = 1e-5
# The probabilistic constant of grad_rtol's kernel term: a sum of mean-zero rounding errors exceeds LAMBDA
# standard bounds with probability <= 2 exp(-LAMBDA^2 / 2) = 1e-6 (Higham and Mary 2019, Theorem 2.4)
LAMBDA = math.sqrt(2 * math.log(2 / 1e-6))
NORM_DELTA = 1e-6  # the failure probability numerics.sum_squares_roundoff's bound is stated at, per tensor
NORM_LANES = 8  # torch's float32 norm kernel on the CPU: 8 lanes (AVX2 / default) or 16 (AVX-512): 8 bounds both
FLOOR_MULTIPLE = 10.0
CURVE_MIN_RTOL = 1e-6
RUN_MIN_RTOL = 1e-5
FACTOR_RTOL = 1e-3
FACTOR_AWAY = 10.0
PRECISION_CAP = 0.1
# A bfloat16 model (model.bf16) computes every gradient in bfloat16 arithmetic:
# the same gradient over another batch composition (a window alone, a rank's
# slice, the global batch) differs by bfloat16 round-off, measured <= 2.0e-2
# of the tensor's largest element (docs/gate.md, "A bfloat16 model").
BF16_MODEL_RTOL = 5e-2
# bf16 wire, bias: |S| above this many standard errors fails (S is a standard
# normal for unbiased rounding) when the mean scaled error is also above its
# floor. Round-to-nearest is unbiased for values uniform within an ulp;
# gradient magnitudes are closer to log-uniform, which pulls it towards zero
# by about h / (24 |x|) of the spacing h, ~2e-4 of the bound per rounding,
# along the scale direction. Measured on 12 clean bf16 fleets (1.6-3.2 M
# element-steps each): scale means -1e-4 .. -5e-4 of the bound (S down to
# -4.1), offset and decay |means| <= 2.5e-4 (|S| <= 2.1). Floors 20x and 8x that.
BIAS_SIGMAS = 6.0
BIAS_FLOOR = {"offset": 2e-3, "scale": 1e-2, "decay": 2e-3}
SKETCH_DELTA = 0.05
ZERO_RTOL = FP32_UNIT_ROUNDOFF
PROBE_RTOL = GRAD_RTOL
LR_RTOL = 1e-9
LR_RATIO_RTOL = 1e-4


def grad_rtol(info: dict) -> float:
    """The float32 gradient bound of one step, from the reference's figures of
    its arithmetic (see the table): (WK + 1) u A + L u sqrt(R), W x K =
    "sum_terms" partial gradients, A = "partials", R = "dot_length";
    GRAD_RTOL where the reference has no such figures.

    L, the kernel term's tail factor: LAMBDA where the fleet splits the
    model's products across ranks ("split_products": TP, 2-D, CP, EP, a
    pipeline, a declared sharding: other partial sums, each element's own
    error up to its tail); under data parallelism each micro-batch's backward
    is the reference's own arithmetic but for the seed's scale, one rounding
    apart, whose element errors e_i (E e_i^2 <= u^2 R g_i^2, Higham and Mary
    2019) enter the L2 norm as an average over n = "elements" of them: the
    relative error's square exceeds its mean u^2 R by LAMBDA sqrt(2 / n) of
    itself only with the probability LAMBDA states, L = sqrt(1 + LAMBDA
    sqrt(2 / n)) (1.0 at 1e8 elements). With LAMBDA there, the bound sat at
    1,000 x a clean DDP run's departure at a 32k-token vocabulary and let a
    one-step x1.00007 on one rank through."""
    terms, a, r = info.get("sum_terms"), info.get("partials"), info.get("dot_length")
    if not terms or a is None or not r:
        return GRAD_RTOL
    u = FP32_UNIT_ROUNDOFF
    n = max(int(info.get("elements") or 1), 1)
    tail = LAMBDA if info.get("split_products", True) else min(math.sqrt(1 + LAMBDA * math.sqrt(2 / n)), LAMBDA)
    return (terms + 1) * u * max(a, 1.0) + tail * u * math.sqrt(r)


def norm_rtol(tensors) -> float:
    """A relative bound on torch's float32 norm of a gradient (clip_grad_norm_:
    each tensor's sum of squares, numerics.sum_squares_roundoff with
    NORM_LANES lanes at NORM_DELTA, its square root, then the norm of the T
    norms: (T + 4) u of the total), halved from the sum of squares to its
    root, plus the last root's u. `tensors`: the gradient (name -> tensor)."""
    from dormouse.numerics import sum_squares_roundoff

    err, total, count = 0.0, 0.0, 0
    for v in tensors.values():
        e, s = sum_squares_roundoff(v, NORM_LANES, NORM_DELTA)
        err, total, count = err + e, total + s, count + 1
    if total <= 0:
        return 0.0
    u = FP32_UNIT_ROUNDOFF
    return 0.5 * (err / total + (count + 4) * u) + u


def norm_rtol_of_sizes(sizes) -> float:
    """norm_rtol without the tensors (a sketched recording): the worst case of
    the same arithmetic from the element counts alone, each lane's sequential
    sum within gamma_m of itself (m = ceil(n / NORM_LANES) + NORM_LANES)."""
    u = FP32_UNIT_ROUNDOFF
    worst = max((-(-int(n) // NORM_LANES) + NORM_LANES for n in sizes), default=1)
    return min(0.5 * (worst * u / (1 - worst * u) if worst * u < 1 else math.inf) + (len(sizes) + 5) * u, math.inf)


def floor_bound(floor: float, minimum: float, multiple: float = FLOOR_MULTIPLE) -> float:
    """THE rule for a bound measured as a floor: `multiple` floors, at least `minimum`."""
    return max(multiple * floor, minimum)


def arithmetic_rtol(config: dict, float32: float = GRAD_RTOL) -> float:
    """The gradient bound of a run's arithmetic: `float32`, or BF16_MODEL_RTOL
    when its (the settings') configuration trains a bfloat16 model."""
    return BF16_MODEL_RTOL if config.get("model", {}).get("bf16") else float32



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
