"""The fleet: one process per rank under torchrun, recorded through the
Recorder into the settings' out dir (a fleet that stops and resumes at
another world size: a second segment of the same recording), and the
launcher's plan files (several runs in one launch)."""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path

from dormouse.errors import DormouseError
from dormouse.gate.record.dormouse_loop import LoopRecorder
from dormouse.gate.record.modes.base import _RUN_SCOPES, mode
from dormouse.gate.settings import GateSettings, from_dict
from dormouse.train.distributed import close_fleet, train_dist

def run_rank(s: GateSettings, log=print, leg: int = 0) -> dict:
    """One rank of the fleet (run it under torchrun); `leg` 1 or 2 when the
    settings stop and resume the fleet at another world size."""
    return run_rank_plan([s], log=log, leg=leg)[-1]


def run_rank_plan(plan: list[GateSettings], log=print, leg: int | list[int] = 0) -> list[dict]:
    """Several fleet runs in one process group, one after another (each into
    its own out dir): the same code path as one run per launch. `leg`: the
    leg of every run, or one per run (a plan file's, load_plan)."""
    legs = list(leg) if isinstance(leg, (list, tuple)) else [leg] * len(plan)
    if len(legs) != len(plan):
        raise DormouseError(f"a plan of {len(plan)} runs with {len(legs)} legs")
    metas = []
    try:
        for s, one in zip(plan, legs):
            with ExitStack() as scopes:  # each installed run scope, around this run alone
                for scope in list(_RUN_SCOPES):
                    scopes.enter_context(scope(s))
                metas.append(rank_run(s, log, one))
    except BaseException:
        close_fleet(wait=False)  # the peers may be in a step this rank never reaches (close_fleet)
        raise
    close_fleet()
    return metas


def rank_run(s: GateSettings, log=print, leg: int = 0) -> dict:
    """One fleet run of this rank in the process group it has joined (the
    unit of a plan), recorded into the settings' out dir; run_rank_plan calls
    it once per run and leaves the fleet at the end. The seam where a
    benchmark or a test's fault acts on one run of a plan (keyed by s.out_dir).
    Returns train()'s report (the trained model dropped)."""
    legs = s.legs()
    if (len(legs) == 2) != (leg in (1, 2)):
        raise DormouseError(f"resume_world = {s.resume_world}: this fleet runs in {len(legs)} launch(es); "
                            + ("launch it with --leg 1, then --leg 2 at resume_world ranks (the gate's launcher "
                               "does both)" if len(legs) == 2 else "drop --leg"))
    me = legs[leg - 1] if leg else s  # this launch's world and profile
    k = s.stop_step()
    ckpt = str(s.out_dir / "ckpts" / ("fleet.dcp" if s.shard == "fsdp" else "fleet.pt"))
    if leg == 1:
        m = mode(me, name="fleet", dist=True)
        m.run.train.stop_at, m.run.train.ckpt_every = k, k
    elif leg == 2:
        m = mode(me, name="fleet", dist=True, resume_from=ckpt)
    else:
        m = mode(me, name="fleet", dist=True, resume_from=s.resume_path())
    m = dataclasses.replace(m, s=s)  # this launch's run; the recording keeps the whole run's settings
    # Seeded BEFORE joining the fleet, so every rank builds the same model (and
    # the references build it too); train_dist checks it.
    model = m.model()
    # the second leg continues the first's recording: its settings and provenance (the run's init) stand
    rec = LoopRecorder(s.out_dir) if leg == 2 else m.recorder(s.out_dir, model)
    report = train_dist(m.run, log=log, device_type=s.device, model=model, close=False, hooks=rec.hooks())
    report.pop("model", None)
    del model
    return report


def load_plan(path: str, *, validated: bool = False) -> tuple[list[GateSettings], list[int]]:
    """The launcher's plan file: a JSON list of {"leg": N, "settings": {GateSettings
    fields}}, one fleet run each (`validated`: written from validated settings);
    returns the runs and each run's leg."""
    try:
        items = json.loads(Path(path).read_text())
        return ([from_dict(item["settings"], validated=validated) for item in items],
                [int(item["leg"]) for item in items])
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DormouseError(f"plan {path!r} is not a JSON list of legs and gate settings ({e})") from e
