"""Whether a recording holds what its ranks recorded (issue 27): each rank
wrote, beside each step's tensors and its final ones, a sha256 of its
parameters and persistent buffers ("param_hash", dormouse.digest.fingerprint).
The judge recomputes every rank's hash from the tensors that rank's files
hold now: a rank's tensors edited (or damaged) after the run, with its hash
left as it was, fail here, named, even where the judge reads another rank's
copy (under DDP the checks read rank 0's parameters; the ranks check
compares the recorded hashes, not the tensors)."""

from __future__ import annotations

from dormouse.digest import fingerprint
from dormouse.gate import artifacts as A
from dormouse.gate.judge.verdict import Check


def _state_at_step(t: dict) -> dict:
    """What the Recorder hashed at a step: the parameters by their names, the buffers as A.BUFFER + name
    (a sketched step: the parameter sketches by their names)."""
    full = A.prefixed(A.PARAM, t)
    if full:
        return {**full, **{k: t[k] for k in t if k.startswith(A.BUFFER)}}
    return A.prefixed(A.SKETCHED_PARAM, t)


def first_mismatch(rec: A.RecordingSet) -> str | None:
    """The first rank file (in step then rank order, then the final ones)
    whose tensors do not hash to the hash recorded beside them, or a rank whose initial state is not
    the parameters it recorded before the first step of a fresh run; None when all agree."""
    if rec.steps:
        for r in range(int(rec.recorded.segments[0]["world"])):
            if A.init_edited(rec, r):
                return (f"rank {r}'s recorded initial state ({A.init_path(rec.out, r).name}) is not the parameters "
                        f"that rank recorded before step {rec.steps[0]}")
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            want = rec.step_meta(r, k).get("param_hash")
            if want is None:  # a step without tensors (every > 1)
                continue
            if fingerprint(_state_at_step(rec.step_tensors(r, k))) != want:
                return (f"rank {r}'s recorded parameters at step {k} ({A.step_tensors_path(rec.out, r, k).name}) do "
                        "not hash to the param_hash that rank recorded beside them")
    for r in range(rec.world_at(rec.steps[-1])):
        want = A.read_json(A.final_meta_path(rec.out, r), "final").get("param_hash")
        t, _ = A.read_tensors(A.final_tensors_path(rec.out, r), "final tensors")
        if want is not None and fingerprint(t) != want:
            return (f"rank {r}'s recorded final parameters ({A.final_tensors_path(rec.out, r).name}) do not hash to "
                    "the param_hash that rank recorded beside them")
    return None


def moved_before_step(rec: A.RecordingSet) -> str | None:
    """The first step and rank whose parameters an in-place update (an optimizer step) moved between the
    step's first forward and rec.step (the Recorder's "moved_before_step"), or None."""
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            moved = rec.step_meta(r, k).get("moved_before_step")
            if moved:
                return (f"rec.step ran after optimizer.step() (the parameters had already moved: {', '.join(moved[:3])}"
                        f"{', ...' if len(moved) > 3 else ''} changed between step {k}'s first forward and rec.step on "
                        f"rank {r}): call rec.step before opt.step()")
    return None


def check_intact(rec: A.RecordingSet) -> Check:
    late = moved_before_step(rec)
    if late:
        return Check("intact", False, late)
    bad = first_mismatch(rec)
    if bad:
        return Check("intact", False, bad + ": the recording was edited or damaged after the run (its tensors are "
                                            "not what the rank recorded); re-record")
    return Check("intact", True, "every rank's recorded parameters (each step's and the final ones) hash to the "
                                 "sha256 that rank recorded beside them")
