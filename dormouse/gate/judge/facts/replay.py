"""Fact 4: the same update.

Every recording (dormouse's own fleet's too: its routing bias is a declared buffer_update):

replay        fact 4: the user's optimizer and scheduler replayed in one process
              from the initial state on the recorded gradients give the recorded
              parameters BITWISE before every step and after the last, across
              resumes, and the recorded lr (every rank's); a resume that reset the
              scheduler is named, and a differing update or lr by what the
              numbers prove (replay_causes.py: two optimizer steps, the declared
              clip not applied, an lr c x the scheduler's on every tensor or on
              some, the scheduler's lr of another step, a rank's own lr).
              (Sketch / every-k recordings: the one-process run trained
              on the declared objective instead, within FLOOR_MULTIPLE x its
              own drift from a copy started one ulp away.)
buffers       (when the loop declared buffer_update: state outside the optimizer
              that moves by a rule of its own, dormouse's routing bias) the
              rule applied in one process at the recorded state before every
              step k to every rank's micro-batches of k gives the buffers
              recorded before k + 1 (after the last step: the final ones)
              BITWISE; the buffer and the rule are named.
"""

from __future__ import annotations

import math

import torch

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.facts import replay_causes as RC
from dormouse.gate.judge.bounds import (
    FLOOR_MULTIPLE,
    sketch_detection,
)
from dormouse.gate.judge.gradtools import param_tolerance, per_tensor
from dormouse.gate.judge.metrics import rel
from dormouse.gate.judge.verdict import Check


def first_unequal(a: dict, b: dict) -> tuple[str, float] | None:
    for n in sorted(b):
        if n not in a or a[n].shape != b[n].shape or not torch.equal(a[n].to(b[n].dtype), b[n]):
            return n, (rel({n: a[n]}, {n: b[n]}, [n]) if n in a and a[n].shape == b[n].shape else math.inf)
    return None



def check_replay(rec: A.RecordingSet, ref: ReferenceSet) -> Check:
    resumed = set(rec.resumed_at())
    steps = rec.steps
    # the lr the loop used against the uninterrupted scheduler's
    for k in steps:
        lr, want = rec.step_meta(0, k).get("lr"), ref.step(k)[0].get("replay_lr")
        if lr is not None and want is not None and abs(lr - want) > 1e-12 * max(abs(want), 1e-30):
            if k in resumed or any(s <= k for s in resumed):
                first = min(s for s in resumed if s <= k)
                lr0 = ref.step(steps[0])[0].get("replay_lr") if steps[0] == 1 else None
                if k == first and lr0 is not None and abs(lr - lr0) <= 1e-12 * max(abs(lr0), 1e-30):
                    # a fresh optimizer (its scheduler's state loaded or not) starts at its initial lr
                    # at the resume step itself; a dropped scheduler's state shows only a step later
                    nxt = [j for j in steps if j > k and j not in resumed][:1]
                    lr1, want1 = ((rec.step_meta(0, nxt[0]).get("lr"), ref.step(nxt[0])[0].get("replay_lr"))
                                  if nxt else (None, None))
                    if lr1 is not None and want1 is not None and abs(lr1 - want1) > 1e-12 * max(abs(want1), 1e-30):
                        return Check("replay", False,
                                     f"after the resume at step {first} the loop's lr at step {k} is {lr:.6g}, the "
                                     f"optimizer's initial lr, and at step {nxt[0]} {lr1:.6g}, where the "
                                     f"uninterrupted scheduler gives {want:.6g} and {want1:.6g}: the resume loaded "
                                     "neither the optimizer's state (its lr, moments and step count start afresh) "
                                     "nor the lr scheduler's: load both state_dicts")
                    return Check("replay", False,
                                 f"after the resume at step {first} the loop's lr at step {k} is {lr:.6g}, the "
                                 f"optimizer's initial lr, where the uninterrupted scheduler gives {want:.6g}: "
                                 "the resume did not load the optimizer's state (its lr, and its moments and "
                                 "step count with it, start afresh): load the optimizer's state_dict")
                return Check("replay", False,
                             f"after the resume at step {first} the loop's lr at step {k} is {lr:.6g} where the "
                             f"uninterrupted scheduler gives {want:.6g}: the resume dropped the lr scheduler's state")
            return Check("replay", False, f"the loop's lr at step {k} is {lr:.6g} where its scheduler, replayed, "
                                          f"gives {want:.6g}" + RC.scheduler_words(rec, ref, 0))
    apart = RC.rank_lr(rec, ref)
    if apart:
        return Check("replay", False, apart)
    if ref.meta.get("mode") == "run":
        tol = param_tolerance(rec, ref)
        worst, at, name, ok = (0.0, 0.0), None, None, True
        pre = A.SKETCHED_PARAM if rec.sketch else A.PARAM
        for k in rec.tensor_steps():
            a, b = rec.tensors_at(k, pre), ref.tensors(k, A.REPLAY_PARAM)
            x, n, t, ratio = per_tensor(a, b, sorted(set(a) & set(b)), tol[k])
            ok = ok and ratio <= 1.0
            if ratio > worst[1]:
                worst, at, name = (x, ratio), k, n
        last = tol[rec.tensor_steps()[-1]]
        a, b = rec.final(pre), ref.final()
        x, n, t, ratio = per_tensor(a, b, sorted(set(a) & set(b)), last)
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
    for i, k in enumerate(steps):
        after = rec.tensors_at(k, A.PARAM)
        diff = first_unequal(after, ref.tensors(k, A.REPLAY_PARAM))
        if diff:
            where = ("the parameters the resume loaded" if k in resumed else
                     f"the fleet's update at step {k - 1}" if k > steps[0] else "the recorded initial state")
            cause = ""
            if k - 1 in resumed and k not in resumed:
                # every update before the resume matched, its lr matched, and the first update after it
                # does not: what the resume restores beyond the parameters and the lr is the optimizer's state
                cause = (f": the first update after the resume at step {k - 1} is the first that differs, with "
                         "the parameters and the lr right, so the resume did not restore the optimizer's state "
                         "as saved (Adam's moments and step count dropped at the resume?): load the "
                         "optimizer's state_dict")
            elif k > steps[0] and k not in resumed:
                cause = RC.update_words(rec, ref, steps[i - 1], after, ref.tensors(k, A.REPLAY_PARAM))
            return Check("replay", False,
                         f"{where} differs from the replay of the user's optimizer on the recorded gradients: "
                         f"parameters before step {k} differ (first: {diff[0]}, relative {diff[1]:.2g})" + cause)
    final = rec.final(A.PARAM)
    diff = first_unequal(final, ref.final())
    if diff:
        return Check("replay", False, f"the fleet's update at step {steps[-1]} differs from the replay: final "
                                      f"parameters differ (first: {diff[0]}, relative {diff[1]:.2g})"
                     + RC.update_words(rec, ref, steps[-1], final, ref.final()))
    segs = len(rec.recorded.segments)
    return Check("replay", True, f"the user's optimizer and scheduler, replayed from the initial state on the "
                                 f"recorded gradients, give the recorded parameters bitwise at all {len(steps)} "
                                 f"steps" + (f", across {segs - 1} resume(s)" if segs > 1 else ""))



