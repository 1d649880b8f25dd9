"""The causes the replay names (facts/replay.py words them into its line).

  scheduler step  a loop's lr that is the one its scheduler gives at another step (the reference's
                  "schedule_lr": the scheduler's lr at every step from the first, and beyond the last):
                  a constant number of steps ahead from some step on (stepped once more, on one rank or
                  all), or a steps per optimizer step (stepped twice a step, or once per micro-batch)
  rank lr         a rank whose recorded lr is not the scheduler's where rank 0's is (its own optimizer,
                  or its own scheduler stepped apart): the rank and the tensors it holds named
  twice           the recorded update is the user's optimizer stepped twice on the step's gradients,
                  bitwise (the reference's "replay_alternatives": an optimizer.step() with no backward
                  between, on the same gradients)
  unclipped       ... is the step on the unclipped gradient, bitwise, where the gradient's global norm
                  exceeds the declared max_grad_norm: the declared clip never applied
  lr ratio        the recorded update of every tensor, or of some tensors alone (every other tensor's
                  the replay's), is the replay's times one constant c, exact to the parameters' float32
                  rounding: the optimizer's step is linear in its lr (SGD, Adam, AdamW and its
                  decoupled weight decay), so those tensors stepped with c x the scheduler's lr
"""

from __future__ import annotations

import math

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.bounds import FP32_UNIT_ROUNDOFF, LR_RATIO_RTOL, LR_RTOL

SHOWN = 4


