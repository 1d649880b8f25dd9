"""A gate process that also keeps one intermediate checkpoint, for the resume
tests only (the gate itself writes no checkpoints: fixtures.make_run sets
ckpt_every=0). A test runs this file instead of `-m dormouse.gate` under
torchrun, or calls `install()` in-process; it installs a run hook of the
modes (the runs that checkpoint) and an `on_saved` hook of the loop (to
keep the step-K copy) inside the process, then hands over to dormouse.gate's
own main.

DORMOUSE_TEST_CKPT_AT=K      runs checkpoint every K steps (train.ckpt_every),
                             and the step-K checkpoint is kept beside the
                             run's own as `<ckpt_name>.stepK.pt` (or `.dcp`):
                             what a run stopped after step K leaves behind
                             (the end-of-run checkpoint replaces `<ckpt_name>.pt`).
DORMOUSE_TEST_CKPT_OUTS      the out dirs whose runs checkpoint, separated by
                             os.pathsep; every other run is left untouched.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import dormouse.gate.record.modes as modes
from dormouse.train import hooks


def kept(path: Path, step: int) -> Path:
    """Where the step-`step` copy of checkpoint `path` is kept."""
    path = Path(path)
    return path.with_name(f"{path.stem}.step{step}{path.suffix}")


def install(at: int, outs: list[str]):
    """Returns the function that removes both hooks."""
    outs = {str(Path(o).resolve()) for o in outs}

    def checkpointing(s, run):  # the modes' run hook: the runs of `outs` checkpoint every `at` steps
        if str(s.out_dir.resolve()) not in outs:
            return None
        return dataclasses.replace(run, train=dataclasses.replace(run.train, ckpt_every=at))

    def keep(saved: hooks.Saved) -> None:  # every rank's part is written when the hook runs
        if saved.step == at:
            if saved.peers.is_main:
                path = Path(saved.path)
                (shutil.copytree if path.is_dir() else shutil.copy2)(path, kept(path, at))
            saved.peers.barrier()

    remove_run_hook = modes.install_run_hook(checkpointing)
    remove_keep = hooks.install(hooks.Hooks(on_saved=[keep]))

    def remove() -> None:
        remove_keep()
        remove_run_hook()

    return remove


if __name__ == "__main__":
    install(int(os.environ["DORMOUSE_TEST_CKPT_AT"]), os.environ["DORMOUSE_TEST_CKPT_OUTS"].split(os.pathsep))
    from dormouse.gate.__main__ import main

    sys.exit(main())
