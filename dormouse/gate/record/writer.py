"""The Recorder's writer: files written atomically, in order, on a thread of
its own, so the loop does not wait for serialisation or the disk."""

from __future__ import annotations

import queue
from pathlib import Path

import torch
from dormouse import atomic
from dormouse.gate.artifacts.tensorfile import write_streamed
from dormouse.gate.record.options import RecorderError


# A step's tensors are renamed into place without an fsync: a reader, or a process killed mid-write, sees the
# old file or the whole new one all the same; the fsync only guards against an operating-system crash (after
# which a torn file fails the intact check by its recorded hash), and at 124M parameters it was 2.75 of the
# 3.5 s a rank spent writing its 0.9 GB step (the disk, shared by the ranks, the slowest part of recording).
SYNC_TENSORS = False


class Writer:
    """Writes files atomically, in order, on a thread of its own: the loop does
    not wait for the serialisation or the disk (fsync). `data` is bytes, or a
    dict of tensors that the thread serialises (safetensors): the caller's
    own copies, taken before the optimizer changes the tensors, which nothing
    changes afterwards. An error is raised at the next write or at flush."""

    def __init__(self):
        import queue
        import threading

        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="dormouse-recorder-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    path, data = item
                    if path is None:  # a call (the step's hashes), in the queue's order
                        data()
                        continue
                    if callable(data):  # bytes made here, when the items before have run
                        data = data()
                    if isinstance(data, bytes):
                        atomic.write_bytes(path, data)
                    else:  # streamed from the tensors (no second copy of the step in memory), renamed into
                        held = sorted(data.items())  # place without an fsync: SYNC_TENSORS
                        write_streamed(path, [(k, v.dtype, tuple(v.shape)) for k, v in held], iter(held),
                                       sync=SYNC_TENSORS)
            except BaseException as e:  # handed to the loop's thread at the next call
                self.error = e
            finally:
                self.q.task_done()

    def _raise(self):
        if self.error is not None:
            e, self.error = self.error, None
            raise RecorderError(f"the Recorder could not write its files ({type(e).__name__}: {e})") from e

    def write(self, path: Path, data) -> None:
        """data: bytes, a dict of tensors (serialised here), or a callable giving bytes (called here)."""
        self._raise()
        self.q.put((path, data))

    def call(self, fn) -> None:
        """Run fn() on the writer's thread, after every write queued before it."""
        self._raise()
        self.q.put((None, fn))

    def flush(self) -> None:
        self.q.join()
        self._raise()

    def stop(self) -> None:
        self.q.put(None)
        self.thread.join()
