"""Test-only entry point: `dormouse train ...` in which one rank kills itself.

Rank $DORMOUSE_TEST_KILL_RANK sends itself SIGKILL as it starts step
$DORMOUSE_TEST_KILL_AT_STEP (0-based), on torchrun's first launch only
(TORCHELASTIC_RESTART_COUNT = 0), so a `torchrun --max-restarts 1` fleet
restarts and must finish from its last checkpoint. The hook wraps the loop's
learning-rate lookup, which the loop calls once at the start of every step;
nothing in the library knows about it.

    torchrun --standalone --nproc_per_node=2 --max-restarts 1 tests/support/kill_rank_train.py train --dist ...
"""

from __future__ import annotations

import os
import signal
import sys

import dormouse.train.loop as loop
from dormouse.__main__ import main

_lr_at = loop.lr_at


def _lr_at_or_die(step: int, run):
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and os.environ.get("RANK") == os.environ["DORMOUSE_TEST_KILL_RANK"]
            and step == int(os.environ["DORMOUSE_TEST_KILL_AT_STEP"])):
        os.kill(os.getpid(), signal.SIGKILL)
    return _lr_at(step, run)


loop.lr_at = _lr_at_or_die

if __name__ == "__main__":
    sys.exit(main())