def moved_buffers(rec: A.RecordingSet) -> list[str]:
    """The persistent buffers whose recorded values before the first step and after the last differ
    (a BatchNorm's running statistics, a counter): state the run moved outside the optimizer."""
    for prefix in (A.BUFFER, A.SKETCHED_BUFFER):
        try:
            first, last = rec.tensors_at(rec.steps[0], prefix), rec.final(prefix)
        except (DormouseError, KeyError, FileNotFoundError):
            continue
        if first:
            return sorted(n for n, v in first.items() if n in last and (last[n].shape != v.shape
                                                                        or not torch.equal(last[n], v)))
    return []


def check_buffers(rec: A.RecordingSet, ref: ReferenceSet) -> Check | None:
    """None when the recording declares no buffer_update and no buffer moved during the run (the check
    is not part of its verdict). Buffers that moved with no rule declared are not judged, and the
    line says so: the reference loads them as recorded before every step, so whatever moved them
    (a forward in training mode, one rank's statistics broadcast to the others) is taken as given."""
    path = rec.spec.buffer_update
    if not path:
        moved = moved_buffers(rec) if rec.steps else []
        if not moved:
            return None
        shown = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
        return Check("buffers", True, f"not judged: {shown} moved during the run (recorded before step "
                                      f"{rec.steps[0]} and after the last differ) and no buffer_update declares "
                                      "how: the reference loads them as recorded before every step, so whatever "
                                      "moved them (the forward's own statistics, one rank's broadcast to the "
                                      "others) is taken as given; declare buffer_update='pkg.mod:fn' to have them "
                                      "judged")
    rule = ref.meta.get("buffer_rule")
    if ref.meta.get("mode") != "replay" or rule is None:
        return Check("buffers", True, f"the buffers' declared update ({path}) is not checked: the recording keeps "
                                      "no full tensors at every step (sketch or every > 1)")
    steps, names = rec.steps, set()
    for i, k in enumerate(steps):
        want = ref.tensors(k, A.BUFFER_AFTER)
        after = f"before step {steps[i + 1]}" if i + 1 < len(steps) else "after the last step"
        got = rec.tensors_at(steps[i + 1], A.BUFFER) if i + 1 < len(steps) else rec.final(A.BUFFER)
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
