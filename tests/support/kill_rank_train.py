"""Test-only entry point: `dormouse train ...` in which one rank kills itself.

Rank $DORMOUSE_TEST_KILL_RANK sends itself SIGKILL as it starts step
$DORMOUSE_TEST_KILL_AT_STEP (0-based), on torchrun's first launch only
(TORCHELASTIC_RESTART_COUNT = 0), so a `torchrun --max-restarts 1` fleet
restarts and must finish from its last checkpoint. It is an `on_batch` hook
installed for every train() of the process (the loop calls it at the start of
every step, before any forward); nothing in the library knows about it.

    torchrun --standalone --nproc_per_node=2 --max-restarts 1 tests/support/kill_rank_train.py train --dist ...
"""

from __future__ import annotations

import os
import signal
import sys

from dormouse.__main__ import main
from dormouse.train.hooks import Hooks, install


def _die_at_the_step(batch) -> None:
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and os.environ.get("RANK") == os.environ["DORMOUSE_TEST_KILL_RANK"]
            and batch.step - 1 == int(os.environ["DORMOUSE_TEST_KILL_AT_STEP"])):
        os.kill(os.getpid(), signal.SIGKILL)


install(Hooks(on_batch=[_die_at_the_step]))

if __name__ == "__main__":
    sys.exit(main())
