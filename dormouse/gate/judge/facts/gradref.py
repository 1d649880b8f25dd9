"""Fact 3 for dormouse's own fleet: it reads the bytes the data rule gives,
and reports the held-out loss one process computes.

gradref    at every step, every window the fleet's forwards saw (each rank's
           slice, in rank order) equals the bytes gradref read from the
           corpus by its own arithmetic from the documented data rule; the
           tokens are counted from the targets it built. The weighting of those
           tokens is the recording's gradient fact (the declared token mean
           over the global batch). Every eval loss the fleet reported equals
           gradref's token mean over the held-out windows at the fleet's
           recorded parameters after that step (LOSS_RTOL; a bfloat16 model:
           its own round-off), at the steps the recipe evaluates: a wrong
           metric is its own finding, not a wrong training.
"""

from __future__ import annotations

from dormouse.digest import window_digest
from dormouse.gate import artifacts as A
from dormouse.gate.judge.bounds import LOSS_RTOL, arithmetic_rtol
from dormouse.gate.judge.verdict import Check, TensorCheck


def recorded_windows(rec: A.RecordingSet, step: int) -> list[str]:
    """The sha256 of every window the fleet's ranks computed at `step`, in
    rank then forward order: a row of a micro-batch's input (its forward's
    first argument) with its target's last byte (the second's) appended."""
    out = []
    for _, _, b in rec.micro_batches(step):
        for x, y in zip(b["arg0"], b["arg1"]):
            out.append(window_digest(x.tolist() + y[-1:].tolist()))
    return out


def check_gradref(rec: A.RecordingSet, g: dict) -> Check:
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
    return _evals(c, rec, g)


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
