"""The check's memory budget (`dormouse gate check --memory GB`): what the
one process that makes the reference and judges may hold, by default a
share of the memory the machine has free. Before it starts, the check
estimates what the recording's model needs (the model, its gradient, the
optimizer's state, one recorded tensor set being read) and says "not judged:
needs N GB" when that is past the budget; while it runs, a watcher reads the
process's resident memory and stops the check with the same words when it
passes the budget, so that no check is ever killed by the kernel.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from dormouse.errors import DormouseError

GB = 1 << 30
DEFAULT_SHARE = 0.8  # of the memory available when the check starts
# the estimate, in parameter-sized tensors (float32 parameters): the model, its gradient, two optimizer moments
# (Adam's), one recorded tensor set being read, and a float64 gradient being combined
PARAMETER_COPIES = 6


# torch's CPU allocator on transparent huge pages when this is "1" in its environment before its first
# allocation (c10's alloc_cpu: 2 MB-aligned blocks of 2 MB or more, madvise(MADV_HUGEPAGE)); `gate check`
# sets it (gate/__main__.huge_pages)
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


class NotJudged(DormouseError):
    """The check cannot be made within its memory budget."""


def return_freed_memory() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim; a
    no-op elsewhere), between the check's passes and its steps. Where torch's
    allocator is not on huge pages (HUGE_PAGES unset: torch was imported
    before `gate check` could set it, as in a notebook; or the kernel's
    transparent huge pages are off), first send every block
    of 1 MB or more to a mapping of its own (M_MMAP_THRESHOLD): glibc keeps
    freed blocks below its dynamic threshold (up to 32 MB) in a heap that only
    grows, and the check's resident memory rose to twice what it held at
    GPT-2 small. On huge pages that is not so, and a mapping a block costs
    its time: each gradient-sized tensor the check allocates is then a fresh
    mapping that the kernel faults in and zeroes, 28% of the check's samples
    at a 125M Llama recording. Without the threshold (2 CPU threads, the same
    recordings): that Llama check 160 s -> 78 s, peak 4.81 -> 4.87 GB; GPT-2
    small 176 s -> 104 s, peak 4.53 -> 5.38 GB (one recorded rank: 5.08 GB)."""
    import os

    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        if os.environ.get(HUGE_PAGES) != "1" or not _kernel_huge_pages():
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _kernel_huge_pages() -> bool:
    """Whether the kernel grants transparent huge pages to a region that asks (its mode is not "never";
    the rule above was measured with them)."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def available() -> int:
    """Bytes the machine has available now (MemAvailable), or 0 where it cannot tell."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_budget() -> int:
    return int(DEFAULT_SHARE * available())


def resident() -> int:
    """This process's resident memory in bytes (0 where it cannot tell)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def parameter_bytes(out) -> int:
    """The recorded model's parameter bytes, from the initial state's file headers (no tensor read)."""
    from dormouse.gate import artifacts as A
    from dormouse.gate.artifacts.tensorfile import LazyTensors

    rec = A.RecordingSet(out)
    total = 0
    for r in range(rec.recorded.segments[0]["world"]):
        f = LazyTensors([A.init_path(out, r)], "initial state")
        for k in f:
            shape = f.shape(k)
            n = 1
            for s in shape:
                n *= s
            total += n * 4
        if not rec.recorded.fsdp:
            break  # every rank holds the whole model
    return total


def words(need: float, budget: float, what: str) -> str:
    return (f"not judged: needs {need / GB:.2g} GB ({what}); the budget is {budget / GB:.2g} GB (--memory, by "
            "default 80% of the memory available): give the check more memory, or check on a machine that has it")


def check_fits(out, budget: int) -> None:
    """Raise NotJudged when the estimate for the recording's model is past `budget` bytes."""
    need = PARAMETER_COPIES * parameter_bytes(out) + resident()
    if budget and need > budget:
        raise NotJudged(words(need, budget, f"about {PARAMETER_COPIES} x the model's parameters: the model, its "
                                            "gradient, the optimizer's state, a recorded step being read"))


@contextmanager
def watched(budget: int, every_s: float = 0.05):
    """Run the body while a thread watches this process's resident memory;
    past `budget` bytes it interrupts the body, which then raises NotJudged."""
    if not budget:
        yield
        return
    done, over = threading.Event(), []

    def watch():
        while not done.wait(every_s):
            now = resident()
            if now > budget:
                over.append(now)
                _thread.interrupt_main()
                return

    # interrupt_main does nothing where SIGINT is not handled by Python (ignored under nohup, or by a
    # launcher's workers): the main thread then handles it for the body's time, as Python does by default
    old = signal.getsignal(signal.SIGINT)
    own = threading.current_thread() is threading.main_thread() and old in (signal.SIG_IGN, signal.SIG_DFL, None)
    if own:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=watch, name="dormouse-memory-budget", daemon=True)
    t.start()
    try:
        yield
    except KeyboardInterrupt:
        if over:
            raise NotJudged(words(over[0], budget, "the check passed its budget while it ran")) from None
        raise
    finally:
        done.set()
        t.join()
        if own:
            signal.signal(signal.SIGINT, old)
