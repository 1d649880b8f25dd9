"""The check's memory budget (dormouse/gate/budget.py): a body that passes it is stopped with the budget's words,
not left to the kernel."""

from __future__ import annotations

import time

import pytest
import torch

from dormouse.gate import budget as B


@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_a_body_that_grows_past_its_budget_is_stopped_in_one_line(sigint):
    """Also where SIGINT is ignored (a check under nohup, a launcher's worker), where Python's
    interrupt_main does nothing unless the watch installs Python's handler for the body's time."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler)
    try:
        _grows_past_its_budget()
    finally:
        signal.signal(signal.SIGINT, before)
    assert signal.getsignal(signal.SIGINT) is before


def _grows_past_its_budget():
    start = B.resident()
    assert start > 0  # /proc/self/statm read
    held = []
    with pytest.raises(B.NotJudged) as e:
        with B.watched(start + (200 << 20)):
            t0 = time.time()
            # 50 MB a time, each touched (ones, not empty), at most 3 GB, for up to a minute (a loaded machine
            # may leave the watcher's thread unscheduled for seconds)
            while time.time() - t0 < 60 and len(held) < 60:
                held.append(torch.ones(50 << 18))
                time.sleep(0.01)
    grown = sum(t.numel() * 4 for t in held)
    assert 100 << 20 < grown < 3 << 30, grown  # stopped soon after the budget (torch's own start counts too)
    assert str(e.value).startswith("not judged: needs ") and "\n" not in str(e.value)


def test_a_body_within_its_budget_runs_to_its_end():
    with B.watched(B.resident() + (1 << 30)):
        x = torch.ones(1 << 20).sum()
    assert float(x) == 1 << 20
