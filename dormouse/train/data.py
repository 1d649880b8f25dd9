"""The corpus, and the one rule for which bytes a step reads.

A corpus is a file of bytes, memory-mapped and never read whole. One optimizer
step reads one contiguous global *span*; the span is cut into consecutive
slices, one per `RankShape` in rank order, and each slice into `batch` windows
of `seq_len + 1` bytes (inputs and next-byte targets). The shapes, the
micro-batch slices and the token counts of a step are one `FleetPlan`
(plan.py, re-exported here), made and validated once (the profile's syntax
and the rule "micro_batch divides every rank's batch" live there and nowhere
else). Which span step k reads
(TrainConfig.data_order, seed = TrainConfig.seed):

    n     = train_bytes // span          # whole spans in the training part
    epoch = k // n,  j = k % n
    sequential: index = j
    shuffle:    index = perm[j],  perm = torch.randperm(n, generator=
                    torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    step k's span starts at index * span

so each epoch visits every span exactly once (in a fresh seeded order when
shuffled), the order is a function of (seed, epoch, step) alone, a single
process at the global batch reads exactly the bytes of a fleet, and a resumed
run reads exactly the bytes the uninterrupted run would have read. The gate
re-implements this rule independently: change it in both places or neither.
An optional held-out tail (`eval_frac`) is never trained on.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from dormouse.config import DATA_ORDERS, TrainConfig
from dormouse.errors import DataError
from dormouse.train.plan import PROFILE_SYNTAX, FleetPlan, RankShape, rank_byte_offset, span_bytes  # noqa: F401


def whole_spans(span: int, train_bytes: int) -> int:
    """n, the number of whole spans in the training part (at least one)."""
    n = train_bytes // span
    if n == 0:
        raise DataError(
            f"the corpus's training part holds {train_bytes} bytes, less than one "
            f"global batch ({span} bytes): use a longer corpus or a smaller batch/seq_len"
        )
    return n


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of an epoch's n spans (see the module doc)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def step_span_start(step: int, span: int, train_bytes: int, order: str = TrainConfig.data_order,
                    seed: int = 0, *, cache: "EpochCache | None" = None) -> int:
    """Where step `step`'s span of `span` bytes starts (the module doc's rule).
    `cache` keeps the current epoch's permutation between calls."""
    n = whole_spans(span, train_bytes)
    if order == "sequential":
        return (step % n) * span
    _check_order(order)
    epoch = step // n
    perm = cache.get(n, seed, epoch) if cache is not None else epoch_permutation(n, seed, epoch)
    return int(perm[step % n]) * span


class EpochCache:
    """The permutation of the most recent epoch asked for: a step then costs
    no randperm, and an epoch boundary computes the next one once."""

    def __init__(self):
        self._key: tuple[int, int, int] | None = None
        self._perm: torch.Tensor | None = None

    def get(self, n: int, seed: int, epoch: int) -> torch.Tensor:
        if self._key != (n, seed, epoch):
            self._key, self._perm = (n, seed, epoch), epoch_permutation(n, seed, epoch)
        return self._perm


def _check_order(order: str) -> None:
    if order not in DATA_ORDERS:
        raise DataError(f"data order {order!r} is not one of {', '.join(map(repr, DATA_ORDERS))}")


def _windows(raw, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut `batch` windows of seq_len + 1 consecutive bytes from `raw` (bytes,
    a uint8 array or memoryview of exactly batch * (seq_len + 1) bytes) into
    inputs x and next-byte targets y, each (batch, seq_len) int64."""
    need = batch * (seq_len + 1)
    buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if buf.size != need:
        raise DataError(f"_windows needs {need} bytes for {batch} x ({seq_len} + 1), got {buf.size}")
    w = torch.from_numpy(np.array(buf, dtype=np.int64)).view(batch, seq_len + 1)  # (B, T+1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class ByteCorpus:
    """A memory-mapped byte file, split into a training head and an eval tail.

    order and seed choose which span each step reads (module doc); the
    permutation of the current epoch is kept, so a step costs no randperm."""

    def __init__(self, path: str | os.PathLike, eval_frac: float = 0.0, *,
                 order: str = TrainConfig.data_order, seed: int = 0):
        _check_order(order)
        self.order, self.seed = order, seed
        self._epochs = EpochCache()
        p = Path(path)
        if not p.exists():
            raise DataError(f"corpus file {str(p)!r} does not exist: pass --data with an existing file")
        if not p.is_file():
            raise DataError(f"corpus path {str(p)!r} is not a regular file")
        size = p.stat().st_size
        if size == 0:
            raise DataError(f"corpus file {str(p)!r} is empty: it needs at least one global batch of bytes")
        self.path = p
        self.bytes = np.memmap(p, dtype=np.uint8, mode="r")
        self.eval_bytes = int(size * eval_frac)
        self.train_bytes = size - self.eval_bytes

    def read(self, start: int, n: int) -> np.ndarray:
        """n bytes from `start` of the training part (copied out of the map)."""
        if start + n > self.train_bytes:
            raise DataError(f"read of {n} bytes at {start} runs past the training part ({self.train_bytes})")
        return np.array(self.bytes[start:start + n])

    def span_start(self, step: int, span: int) -> int:
        """Where step `step`'s span of `span` bytes starts (the module doc's rule)."""
        return step_span_start(step, span, self.train_bytes, self.order, self.seed, cache=self._epochs)

    def step_batch(self, step: int, shapes: list[RankShape], mine: list[int], windows: list[int] | None = None):
        """(x, y) of each slice in `mine` (indices into `shapes`) at step `step`.
        `windows`, when given, receives where each window read starts in the
        corpus, in order, from the offsets the reads used: the examples'
        identities (no two windows of one epoch start at the same byte,
        whatever their text)."""
        return self.span_batch(self.span_start(step, span_bytes(shapes)), shapes, mine, windows)

    def span_batch(self, start: int, shapes: list[RankShape], mine: list[int], windows: list[int] | None = None):
        """step_batch's windows for a span starting at byte `start` (what step_batch reads at its step's)."""
        out = []
        for r in mine:
            s = shapes[r]
            at = start + rank_byte_offset(shapes, r)
            out.append(_windows(self.read(at, s.nbytes), s.batch, s.seq_len))
            if windows is not None:
                windows.extend(at + i * (s.seq_len + 1) for i in range(s.batch))
        return out

    def epoch_of(self, step: int, span: int) -> int:
        """The epoch step `step` belongs to (an epoch reads each whole span once)."""
        return step // whole_spans(span, self.train_bytes)

    def eval_batches(self, batch: int, seq_len: int, max_windows: int = 64):
        """Consecutive windows of the held-out tail, in batches of at most `batch`."""
        n = min(self.eval_bytes // (seq_len + 1), max_windows)
        if n == 0:
            raise DataError(
                f"the held-out tail ({self.eval_bytes} bytes) is shorter than one window "
                f"({seq_len + 1} bytes): raise eval_frac or use a longer corpus"
            )
        tail = np.array(self.bytes[self.train_bytes:self.train_bytes + n * (seq_len + 1)])
        x, y = _windows(tail, n, seq_len)
        return list(zip(x.split(batch), y.split(batch)))


def builtin_corpus() -> bytes:
    """The corpus used when none is given: dormouse's own Python source, a few
    tens of kilobytes of real text that ships with the package (nothing is
    downloaded). Files are taken in sorted order so it is the same bytes for a
    given version of the package."""
    root = Path(__file__).resolve().parents[1]
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
