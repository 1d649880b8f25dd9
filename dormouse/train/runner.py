"""`dormouse.train.run`: train one RunConfig, in one process or as a fleet.

The one place that chooses between the two: a process started by torchrun
(it sets RANK and WORLD_SIZE) joins the fleet whether or not the run says
`train.dist` (the convention of nanoGPT and torchtitan; a log line says so);
a run that says `train.dist` outside torchrun is refused. It also owns what a
run leaves beside its checkpoints: `<out>/run.json`, the run as `--config`
replays it (written once a step has trained, so bad input never leaves one;
resuming belongs to one launch, not to the run), per-rank log files and
TensorBoard events.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from pathlib import Path

from dormouse import atomic
from dormouse.config import RunConfig
from dormouse.errors import DormouseError, FleetError

RUN_JSON = "run.json"


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (it sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def as_launched(config: RunConfig) -> tuple[RunConfig, str]:
    """The run this launch trains, and a note when torchrun made it a fleet:
    torchrun means a fleet; a fleet without torchrun is one FleetError."""
    if config.train.dist and not in_torchrun():
        raise FleetError(
            "a fleet (--dist or train.dist=true) runs under torchrun, which sets RANK and WORLD_SIZE: "
            "torchrun --standalone --nproc_per_node=2 -m dormouse train ...; "
            "or drop --dist to train in one process")
    if in_torchrun() and not config.train.dist:
        note = (f"started by torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']}): training as a fleet "
                "(train.dist implied)")
        return dataclasses.replace(config, train=dataclasses.replace(config.train, dist=True)), note
    return config, ""


class RankLog:
    """Where a process's log lines go: stdout on rank 0, and DIR/rank<r>.log on
    every rank when a log directory is given."""

    def __init__(self, rank: int, log_dir: str):
        self.rank = rank
        self.file = None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(log_dir) / f"rank{rank}.log", "a", buffering=1)

    def __call__(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def tokens_per_step(config: RunConfig) -> int:
    """Tokens of one global step (the run's FleetPlan: a fleet's from its
    profile; it checks the profile and the micro-batch on every rank)."""
    from dormouse.train.data import FleetPlan

    world = int(os.environ["WORLD_SIZE"]) if config.train.dist else 1
    return FleetPlan.of_run(config, world).tokens


def run(config: RunConfig, *, device: str = "cpu", log_dir: str = "", tensorboard: str = "",
        describe: str = "", hooks=None) -> dict:
    """Train `config` in this process, or as this process's rank of the fleet
    torchrun started; returns the loop's report. `describe` names where the
    run came from in the first log line (e.g. "preset=tiny"); `hooks`
    (dormouse.train.hooks.Hooks) go to the loop, e.g. a recording's. DormouseError
    for bad input (said before any rank joins a fleet where it can be); any
    other exception is a crash: its traceback goes to the rank's log file
    (the caller maps both to an exit status: errors.command_status)."""
    config, note = as_launched(config)
    if config.train.data:  # a missing or empty corpus is said before any rank joins a fleet
        from dormouse.train.data import ByteCorpus

        ByteCorpus(config.train.data, config.train.eval_frac)
    per_step = tokens_per_step(config)  # checks a fleet's profile and micro-batch on every rank
    if tensorboard:
        from dormouse.train.tracking import require_tensorboard

        require_tensorboard()  # on every rank, before any collective
    rank = int(os.environ.get("RANK", "0")) if config.train.dist else 0
    log = RankLog(rank, log_dir)
    tracker = None
    try:
        if note:
            log(note)
        if tensorboard and rank == 0:
            from dormouse.train.tracking import TensorBoardTracker

            tracker = TensorBoardTracker(tensorboard, tokens_per_step=per_step, run=config)
        return _train(config, device, log, tracker, describe, hooks)
    except DormouseError as e:
        if log.file is not None:  # a rank other than 0 says it here (rank 0 on stderr too)
            log.file.write(f"error: {' '.join(str(e).split())}\n")
        raise
    except Exception:
        if log.file is not None:
            log.file.write(traceback.format_exc())
        raise
    finally:
        if tracker is not None:
            tracker.close()
        log.close()


def _train(config: RunConfig, device: str, log: RankLog, tracker, describe: str, hooks=None) -> dict:
    from dormouse.model import DormouseModel

    n_params = sum(p.numel() for p in DormouseModel(config.model).parameters())
    fleet = f"fleet of {os.environ['WORLD_SIZE']} ranks " if config.train.dist else ""
    log(f"dormouse: {fleet}{describe + ' ' if describe else ''}params={n_params:,} "
        f"data={config.train.data or 'built-in'} steps={config.train.steps} out={config.train.out_dir}")
    written = []
    # The run as --config should replay it: resuming is a property of one launch, not of the run.
    replay = dataclasses.replace(config, train=dataclasses.replace(config.train, resume=False, resume_from=""))

    def on_step(step, model, info):
        if not written and log.rank == 0:
            atomic.write_text(Path(config.train.out_dir) / RUN_JSON, replay.to_json() + "\n")
            written.append(True)
        if tracker is not None:
            tracker.on_step(step, model, info)

    line_log = tracker.wrap_log(log) if tracker is not None else log
    if config.train.dist:
        from dormouse.train.distributed import close_fleet, train_dist

        report = train_dist(config, log=line_log, device_type=device, on_step=on_step, close=False, hooks=hooks)
        del report["model"]  # the last holder of a sharded model: gone before the group is destroyed
        close_fleet()
    else:
        from dormouse.train.loop import build_model, train

        model = build_model(config).to(device)
        report = train(model, config, log=line_log, on_step=on_step, hooks=hooks)
    if report["final_loss"] is None:
        log(f"done: nothing to train, the checkpoint is already at step {report['start_step']} "
            f"(--steps {config.train.steps}); raise --steps to continue")
    else:
        log(f"done: final loss {report['final_loss']:.4f}, {report['tokens_per_s']:.0f} tokens/s, "
            f"checkpoint {report['checkpoint']}")
    return report

