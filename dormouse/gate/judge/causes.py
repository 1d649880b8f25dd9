"""Causes of a wrong gradient the judge can name from numbers alone (issue 27).
Pure functions of per-step figures (no files read here): facts/gradient.py
and facts/loss.py gather the figures from a recording and its reference and words the verdict.

A scalar per step. A loop that divides the step's loss sum by a wrong count
N' computes g_fleet = (N / N') g, the one-process gradient g (a token mean
over N targets) times c = N / N', a scalar that changes from step to step as
the batches do. Fitted per step (c = <g_fleet, g> / <g, g>) and exact (the
residual ||g_fleet - c g|| / ||c g|| within the gradient's bound at every
step), it implies the count the loop divided by, N' = N / c, and that count
names the bug when it equals one the recording knows (KNOWN_COUNTS, every
step within the fit's tolerance):

  padding       every label position after the shift, padding included
                (rows x (T - 1) per micro-batch): padding counted as tokens
  unshifted     the targets before the shift (labels != -100 over all T
                positions: one extra target per row)
  every_pos     every position (rows x T): padding and the shift both
  rank r        W x rank r's own target count, used by every rank (one
                rank's count broadcast)
  short step    a step of K_k < K micro-batches still divided by K: c = K_k / K
                (N' = N K / K_k), 1 at the full steps
and, where none is, the step before's targets (previous_count: N'_k = N_{k-1} at
every step whose step before was fitted): the previous step's count kept.

The last micro-batch weighted apart. A loop whose last micro-batch of each
rank (where gradient accumulation syncs, and where `if last:` branches live)
is normalised apart from the others computes g_fleet = a (g - L) + c L, L the
last micro-batches' share of the one-process gradient g. Fitted per step
(last_micro_fit: least squares in a and b = c - a, exact when the residual is
within the gradient's bound at every step), the ratio c / a per step and the
count the last micro-batch's loss sum was divided by (N / c) name it
(describe_last): 1/K the loss divided by K twice on the last micro-batch, 0 its
loss never backpropagated, K its division by K skipped.

Other named patterns, each a pure test below:
  never_reduced  the ranks' gradients differ (DDP all-reduces them equal) and
                 their mean is one process's gradient: no_sync on every
                 micro-batch, the gradients never all-reduced
  tensor_factor  some tensors' gradient alone is one process's times one
                 constant c at every step, every other tensor agreeing: a
                 scale or a reduction applied to those tensors apart (a tied
                 weight's copies, a router's gradient, x 0.5 = 1/W)
  clipped_apart  a rank's gradient of some tensors is another rank's over the
                 clip coefficient, where the two must agree: the loop clipped
                 those tensors on one rank only (DeepSpeed #1801: a replicated
                 LayerNorm clipped on one TP rank), and the replicas step apart
  stale_gradient at every failing step, the tensors that differ hold one
                 process's gradient plus the gradient the loop applied at the
                 step before (every other tensor agrees): the gradients were
                 not zeroed between steps (on every rank, or on one stage)
  bf16_wire      every element of the fleet's gradient is a bfloat16 value
                 (its float32 bits end in 16 zeros) where one process's is not:
                 a gradient all-reduced in bfloat16 (a bf16 compress hook)
"""

from __future__ import annotations

import math

import torch

from dormouse.gate import artifacts as A

SHOWN_STEPS = 4  # per-step figures shown in a reason (the rest summarised)


