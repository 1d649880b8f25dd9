"""Non-finite values in a recording (issue 27): the first step, rank and
tensor (or logged number) holding a NaN or an inf, in the order the run made
them: step by step; within a step rank by rank; within a rank the inputs, the
parameters and buffers before the step, the gradient, then the logged
numbers (a NaN gradient makes a NaN norm: the tensor is the cause); after the last step each rank's final parameters.

A comparison with NaN is false, so a check that asks "is the difference
above its bound?" passes NaN through: the judge names the first non-finite
value as its own failing line, and its checks treat a non-finite difference
as above every bound (recording.rel)."""

from __future__ import annotations

import math

import torch

from dormouse.gate import artifacts as A

from dormouse.gate.judge.verdict import Check

# the logged numbers of a step JSON, in the order they are named, and what they are
NUMBERS = (("loss", "logged loss"), ("grad_norm", "logged gradient norm"), ("clip_coef", "clip coefficient"),
           ("lr", "lr"))
# a tensor's kind by its prefix, in the order they are searched within a rank's step
KINDS = ((A.INPUT, "input"), ("ids", "example ids"), (A.PARAM, "parameter"), (A.BUFFER, "buffer"), (A.SKETCHED_PARAM, "parameter sketch"),
         (A.GRAD, "gradient"), (A.SKETCHED_GRAD, "gradient sketch"))


def bad_number(x) -> bool:
    """A logged number that is a float and not finite (None and non-numbers are another check's)."""
    return isinstance(x, float) and not math.isfinite(x)


def describe(t: torch.Tensor) -> str | None:
    """"NaN (3 of 16 elements)" / "inf (...)" / "NaN and inf (...)" for a floating tensor holding any; else None."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    what = " and ".join(w for w, n in (("NaN", nan), ("inf", inf)) if n)
    return f"{what} ({nan + inf} of {t.numel()} elements)"


def _name(key: str) -> str:
    """"gradient of ln1.bias", "input attention_mask of micro-batch 0", ..."""
    for pre, word in KINDS:
        if key.startswith(pre):
            rest = key[len(pre):]
            if pre == A.INPUT:
                m, _, inp = rest.partition("/")
                return f"input {inp} of micro-batch {m}"
            return f"{word} of {rest}" if rest else word
    return key


def _order(key: str) -> tuple[int, str]:
    return next((i for i, (pre, _) in enumerate(KINDS) if key.startswith(pre)), len(KINDS)), key


def _first_bad(t: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """The first tensor of one file (by KINDS, then name) holding NaN or inf,
    and how many others of its kind do: "gradient of ln1.bias holds NaN (1 of
    16 elements)" (a clip by a NaN norm spreads it to every tensor)."""
    # the tensors the checks compare (a TP peer's or a pipeline stage's own inputs, A.TP_INPUT, and the probe's
    # module outputs are not the run's data: a later stage's received activations start as empty buffers)
    bad = [(key, said) for key in sorted(t, key=_order) if _order(key)[0] < len(KINDS) and (said := describe(t[key]))]
    if not bad:
        return None
    key, said = bad[0]
    kind = _order(key)[0]
    same = [b for b in bad if _order(b[0])[0] == kind]
    total = sum(1 for x in t if _order(x)[0] == kind)
    more = ("" if len(same) < 2 else f"; all {total} tensors of its kind hold some" if len(same) == total
            else f"; {len(same)} of the {total} tensors of its kind hold some")
    return key, f"{_name(key)} holds {said}{more}"


def first_nonfinite(rec: A.RecordingSet) -> tuple[int | None, int, str, str] | None:
    """(the step, or None after the last; the rank; the tensor's key or the
    logged number's field; the sentence naming the first non-finite value)
    or None when the recording holds none."""
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            bad = _first_bad(rec.step_tensors(r, k))
            if bad:
                return k, r, bad[0], f"at step {k} rank {r}'s {bad[1]}"
            meta = rec.step_meta(r, k)
            for key, word in NUMBERS:
                if bad_number(meta.get(key)):
                    return k, r, key, f"at step {k} rank {r}'s {word} is {meta[key]}"
    for r in range(rec.world_at(rec.steps[-1])):
        bad = _first_bad(A.read_tensors(A.final_tensors_path(rec.out, r), "final tensors")[0])
        if bad:
            return None, r, bad[0], f"after the last step rank {r}'s {bad[1]}"
    return None


def check_finite(rec: A.RecordingSet, found=None) -> Check:
    """`found`: first_nonfinite(rec), when the caller has it."""
    found = first_nonfinite(rec) if found is None else found
    if not found:
        return Check("finite", True, "no NaN or inf in any recorded tensor or logged number")
    k, _, _, said = found
    return Check("finite", False, said + ": the first non-finite value of the recording (steps in order, then ranks, "
                                  "then the inputs, parameters, gradient and logged numbers); a check that compares "
                                  "it fails, none passes over it"
                 + (f" (the steps before {k} are judged as recorded)" if k is not None and k > rec.steps[0] else ""))


def first_nonfinite_state(rec: A.RecordingSet) -> str | None:
    """Where the ranks' state (parameters or buffers) first holds NaN or inf:
    "before step k" or "after the last step"; None when nowhere. The ranks
    check compares that state by hash: equal NaN is not an agreement to pass."""
    state = (A.PARAM, A.BUFFER, A.SKETCHED_PARAM)
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            t = rec.step_tensors(r, k)
            if any(key.startswith(state) and describe(v) for key, v in t.items()):
                return f"before step {k}"
    for r in range(rec.world_at(rec.steps[-1])):
        t, _ = A.read_tensors(A.final_tensors_path(rec.out, r), "final tensors")
        if any(key.startswith(state) and describe(v) for key, v in t.items()):
            return "after the last step"
    return None