def _same(a: float, b: float, rtol: float = LR_RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


def schedule_step(ref: ReferenceSet, steps: list[int], lr: float, rtol: float = LR_RTOL) -> int | None:
    """The one step whose scheduler lr is `lr` within rtol (the reference's schedule_lr, its first entry
    the recording's first step); None where none is, or several are (a constant stretch of the schedule)."""
    table = ref.meta.get("schedule_lr") or []
    hits = [i for i, x in enumerate(table) if _same(x, lr, rtol)]
    return steps[0] + hits[0] if len(hits) == 1 else None


def scheduler_words(rec: A.RecordingSet, ref: ReferenceSet, rank: int) -> str:
    """Where every step's lr on `rank` is the scheduler's at one step each, those steps' pattern in words
    ("" where some lr is none of the schedule's, or no pattern holds)."""
    steps = rec.steps
    pairs = []
    for k in steps:
        lr = rec.step_meta(rank, k).get("lr")
        j = schedule_step(ref, steps, lr) if lr is not None else None
        if j is None:
            return ""
        pairs.append((k, j))
    off = [(k, j) for k, j in pairs if j != k]
    if not off:
        return ""
    more = ", ..." if len(off) > SHOWN else ""
    shown = (f"at step(s) {', '.join(str(k) for k, _ in off[:SHOWN])}{more} the lr its scheduler gives at step(s) "
             f"{', '.join(str(j) for _, j in off[:SHOWN])}{more}")
    d = {j - k for k, j in off}
    if len(d) == 1 and off == pairs[pairs.index(off[0]):] and (ahead := d.pop()) != 0:
        how = (f"{ahead} step(s) ahead from step {off[0][0]} on: the scheduler was stepped {ahead} more time(s) than "
               f"the optimizer before step {off[0][0]}" if ahead > 0 else
               f"{-ahead} step(s) behind from step {off[0][0]} on: the scheduler skipped {-ahead} step(s)")
        return f" ({shown}): {how}"
    s0 = steps[0]
    a = (pairs[1][1] - pairs[0][1]) // max(pairs[1][0] - pairs[0][0], 1) if len(pairs) > 1 else 0
    b = pairs[0][1] - s0
    if a >= 2 and all(j - s0 == a * (k - s0) + b for k, j in pairs):
        how = f"the scheduler was stepped {a} times per optimizer step"
        if b:
            how += (f", {b} of them before the first step's optimizer step (once per micro-batch, or before "
                    "optimizer.step()?)")
        return f" ({shown}): {how}: step it once per optimizer step, after it"
    return f" ({shown})"


def rank_tensors(rec: A.RecordingSet, rank: int, k: int) -> str:
    names = sorted(A.prefixed(A.PARAM, rec.step_tensors(rank, k)))
    return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" if names else "no parameter"


def rank_lr(rec: A.RecordingSet, ref: ReferenceSet) -> str | None:
    """The first (step, rank > 0) whose recorded lr is not the scheduler's where rank 0's is, in words."""
    for k in rec.steps:
        want = ref.step(k)[0].get("replay_lr")
        lr0 = rec.step_meta(0, k).get("lr")
        if want is None or lr0 is None or not _same(lr0, want):
            continue
        for r in range(1, rec.world_at(k)):
            lr = rec.step_meta(r, k).get("lr")
            if lr is None or _same(lr, want):
                continue
            named = scheduler_words(rec, ref, r)
            if not named:
                named = f" ({lr / want:.6g} x the scheduler's)" if want else ""
            stage = (((rec.recorded.layout or {}).get("pipeline") or {}).get("stage_of_rank") or [])[r:r + 1]
            who = f"rank {r}" + (f", pipeline stage {stage[0]}," if stage else "")
            return (f"rank {r}'s lr at step {k} is {lr:.6g} where its scheduler, replayed, gives {want:.6g}, as rank "
                    f"0's is{named}; {who} steps its parameters ({rank_tensors(rec, r, k)}) with its own lr: every "
                    "rank's optimizer and scheduler must be stepped alike")
    return None


def _tensor_ratios(before, after, replayed) -> dict[str, tuple[float, bool]]:
    """{tensor: (c, exact)} for each tensor the replay moved: the recorded update fitted as c x the replay's,
    exact where the residual is within the float32 rounding of the parameters' two values; empty where the
    fleet moved a tensor the replay did not (no ratio says that)."""
    out = {}
    for n in sorted(replayed):
        if n not in before or n not in after or before[n].shape != replayed[n].shape:
            continue
        p0, p1, r1 = before[n].double(), after[n].double(), replayed[n].double()
        u, v = p1 - p0, r1 - p0
        vv = float((v * v).sum())
        if vv == 0:
            if bool((u != 0).any()):
                return {}
            continue
        c = float((u * v).sum()) / vv
        res = float((u - c * v).norm())
        tol = 4 * (1 + abs(c)) * FP32_UNIT_ROUNDOFF * max(float(p0.norm()), float(p1.norm()), float(r1.norm()))
        out[n] = (c, res <= tol)
    return out


def ratio_words(rec: A.RecordingSet, ref: ReferenceSet, u: int, after, replayed) -> str:
    """The update at step u as the replay's times one constant c, on every tensor or on some alone."""
    ratios = _tensor_ratios(rec.tensors_at(u, A.PARAM), after, replayed)
    if not ratios or not all(e for _, e in ratios.values()):
        return ""
    apart = {n: c for n, (c, _) in ratios.items() if abs(c - 1) > LR_RATIO_RTOL}
    if not apart:
        return ""
    c = sorted(apart.values())[len(apart) // 2]
    if c == 0:
        return _unmoved_words(u, sorted(n for n, x in apart.items() if x == 0), len(ratios))
    if any(abs(x / c - 1) > LR_RATIO_RTOL for x in apart.values()):
        return ""
    lr = ref.step(u)[0].get("replay_lr")
    j = schedule_step(ref, rec.steps, c * lr, LR_RATIO_RTOL) if lr else None
    lr_words = (f"an lr {c:.6g} x the scheduler's {lr:.6g}" + (f", the lr the scheduler gives at step {j}"
                                                                 if j is not None and j != u else ""))
    if len(apart) == len(ratios):
        return (f": every tensor's update at step {u} is the replay's times {c:.6g}, exactly ({lr_words}): the "
                f"optimizer stepped with another lr than the one recorded at rec.step()" +
                (" (the scheduler stepped before optimizer.step())" if j == u + 1 else ""))
    names = sorted(apart)
    holders = [r for r in range(rec.world_at(u))
               if set(names) == set(A.prefixed(A.PARAM, rec.step_tensors(r, u))) & set(ratios)]
    who = f" (every tensor rank {holders[0]} holds)" if holders else ""
    return (f": the update at step {u} of {len(names)} tensor(s) ({', '.join(names[:SHOWN])}"
            f"{', ...' if len(names) > SHOWN else ''}){who} is the replay's times {c:.6g}, exactly, every other "
            f"tensor's the replay's ({lr_words} on those tensors alone): the optimizer (or the param group, or the "
            "rank) stepping them has another lr")


def _unmoved_words(u: int, names: list[str], moved_by_replay: int) -> str:
    """Tensors the replay moves and the recorded step left exactly where they were."""
    shown = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    if len(names) == moved_by_replay:
        what, held, some = f"no tensor moved where the replay's optimizer moves every one ({shown})", \
            "the model's parameters", ""
    else:
        what, held = f"{len(names)} tensor(s) the replay's optimizer moves stayed exactly where they were ({shown})", \
            "those parameters"
        some = "an optimizer built over some of the parameters alone (a param group left out), or "
    return (f": at step {u} {what}: the optimizer the loop steps does not hold {held} ({some}an optimizer built "
            "over another instance or a copy of the model, or before the model was moved or wrapped into new "
            "tensors), or their gradients never reached it; build the optimizer over the parameters the loop trains")


def update_words(rec: A.RecordingSet, ref: ReferenceSet, u: int, after, replayed) -> str:
    """What the recorded update at step u is, where the replay's is not ("" where nothing is named)."""
    info = ref.info(u)
    alt = info.get("replay_alternatives") or {}
    if alt.get("twice") == 0:
        return (f": the recorded update equals the replay's optimizer stepped twice on step {u}'s gradients, bitwise "
                "(two optimizer steps in one: an optimizer.step() with no backward between, on the same gradients); "
                "step the optimizer once per step")
    mgn = float(rec.spec.max_grad_norm)
    if alt.get("unclipped") == 0:
        return f": {unclipped_words(mgn, u, info.get('replay_grad_norm'))}"
    return ratio_words(rec, ref, u, after, replayed)


def unclipped_words(mgn: float, u: int, norm: float | None) -> str:
    shown = f" (its global norm {norm:.6g} exceeds it)" if norm is not None and math.isfinite(norm) else ""
    return (f"the declared max_grad_norm {mgn:g} was not applied: the update at step {u} equals the unclipped "
            f"gradient's{shown}, bitwise: clip by it before optimizer.step() (and pass the norm to "
            "rec.step(grad_norm=...)), or declare the max_grad_norm the loop clips by (0: none)")


def unclipped_step(rec: A.RecordingSet, ref: ReferenceSet) -> str | None:
    """The clip line's words where the replay found the declared clip never applied (None otherwise)."""
    mgn = float(rec.spec.max_grad_norm)
    for k in rec.steps:
        info = ref.info(k)
        if (info.get("replay_alternatives") or {}).get("unclipped") == 0:
            return unclipped_words(mgn, k, info.get("replay_grad_norm"))
    return None