def targets_of(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """A micro-batch's targets as the built-in objectives read them: the
    labels given to rec.labels, else its "labels"; without them its input_ids
    (or arg0) with -100 where attention_mask is 0; None when it has neither."""
    for key in (A.LOSS_LABELS, "labels"):
        if key in batch:
            return batch[key]
    ids = batch.get("input_ids", batch.get("arg0"))
    if ids is None:
        return None
    mask = batch.get("attention_mask")
    return ids.masked_fill(mask == 0, -100) if mask is not None and mask.shape == ids.shape else ids


def step_counts(batches: list[tuple[int, torch.Tensor]], world: int, micro: int, micro_max: int,
                shift: int = 1) -> dict[str, float] | None:
    """The counts a loop may have divided step k's loss sum by, from the
    step's (rank, targets) of every micro-batch (targets [rows, T]): the
    targets after the shift ("targets", the one-process count), and
    KNOWN_COUNTS' others. None when the targets are not [rows, T]."""
    if not batches or any(y is None or y.dim() != 2 for _, y in batches):
        return None
    out = {"targets": 0.0, "padding": 0.0, "unshifted": 0.0, "every_pos": 0.0}
    per_rank = [0.0] * world
    for r, y in batches:
        rows, t = y.shape
        n = float((y[:, shift:] != -100).sum())
        out["targets"] += n
        out["padding"] += rows * max(t - shift, 0)
        out["unshifted"] += float((y != -100).sum())
        out["every_pos"] += rows * t
        if 0 <= r < world:
            per_rank[r] += n
    for r, n in enumerate(per_rank):
        out[f"rank {r}"] = world * n
    if micro < micro_max:
        out["short step"] = out["targets"] * micro_max / micro
    return out


WORDS = {"padding": "every label position after the shift, padding counted as tokens",
         "unshifted": "the targets before the shift (labels != -100 over every position: one extra target per row)",
         "every_pos": "every position, padding and the shift both counted",
         "short step": "the full step's micro-batch count K at a step of fewer micro-batches (a short last step "
                       "still divided by K)"}


def _words(name: str) -> str:
    if name.startswith("rank "):
        return (f"{name}'s own target count times W, used by every rank (one rank's count broadcast, not the "
                "global one all-reduced)")
    return WORDS[name]


def name_count(implied: list[float], counts: list[dict[str, float]], rtol: float) -> str | None:
    """The KNOWN_COUNTS candidate the implied counts equal at every step
    (within rtol, the tolerance a fitted factor is named within; a "short
    step" candidate counts only at the steps it exists, the targets at the
    others), or None."""
    tol = rtol
    names = {n for c in counts for n in c if n != "targets"}
    for name in sorted(names, key=lambda n: (n.startswith("rank "), n)):
        hits = [c.get(name, c["targets"] if name == "short step" else math.nan) for c in counts]
        if name == "short step" and all(name not in c for c in counts):
            continue
        if all(math.isfinite(h) and h > 0 and abs(i / h - 1) <= tol for i, h in zip(implied, hits)):
            return name
    return None


def per_step_scalar(fits: list[tuple[int, float, float]], bound: float, away: float) -> bool:
    """Whether (step, c, residual) fits say "one process's gradient times a
    scalar at each step": every residual within `bound` and some c clearly
    away from 1 (|c - 1| > away)."""
    return bool(fits) and all(math.isfinite(c) and r <= bound for _, c, r in fits) and \
        any(abs(c - 1) > away for _, c, _ in fits)


def clip_norm_of(fits: list[tuple[int, float, float]], norms: list[float] | None, rtol: float) -> float | None:
    """The max_grad_norm C where the per-step scalars are exactly clip coefficients of one process's
    gradient norms: c = C / ||g|| at every step whose scalar is below 1 (one C for all of them), c = 1
    where ||g|| <= C; else None. A loop that clipped before rec.step and did not pass grad_norm leaves
    the recorded gradient clipped while the Recorder takes it for the unclipped one."""
    if not norms or len(norms) != len(fits) or any(n is None for n in norms) or \
            not any(c < 1 - rtol for _, c, _ in fits):
        return None
    if any(c > 1 + rtol or not n > 0 for (_, c, _), n in zip(fits, norms)):
        return None
    cs = [c * n for (_, c, _), n in zip(fits, norms) if c < 1 - rtol]
    C = cs[0]
    if any(abs(x / C - 1) > rtol for x in cs):
        return None
    if any(n > C * (1 + rtol) for (_, c, _), n in zip(fits, norms) if abs(c - 1) <= rtol):
        return None  # a step the clip would have cut, left whole
    return C


def previous_count(fits: list[tuple[int, float, float]], implied: list[float], counts: list[dict[str, float]],
                   rtol: float) -> str | None:
    """The words when each step's implied count is the targets of the step before (within rtol, at every
    fitted step whose step before was fitted too, at least one of them with a count of its own other
    than the step before's): the loop divided by the previous step's global count (kept from the step
    before, or counted before the step's batches were read); None otherwise."""
    at = {k: i for i, (k, _, _) in enumerate(fits)}
    pairs = [(k, i, at[k - 1]) for k, i in at.items() if k - 1 in at]
    if not pairs or not all(counts[j]["targets"] > 0 and abs(implied[i] / counts[j]["targets"] - 1) <= rtol
                            for _, i, j in pairs):
        return None
    if not any(abs(counts[i]["targets"] / counts[j]["targets"] - 1) > rtol for _, i, j in pairs):
        return None  # the counts do not change from step to step: nothing tells the previous one apart
    k, i, j = next(p for p in pairs if abs(counts[p[1]]["targets"] / counts[p[2]]["targets"] - 1) > rtol)
    first = [(k0, i0) for k0, i0 in at.items() if k0 - 1 not in at]
    own = [f"step {k0}'s {implied[i0]:.6g}" + (" is its own: there is no step before it"
                                               if abs(implied[i0] / counts[i0]["targets"] - 1) <= rtol else "")
           for k0, i0 in first[:2]]
    return (f": each is the target count of the step before (step {k}'s {implied[i]:.6g} is step {k - 1}'s "
            f"{counts[j]['targets']:g} targets, where step {k} holds {counts[i]['targets']:g}; {', '.join(own)}): "
            "the loop divided by the previous step's token count (the global count kept from the step before, or "
            "counted before this step's batches were read); divide each step's loss sum by its own batches' "
            "count, all-reduced")


def describe_scalars(fits: list[tuple[int, float, float]], counts: list[dict[str, float]] | None,
                     rtol: float, norms: list[float] | None = None, declared: float | None = None) -> str:
    """The sentence for an exact per-step scalar: the scalars, the counts they
    imply against the steps' target counts, and the known count that matches;
    or, where the scalars are clip coefficients of one process's gradient norms
    (`norms`, one a fitted step), the grad_norm the loop did not pass, or (`declared`: the
    max_grad_norm of a loop that did pass its norm) the threshold it clipped by instead."""
    show = fits[:SHOWN_STEPS]
    more = f", ... ({len(fits)} steps)" if len(fits) > SHOWN_STEPS else ""
    scal = ", ".join(f"{c:.4g}" for _, c, _ in show)
    steps = ", ".join(str(k) for k, _, _ in show)
    words = (f"the fleet's gradient is one process's times a scalar that changes from step to step, exact at each "
             f"(residual within the bound): {scal}{more} at steps {steps}")
    clip = clip_norm_of(fits, norms, rtol)
    if clip is not None and declared is not None:
        return words + (f"; each scalar is min(1, {clip:.6g} / ||g||), one process's gradient norm at that step: the "
                        f"loop clipped by a max_grad_norm of {clip:.6g}, not the declared {declared:g} (it passed "
                        "its gradient norm to rec.step): clip by the declared threshold, or declare the one the "
                        f"loop clips by, RecordingSpec(max_grad_norm={clip:.6g})")
    if clip is not None:
        return words + (f"; each scalar is min(1, {clip:.6g} / ||g||), one process's gradient norm at that step: the "
                        f"clip coefficients of a max_grad_norm of {clip:.6g}. The loop clipped before rec.step() "
                        "without telling the Recorder: pass the norm clip_grad_norm_ returned, "
                        "rec.step(grad_norm=norm), and RecordingSpec(max_grad_norm=...), so that the recorded gradient "
                        "is read as clipped")
    if not counts:
        return words
    implied = [cnt["targets"] / c for (_, c, _), cnt in zip(fits, counts)]
    imp = ", ".join(f"{x:.6g}" for x in implied[:SHOWN_STEPS])
    tgt = ", ".join(f"{cnt['targets']:g}" for cnt in counts[:SHOWN_STEPS])
    words += (f"; the loop divided each step's loss sum by {imp}{more} where the steps hold {tgt} targets "
              "(implied count = targets / scalar)")
    named = name_count(implied, counts, rtol)
    if named:
        return words + f": that is {_words(named)}"
    stale = previous_count(fits, implied, counts, rtol)
    if stale:
        return words + stale
    known = ", ".join(sorted(n for n in counts[0] if n != "targets"))
    return words + f"; none of the counts the recording knows matches ({known})"


def last_micro_fit(gf: dict[str, torch.Tensor], g: dict[str, torch.Tensor], last: dict[str, torch.Tensor],
                   names: list[str]) -> tuple[float, float, float]:
    """g_fleet fitted as a g + b L (L the ranks' last micro-batches' share of
    g): (a, c / a with c = a + b the last micro-batches' weight, the residual
    ||g_fleet - a g - b L|| / ||g_fleet||); nan, nan, inf where L and g are
    parallel (one micro-batch) or a is 0."""
    names = [n for n in names if n in last]

    def dot(x, y):
        return sum(float((x[n].double() * y[n].double()).sum()) for n in names)
    gg, gl, ll, fg, fl = dot(g, g), dot(g, last), dot(last, last), dot(gf, g), dot(gf, last)
    det = gg * ll - gl * gl
    if not names or not det > 1e-9 * gg * ll:
        return math.nan, math.nan, math.inf
    a, b = (fg * ll - fl * gl) / det, (gg * fl - gl * fg) / det
    res = sum(float(((gf[n].double() - a * g[n].double() - b * last[n].double()) ** 2).sum()) for n in names)
    ff = dot(gf, gf)
    if a == 0 or ff <= 0:
        return math.nan, math.nan, math.inf
    return a, (a + b) / a, math.sqrt(res / ff)


def last_micro_weighted(fits: list[tuple[int, float, float, float]], bound: float, away: float) -> bool:
    """Whether (step, a, ratio, residual) fits say "the last micro-batches
    weighted apart": every residual within `bound`, some ratio away from 1."""
    return bool(fits) and all(math.isfinite(x) and r <= bound for _, a, x, r in fits) and \
        any(abs(x - 1) > away for _, _, x, _ in fits)


def describe_last(fits: list[tuple[int, float, float, float]], micros: list[int],
                  counts: list[dict[str, float]] | None, rtol: float) -> str:
    """The sentence for the last micro-batches weighted apart: the per-step
    ratio, the count the last micro-batch's loss sum was divided by against
    the step's targets, and the name where every step agrees on one."""
    show = fits[:SHOWN_STEPS]
    more = f", ... ({len(fits)} steps)" if len(fits) > SHOWN_STEPS else ""
    steps = ", ".join(str(k) for k, *_ in show)
    words = (f"the fleet's gradient weights each rank's last micro-batch {', '.join(f'{x:.4g}' for _, _, x, _ in show)}"
             f"{more} times the other micro-batches at steps {steps} (exact at each: the residual within the bound)")
    if counts and all(abs(x) > rtol for _, _, x, _ in fits):
        own = ", ".join(f"{cnt['targets'] / (a * x):.6g}" for (_, a, x, _), cnt in zip(show, counts))
        tgt = ", ".join(f"{cnt['targets']:g}" for cnt in counts[:SHOWN_STEPS])
        words += f"; its loss sum was divided by {own}{more} where the steps hold {tgt} targets"
    others = [a for _, a, _, _ in fits]
    if any(abs(a - 1) > rtol for a in others):
        words += f"; the other micro-batches times {', '.join(f'{a:.4g}' for a in others[:SHOWN_STEPS])}"
    ratios = [x for _, _, x, _ in fits]
    if all(abs(x * K - 1) <= rtol for x, K in zip(ratios, micros)):
        return words + (f": the loss divided by K twice on the last micro-batch (K = {micros[0]} micro-batches: its "
                        "normalisation, then the accumulation's 1/K once more)")
    if all(abs(x) <= rtol for x in ratios):
        return words + ": the last micro-batch's loss was never backpropagated (forwarded, its backward lost)"
    if all(abs(x / K - 1) <= rtol for x, K in zip(ratios, micros)):
        return words + f": the last micro-batch's loss not divided by K = {micros[0]} where the others are"
    return words


def never_reduced(rank_grads: list[dict[str, torch.Tensor]], g_ref: dict[str, torch.Tensor],
                  rel, bound: float) -> tuple[float, float] | None:
    """Where the ranks' gradients differ from each other (beyond `bound`) and
    their mean equals one process's gradient (within `bound`): (how far rank
    1 is from rank 0, how far the mean is from one process's); else None.
    `rel(a, b, names)` is the judge's relative difference."""
    if len(rank_grads) < 2:
        return None
    names = sorted(set(g_ref).intersection(*rank_grads))
    if not names:
        return None
    apart = max(rel(g, rank_grads[0], names) for g in rank_grads[1:])
    if not apart > bound:
        return None
    mean = {n: sum(g[n].double() for g in rank_grads) / len(rank_grads) for n in names}
    off = rel(mean, g_ref, names)
    return (apart, off) if off <= bound else None


def stale_gradient(prev: dict[str, torch.Tensor], g: dict[str, torch.Tensor], g_ref: dict[str, torch.Tensor],
                   rel, fit, bound: float) -> tuple[list[str], float] | None:
    """(the tensors whose gradient `g` differs from one process's `g_ref`
    beyond `bound`, c) when that difference is c times `prev`, the gradient
    the loop applied at the step before (the residual within `bound`; c = 1
    for a plain loop, 1/K where a pipeline schedule's scale_grads divides
    what was left too); None otherwise. `rel(a, b, names)` and `fit(a, b,
    names)` are the judge's relative difference and fitted constant."""
    names = sorted(set(g) & set(g_ref))
    off = [n for n in names if rel(g, g_ref, [n]) > bound]
    if not off or any(n not in prev for n in off):
        return None
    c, res = fit({n: g[n].double() - g_ref[n].double() for n in off}, prev, off)
    return (off, c) if res <= bound and c > bound else None


def tensor_factor(steps: list[dict[str, tuple[float, float, float]]], bound: float,
                  rtol: float) -> tuple[float, list[str]] | None:
    """(c, the tensors) where at every step some tensors' gradient alone is one process's times one
    constant c (each tensor's fit within `rtol`, c clearly away from 1), and every other tensor, taken
    together, agrees within `bound`; None otherwise. steps: per step, metrics.parts(g_fleet, g_ref) per
    tensor, (||a - b||^2, ||b||^2, a.b)."""
    cs, names = [], set()
    for p in steps:
        off = {}
        for n, (dd, bb, ab) in p.items():
            if bb <= 0 or math.sqrt(dd / bb) <= bound:
                continue
            c = ab / bb
            resid = math.sqrt(max(dd + 2 * ab - bb - ab * ab / bb, 0.0) / bb) / abs(c) if c else math.inf
            if resid > rtol:  # not a factor of this tensor's gradient
                return None
            off[n] = c
        rest = [n for n in p if n not in off]
        if not off or not rest or math.sqrt(sum(p[n][0] for n in rest) / max(sum(p[n][1] for n in rest), 1e-300)) \
                > bound:
            return None
        cs += off.values()
        names |= set(off)
    if not cs or max(cs) - min(cs) > rtol * abs(cs[0]) or abs(cs[0] - 1) <= rtol:
        return None
    return sum(cs) / len(cs), sorted(names)


def clipped_apart(first: dict[str, torch.Tensor], other: dict[str, torch.Tensor], coef: float,
                  rel, bound: float) -> tuple[list[str], bool] | None:
    """(the tensors, whether `other` is the unclipped one) where two ranks' gradients that must agree
    differ, and one is the other over the clip coefficient `coef` < 1 (within `bound`, by `rel(a, b,
    names)`): clipped on one rank and not the other; None where none differs so or coef is not below 1."""
    if not coef < 1:
        return None
    names = [n for n in sorted(set(first) & set(other))
             if first[n].shape == other[n].shape and not torch.equal(first[n], other[n])]
    up = [n for n in names if rel({n: other[n].double()}, {n: first[n].double() / coef}, [n]) <= bound]
    down = [n for n in names if rel({n: other[n].double()}, {n: first[n].double() * coef}, [n]) <= bound]
    if up or down:
        return (up, True) if len(up) >= len(down) else (down, False)
    return None


def bf16_representable(g: dict[str, torch.Tensor]) -> bool:
    """Every element of every float32 tensor is a bfloat16 value (its low 16 bits zero)."""
    ts = [t for t in g.values() if t.dtype == torch.float32 and t.numel()]
    return bool(ts) and all(bool(((t.contiguous().view(torch.int32) & 0xFFFF) == 0).all()) for t in ts)
