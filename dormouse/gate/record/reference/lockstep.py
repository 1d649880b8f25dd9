"""The sharded reference's backwards in lockstep (reference/sharded.py): a step's list of jobs
shared out over the launch's ranks, job j on rank j mod N, round by round. Under FSDP2 every
forward and backward all-gathers each unit's parameters, a collective: in every round each rank
runs exactly one forward and backward: a rank with no job left runs a discarded one, and a job
that fails after its forward still runs a (discarded) backward of its output. The round's results,
and the first failure on any rank, reach every rank at the round's end."""

from __future__ import annotations

from pathlib import Path

import torch

from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record.options import OBJECTIVES
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import fsdp
from dormouse.gate.record.reference import objective as O
from dormouse.gate.record.reference import rngstate as RS
from dormouse.gate.record.reference.error import ReferenceError


class Step:
    """One step's context on every rank: the recording, its micro-batches (rank, m, batch), the merged
    forwards' chunks, the user's objective, the scratch folder the jobs write to."""

    def __init__(self, rec: A.RecordingSet, step: int, mbs, user, chunks, aw, scratch: Path):
        self.rec, self.step, self.mbs, self.user, self.chunks, self.aw = rec, step, mbs, user, chunks, aw
        self.objective = rec.spec.objective
        self.scratch = scratch
        self.n_step = (sum(O.objective_count(self.objective, b) for _, _, b in mbs)
                       if self.objective in OBJECTIVES else 0.0)
        self.w_step = len({r for r, _, _ in mbs})
        self.rng_after: dict = {}  # the probe's: the RNG state its first pass left, by job (sharded.py)

    def batch(self, job) -> tuple[tuple[int, int], dict]:
        """A job's ((rank, m) it takes its attributes from, its batch): (kind, i, j) is micro-batch i
        (row j of it for "ex"), or merged forward i for "gm"."""
        kind, i, j = job
        if kind == "gm":
            c = self.chunks[i]
            return self.mbs[c[0]][:2], BS.merged([self.mbs[x][2] for x in c])
        r, m, batch = self.mbs[i]
        return (r, m), (O.rows(batch)[j] if kind == "ex" else batch)


def guarded(model, st: Step, job, seed: int, fn):
    """fn() (a forward and backward of `model` on the job's batch) with the job's recorded attributes
    and RNG seed: its value, or {"error": ..., "bad_input": whether a DormouseError} after a discarded
    backward that keeps the lockstep."""
    (r, m), batch = st.batch(job)
    undo = FW.attrs(model, st.rec, r, st.step, m)
    if job[0] in ("g", "gn", "rng"):  # a micro-batch's own forward: the masks its rank drew (or another draw)
        RS.restore(st.rec, r, st.step, m, other=seed != 0)
    else:
        torch.random.default_generator.manual_seed(seed)
    try:
        with _ForwardOutput(model) as seen:
            try:
                return fn(batch)
            except Exception as e:  # noqa: BLE001 (every rank learns of it at the round's end)
                _complete(model, seen, batch)
                fsdp.take_grads(model)
                bad = isinstance(e, DormouseError)
                return {"error": str(e) if bad else f"{type(e).__name__}: {e}", "bad_input": bad}
    finally:
        undo()


class _ForwardOutput:
    """The root module's output of the forward run inside (None until it ran)."""

    def __init__(self, model):
        self.model, self.out = model, None

    def __enter__(self):
        self.hook = self.model.register_forward_hook(lambda mod, args, out: setattr(self, "out", out))
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        return False


def _complete(model, seen: _ForwardOutput, batch) -> None:
    """The backward of zero x the forward's output (the forward run first where it did not run)."""
    from dormouse.gate.record.probe import _first_tensor

    out = seen.out
    if out is None:
        with torch.enable_grad():
            out = O.call(model, batch)
    t = _first_tensor(out)
    if t is not None and t.requires_grad:
        (t.float().sum() * 0).backward()


def _dummy(model, st: Step) -> dict:
    """A discarded forward and backward (a rank with no job left this round)."""
    _, batch = st.batch(("g", 0, 0))
    with _ForwardOutput(model) as seen:
        _complete(model, seen, batch)
    fsdp.take_grads(model)
    model.zero_grad(set_to_none=True)
    return {}


def run_jobs(model, st: Step, jobs: list, work, rank: int, world: int) -> list[dict]:
    """work(model, st, index, job) -> its result (a small dict) for every job, each on its rank; every
    result on every rank. The first failure on any rank is raised on every rank once its round ends."""
    import torch.distributed as dist

    results: list[dict] = [{} for _ in jobs]
    for start in range(0, len(jobs), world):
        j = start + rank
        mine = work(model, st, j, jobs[j]) if j < len(jobs) else _dummy(model, st)
        got: list = [None] * world
        dist.all_gather_object(got, {"j": j, **mine})
        failed = next((g for g in got if g.get("error")), None)
        if failed is not None:
            raise ReferenceError(f"step {st.step}, rank {got.index(failed)} of the sharded reference: "
                                 f"{failed['error']}")
        for g in got:
            if g["j"] < len(jobs):
                results[g["j"]] = g
    return results
