"""dormouse.errors: how a process ends. (The one-line messages and statuses
of every command are tested with the commands: test_cli, tests/gate.)"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

from dormouse.errors import end_rank_process

# A module-level object whose finaliser prints: the interpreter's module
# teardown calls it, os._exit does not.
PROGRAM = """
import atexit, sys
from dormouse.errors import end_rank_process

class Teardown:
    def __del__(self):
        print("module teardown ran")

t = Teardown()
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("left in the buffer; ")
sys.stderr.write("stderr left in the buffer")
end_rank_process(3)
print("returned: not a rank")
"""


def _run(env: dict) -> subprocess.CompletedProcess:
    # A real interpreter, not the suite's warm one (tests/support/warm.py: its children end without teardown).
    return subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120,
                          env={**env, "DORMOUSE_TEST_WARM": "0"})


def test_a_rank_in_an_interpreter_of_its_own_ends_at_its_status_without_teardown_after_atexit_and_flush():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    rank = _run({**env, "WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RUN_ID": "test"})
    assert rank.returncode == 3, rank.stderr
    assert rank.stdout == "left in the buffer; atexit ran\n"  # flushed, atexit run, no teardown, not returned
    assert rank.stderr.endswith("stderr left in the buffer")
    expected = "left in the buffer; returned: not a rank\natexit ran\nmodule teardown ran\n"
    for not_torchrun in (env, {**env, "WORLD_SIZE": "2"}):  # a cluster wrapper's WORLD_SIZE alone is not torchrun
        other = _run(not_torchrun)  # returns, and the interpreter ends as usual
        assert other.returncode == 0 and other.stdout == expected, other.stderr


def _forked_rank(q) -> None:
    os.environ["WORLD_SIZE"], os.environ["TORCHELASTIC_RUN_ID"] = "2", "test"
    end_rank_process(0)
    q.put("returned to the parent's multiprocessing")


def test_a_rank_forked_by_multiprocessing_returns_to_its_parent():
    """torchrun's forked ranks (--start-method fork) are multiprocessing's
    children: the agent collects their return, so they are left to it."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_rank, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == "returned to the parent's multiprocessing" and p.exitcode == 0
