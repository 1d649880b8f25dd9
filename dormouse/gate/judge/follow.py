"""The verdict while the run trains (`dormouse gate check --follow --out DIR`):
the checks that need no reference, step by step, as a running fleet's Recorder
writes its steps.

A step is judged once every rank has written its marker for it
(artifacts.step_done_path: the Recorder writes it after everything of the
step, the HF callback's report after the optimizer step included). Each
judged step prints one line: the step, the facts it was judged by and found ok
("ranks, reduction, loss ok (no reference yet)": never a PASS, the full check
decides) or the first failing fact with its cause, and the lag behind the run (steps the fleet has written since, seconds
since the step's last marker). What a step is judged by, with no reference:

ranks       every rank's copy of what the replicas hold alike (the synchronised
            gradient, the clip, the lr; the parameters by hash), rank by rank
reduction   (a recording made with RecordingSpec(selfcheck=k)) each rank's
            synchronised gradient against the reduction of the ranks' local
            gradients, the replicas' parameters, the logged loss against the
            ranks' loss sums and token counts (judge/facts/reduction.py)

This module judges; it trains nothing and writes nothing. The full check (the
one-process reference) runs once the recording is closed, by the driver.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.judge.facts.ranks import replica_apart
from dormouse.gate.judge.facts.reduction import step_findings, tensor_info


@dataclass
class Followed:
    """What following a run found: `failed` the first failing step (None: none),
    `closed` whether the run closed its recording, `steps` how many were judged."""

    failed: int | None
    closed: bool
    steps: int
    reason: str = ""


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # not there yet, or being replaced
        return None


def _newest_step(out: Path, world: int) -> int:
    best = 0
    for r in range(world):
        files = A.step_files(out, r)
        if files:
            best = max(best, int(files[-1].stem[4:]))
    return best


def _recording(out: Path) -> tuple[A.RecordingSpec, A.RecordedRun] | None:
    """The recording.json a running fleet writes, typed (artifacts.read_recording), or None while it is
    being replaced."""
    meta = _json(A.recording_path(out))
    return None if meta is None else A.read_recording(meta, A.recording_path(out))


def _replicas(recorded: A.RecordedRun) -> bool:
    """Whether every rank holds the whole model (DDP): no FSDP2 shards, no model-parallel layout."""
    return not recorded.fsdp and not recorded.layout


def judge_step(out: Path, k: int, metas: list[dict], spec: A.RecordingSpec, recorded: A.RecordedRun,
               info) -> tuple[str, str] | None:
    """The first failing fact of step k and its cause, else None."""
    replicas = _replicas(recorded)
    if replicas:
        hashes = [m.get("param_hash") for m in metas]
        bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
        if bad:
            return "ranks", f"rank {bad[0]}'s parameters or persistent buffers differ from rank 0's before step {k}"
        apart = replica_apart(out, k, metas)
        if apart:
            return "ranks", apart
    found = step_findings(out, k, metas, info, recorded.fsdp, spec.wire)
    if found:
        return "reduction", "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "")
    return None


def follow(out, *, start: int = 1, every: int = 1, wait: float = 600.0, poll: float = 0.2, log=print) -> Followed:
    """Judge the recording in `out` step by step as its ranks write it (module
    docstring); returns at the first failing step, or when the run has closed
    its recording and every step (from `start`, every `every`-th) was judged.
    `wait`: seconds without anything new (no recording yet, no new marker) after
    which the run is taken for gone (DormouseError)."""
    out = Path(out)
    if every < 1 or start < 1:
        raise DormouseError(f"--every {every} --from {start}: both must be at least 1")
    t0 = time.monotonic()
    while not A.recording_path(out).exists():
        if time.monotonic() - t0 > wait:
            raise DormouseError(f"no recording appeared in {out} within {wait:.0f} s: start the fleet with its Recorder "
                                "writing there, or point --out at the directory it writes")
        time.sleep(poll)
    typed = None
    while typed is None:
        typed = _recording(out)  # one line on a file of another kind or schema
        if typed is None:
            time.sleep(poll)
    spec, recorded = typed
    run, seg = recorded.run, recorded.segments[-1]
    world = int(seg["world"])
    k = max(start, int(seg["start"]))
    k += (start - k) % every
    judged, info, last_new = 0, None, time.monotonic()
    while True:
        spec, recorded = _recording(out) or (spec, recorded)
        if recorded.run != run:
            raise DormouseError(f"the recording in {out} was replaced by another run while it was followed")
        end = recorded.segments[-1].get("end") if recorded.closed else None
        stopped = (recorded.stopped or {}).get("step")
        if end is not None and k > end and (stopped is None or k > stopped):
            if stopped is not None:  # the step the run stopped itself at, off the sampled steps
                why = "; ".join((recorded.stopped.get("findings") or ["no cause recorded"])[:3])
                log(f"step {stopped}: FAIL reduction: {why}  (the run stopped itself there: stop_on_fail)")
                return Followed(stopped, True, judged, f"reduction: {why}")
            return Followed(None, True, judged)
        marks = [A.step_done_path(out, r, k) for r in range(world)]
        done = [_json(p) for p in marks]
        if not all(d is not None and d.get("run") == run for d in done):
            if time.monotonic() - last_new > wait:
                missing = [r for r, d in enumerate(done) if d is None]
                raise DormouseError(f"step {k}: rank {missing[0] if missing else '?'} wrote no marker for {wait:.0f} s "
                                    "and the recording is not closed: a rank crashed or hangs (the steps before it "
                                    "passed)")
            time.sleep(poll)
            continue
        last_new = time.monotonic()
        if info is None:
            info = tensor_info(out)
        metas = [_json(A.step_meta_path(out, r, k)) for r in range(world)]
        if any(m is None or m.get("run") != run for m in metas):
            raise DormouseError(f"step {k}: a rank's marker is there but not its step JSON of this run: the recording "
                                "was edited or is damaged")
        lag_steps = max(_newest_step(out, world) - k, 0)
        lag_s = max(time.time() - max(p.stat().st_mtime for p in marks), 0.0)
        bad = judge_step(out, k, metas, spec, recorded, info)
        judged += 1
        lag = f"(lag {lag_steps} step{'s' if lag_steps != 1 else ''}, {lag_s:.1f} s)"
        if bad:
            log(f"step {k}: FAIL {bad[0]}: {bad[1]}  {lag}")
            return Followed(k, recorded.closed, judged, f"{bad[0]}: {bad[1]}")
        replicas = _replicas(recorded)
        if not replicas and not isinstance(metas[0].get("selfcheck"), dict):
            log(f"step {k}: NOT JUDGED (no replicas to compare rank by rank, and no in-run checks recorded: "
                f"record with RecordingSpec(selfcheck=k))  {lag}")
        else:  # what the step was judged by, never a PASS: the step's gradient waits for the full check
            seen = (["ranks"] if replicas else []) + (["reduction", "loss"]
                                                      if isinstance(metas[0].get("selfcheck"), dict) else [])
            log(f"step {k}: {', '.join(seen)} ok (no reference yet)  {lag}")
        k += every
