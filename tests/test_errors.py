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
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    rank = _run({**env, "WORLD_SIZE": "2", "RANK": "1"})
    assert rank.returncode == 3, rank.stderr
    assert rank.stdout == "left in the buffer; atexit ran\n"  # flushed, atexit run, no teardown, not returned
    assert rank.stderr.endswith("stderr left in the buffer")
    other = _run(env)  # not a torchrun rank: returns, and the interpreter ends as usual
    assert other.returncode == 0, other.stderr
    assert other.stdout == "left in the buffer; returned: not a rank\natexit ran\nmodule teardown ran\n"


def _forked_rank(q) -> None:
    os.environ["WORLD_SIZE"] = "2"
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
