"""Fact 3 for dormouse's own fleet: it reads the bytes the data rule gives,
and reports the held-out loss one process computes.

gradref    at every step, every window the fleet's forwards saw (each rank's
           slice, in rank order) equals the bytes gradref read from the
           corpus by its own arithmetic from the documented data rule; the
           tokens are counted from the targets it built. The weighting of those
           tokens is the recording's gradient fact (the declared token mean
           over the global batch); on those bytes, in a float32 run, gradref
           also holds EACH tensor of the fleet's gradient to one process's
           element by element: max |g_fleet - g| / max |g| <= GRAD_RTOL
           (numerics.relative), so that a departure in a few elements of one
           tensor is not diluted in the gradient fact's L2 norm over every
           tensor (the default gate's clean fleet: 1.2e-6;
           compared where the gradient fact passed: where it failed, that
           fact names the cause). Every eval loss the fleet reported equals
           gradref's token mean over the held-out windows at the fleet's
           recorded parameters after that step (LOSS_RTOL; a bfloat16 model:
           its own round-off), at the steps the recipe evaluates: a wrong
           metric is its own finding, not a wrong training.
"""

from __future__ import annotations

import hashlib

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.bounds import GRAD_RTOL, LOSS_RTOL, arithmetic_rtol
from dormouse.gate.judge.facts.gradient import fleet_grad
from dormouse.gate.judge.metrics import relative
from dormouse.gate.judge.verdict import Check, TensorCheck


def recorded_windows(rec: A.RecordingSet, step: int) -> list[str]:
    """The sha256 of every window the fleet's ranks computed at `step`, in
    rank then forward order: a row of a micro-batch's input (its forward's
    first argument) with its target's last byte (the second's) appended."""
    out = []
    for _, _, b in rec.micro_batches(step):
        for x, y in zip(b["arg0"], b["arg1"]):
            out.append(hashlib.sha256(bytes(x.tolist() + y[-1:].tolist())).hexdigest())
    return out


def check_gradref(rec: A.RecordingSet, g: dict, ref: ReferenceSet | None = None) -> Check:
    """`ref`: the recording's one-process reference, for the element-by-element comparison, given where the
    gradient fact passed (where it failed, it names the cause; None: the bytes and evals alone)."""
    rows = {r["step"]: r for r in g.get("steps", [])}
    if g.get("run") != rec.run or sorted(rows) != rec.steps:
        return TensorCheck("gradref", False, "gradref was made from another recording than the fleet's: re-run "
                           "gradref", first_step=1)
    for k in rec.steps:
        want, have = rows[k]["windows"], recorded_windows(rec, k)
        if have != want:
            bad = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), None)
            where = (f"window {bad} (0-based, in rank order) holds other bytes" if bad is not None else
                     f"the fleet computed {len(have)} windows where the rule reads {len(want)}")
            return TensorCheck("gradref", False, f"the fleet read other bytes than the data rule gives at step {k}: "
                               f"{where} (a wrong span, window or rank slice)", first_step=k)
    c = TensorCheck("gradref", True, f"every window of every step ({sum(len(r['windows']) for r in rows.values())} "
                    f"in all, {rows[rec.steps[0]]['tokens']} tokens a step) holds the bytes the data rule gives, "
                    "read by gradref's own arithmetic")
    return _evals(_tensor_by_tensor(c, rec, g, ref), rec, g)


def _tensor_by_tensor(c: TensorCheck, rec: A.RecordingSet, g: dict, ref: ReferenceSet | None) -> TensorCheck:
    """Each tensor of the fleet's gradient against one process's on the rule's bytes, at every tensor step
    (a float32 run with full tensors: a bfloat16 model or wire is bounded by the gradient fact alone)."""
    if (ref is None or ref.meta.get("mode") == "run" or rec.meta.get("wire") == "bf16"
            or arithmetic_rtol(g.get("config") or {}) != GRAD_RTOL):
        return c
    worst, where = 0.0, None
    for k in rec.tensor_steps():
        fleet, one = fleet_grad(rec, k), ref.tensors(k, "g/")
        for n in sorted(set(fleet) & set(one)):
            r = relative(fleet[n], one[n])
            if not r <= GRAD_RTOL:
                c.passed, c.first_step, c.worst, c.worst_tensor, c.worst_step = False, k, r, n, k
                c.bound = GRAD_RTOL
                c.reason = (f"the fleet's gradient of {n} at step {k} departs from one process's on the bytes "
                            f"gradref read by {r:.2e} of the tensor's largest element (> {GRAD_RTOL:g}, element "
                            "by element): a departure in some elements that the whole gradient's norm dilutes")
                return c
            if r >= worst:
                worst, where = r, (n, k)
    c.worst, c.bound = worst, GRAD_RTOL
    c.worst_tensor, c.worst_step = where or (None, None)
    c.reason += (f"; each tensor of the fleet's gradient within {worst:.1e} of one process's, element by element "
                 f"(worst {where[0]} at step {where[1]}; bound {GRAD_RTOL:g})" if where else "")
    return c


def _evals(c: Check, rec: A.RecordingSet, g: dict) -> Check:
    """The fleet's reported eval losses against gradref's, at the steps the recipe evaluates."""
    want, have = g.get("evals") or [], rec.extra.get("evals") or []
    tol = arithmetic_rtol(g.get("config") or {}, LOSS_RTOL)  # a bfloat16 model's own round-off is wider
    if [k for k, _ in have] != [k for k, _ in want]:
        c.passed, c.first_step = False, (want or have)[0][0]
        c.reason = (f"the logged eval loss is wrong: the fleet reported eval losses at steps "
                    f"{[k for k, _ in have]}, the recipe evaluates at steps {[k for k, _ in want]}")
        return c
    rel = [abs(x - y) / abs(y) if y else abs(x - y) for (_, x), (_, y) in zip(have, want)]
    bad = next((i for i, r in enumerate(rel) if not r <= tol), None)
    if bad is not None:
        c.passed, c.first_step = False, want[bad][0]
        c.reason = (f"the logged eval loss is wrong: at step {want[bad][0]} the fleet reported "
                    f"{have[bad][1]:.7f}, the held-out windows' token mean at its parameters is "
                    f"{want[bad][1]:.7f} (relative {rel[bad]:.1e} > {tol:.0e})")
    elif want:
        c.reason += f"; eval losses at steps {[k for k, _ in want]} within {max(rel):.1e} of gradref's"
    return c
