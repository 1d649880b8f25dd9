"""The corpus, the one rule for which bytes a step reads, and the fleet's plan.

A corpus is a file of bytes, memory-mapped and never read whole. One optimizer
step reads one contiguous global *span*; the span is cut into consecutive
slices, one per `RankShape` in rank order, and each slice into `batch` windows
of `seq_len + 1` bytes (inputs and next-byte targets). The shapes, the
micro-batch slices and the token counts of a step are one `FleetPlan`, made
and validated once (the profile's syntax and the rule "micro_batch divides
every rank's batch" live there and nowhere else). Which span step k reads
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
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dormouse.config import DATA_ORDERS, RunConfig, TrainConfig
from dormouse.errors import DataError, PlanError


@dataclass(frozen=True)
class RankShape:
    """The work of one rank (or one micro-batch) in a step: `batch` windows of
    `seq_len` tokens."""

    batch: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def nbytes(self) -> int:
        """Bytes this slice reads: each window needs one extra byte of target."""
        return self.batch * (self.seq_len + 1)

    def line(self) -> str:
        return f"batch={self.batch} seq_len={self.seq_len} tokens={self.tokens}"


PROFILE_SYNTAX = ("'' (the batch on every rank) or one comma-separated entry per rank, each 'B' or 'BxT' "
                  "with positive whole numbers (e.g. '4,2' or '4x32,2x64')")
_ENTRY = re.compile(r"^([0-9]+)(?:x([0-9]+))?$")  # ASCII digits only


@dataclass(frozen=True)
class FleetPlan:
    """The fleet's shape: THE one owner of the profile, the micro-batch, the
    slices and the token counts of a step. Made once (`make`, `of_run`,
    `single`) and valid by construction: every FleetPlan that exists passed
    the checks in `__post_init__`.

    Rank r reads `shapes[r]`: batch_r windows of seq_len_r tokens. With
    micro_batch m > 0 it computes them in slices of m windows (m divides
    batch_r), with m = 0 in one slice of its whole batch, so

        counts[r]   = batch_r / m            (1 when m = 0)
        first(r)    = counts[0] + ... + counts[r-1]   (global index of its first slice)
        tokens T    = sum_r batch_r * seq_len_r
        span        = sum_r batch_r * (seq_len_r + 1)   bytes one step reads
        offset(r)   = sum_{q<r} batch_q * (seq_len_q + 1)

    and the global batch (one process reading exactly the fleet's bytes) is
    sum_r batch_r when every rank has the same window length (None otherwise).
    """

    shapes: tuple[RankShape, ...]
    micro_batch: int = 0  # windows per forward/backward slice (0 = each rank's whole batch)
    profile: str = ""  # the normalised profile text the shapes came from ("" = batch on every rank)
    counts: tuple[int, ...] = field(init=False)  # slices per rank

    def __post_init__(self):
        object.__setattr__(self, "shapes", tuple(self.shapes))
        if not self.shapes:
            raise PlanError("world", 0, "a fleet needs at least one rank")
        m = self.micro_batch
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise PlanError("micro_batch", m, "it must be a whole number >= 0 (0 = each rank's whole batch)")
        batches = [s.batch for s in self.shapes]
        if m and any(b % m for b in batches):
            raise PlanError("micro_batch", m, f"it does not divide every rank's batch ({', '.join(map(str, batches))}): "
                            "choose a divisor of every rank's batch, or 0 for each rank's whole batch")
        object.__setattr__(self, "counts", tuple(b // m if m else 1 for b in batches))

    # ------------------------------------------------------------------ making

    @classmethod
    def make(cls, profile: str, *, world: int, batch: int, seq_len: int, micro_batch: int = 0,
             max_seq_len: int | None = None) -> "FleetPlan":
        """Parse a profile: "" gives every one of `world` ranks `batch` windows
        of `seq_len`; otherwise one comma-separated entry per rank, in rank
        order, "B" (B windows of seq_len) or "BxT" (B windows of T tokens),
        e.g. "4,2" or "4x32,2x64"; T at most max_seq_len."""
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise PlanError("world", world, "a fleet needs at least one rank")
        if not isinstance(profile, str):
            raise PlanError("profile", profile, f"it must be {PROFILE_SYNTAX}")
        entries = [e.strip() for e in profile.split(",")] if profile.strip() else []
        if not entries:
            return cls((RankShape(batch, seq_len),) * world, micro_batch, "")
        if len(entries) != world:
            raise PlanError("profile", profile, f"it has {len(entries)} entries but world = {world}: "
                            f"it must be {PROFILE_SYNTAX}")
        shapes = []
        for r, e in enumerate(entries):
            m = _ENTRY.match(e)
            if not m:
                raise PlanError("profile", profile, f"rank {r}'s entry {e!r} is not a batch size; it must be "
                                f"{PROFILE_SYNTAX}")
            b, t = int(m.group(1)), int(m.group(2) or seq_len)
            if b < 1 or t < 1:
                raise PlanError("profile", profile, f"rank {r}'s entry {e!r} must be positive; it must be "
                                f"{PROFILE_SYNTAX}")
            if max_seq_len is not None and t > max_seq_len:
                raise PlanError("profile", profile, f"rank {r}'s seq_len {t} exceeds the model's max_seq_len "
                                f"{max_seq_len}: shorten that rank's windows")
            shapes.append(RankShape(b, t))
        return cls(tuple(shapes), micro_batch, ",".join(entries))

    @classmethod
    def single(cls, cfg: TrainConfig) -> "FleetPlan":
        """One process at cfg.batch windows of cfg.seq_len, in micro-batches of cfg.micro_batch."""
        return cls((RankShape(cfg.batch, cfg.seq_len),), cfg.micro_batch)

    @classmethod
    def of_run(cls, run: RunConfig, world: int = 1) -> "FleetPlan":
        """The plan a run trains with: a fleet's (train.dist) from its profile
        over `world` ranks, one process's from its batch."""
        t = run.train
        if not t.dist:
            return cls.single(t)
        return cls.make(t.dist_profile, world=world, batch=t.batch, seq_len=t.seq_len, micro_batch=t.micro_batch,
                        max_seq_len=run.model.max_seq_len)

    def evenly(self, world: int) -> "FleetPlan":
        """The same global batch split evenly over `world` ranks (a fleet that
        resumes at another world size), with the same micro-batch."""
        gb = self.global_batch
        if gb is None:
            raise PlanError("world", world, "the profile mixes window lengths, so no even split holds its global batch")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1 or gb % world:
            raise PlanError("world", world, f"the global batch of {gb} windows does not split evenly over it")
        seq = self.shapes[0].seq_len
        return FleetPlan.make(",".join([f"{gb // world}x{seq}"] * world), world=world, batch=gb // world,
                              seq_len=seq, micro_batch=self.micro_batch)

    # ------------------------------------------------------------------ derived

    @property
    def world(self) -> int:
        return len(self.shapes)

    @property
    def tokens(self) -> int:
        """T, the tokens of one step over all ranks."""
        return sum(s.tokens for s in self.shapes)

    @property
    def span(self) -> int:
        """Bytes one step reads over all ranks."""
        return span_bytes(self.shapes)

    @property
    def mixed_lengths(self) -> bool:
        """Whether ranks' windows differ in length (no one batch holds them)."""
        return len({s.seq_len for s in self.shapes}) != 1

    @property
    def windows(self) -> int:
        """Windows of one step over all ranks."""
        return sum(s.batch for s in self.shapes)

    @property
    def global_batch(self) -> int | None:
        """The single process's batch (it reads exactly the fleet's bytes), or
        None when window lengths mix."""
        return None if self.mixed_lengths else self.windows

    @property
    def n_slices(self) -> int:
        """N, the slices of one step over all ranks."""
        return sum(self.counts)

    def slice_batch(self, r: int) -> int:
        """Windows in each of rank r's slices."""
        return self.micro_batch or self.shapes[r].batch

    def first_slice(self, r: int) -> int:
        """Global index of rank r's first slice: slices are numbered in rank order."""
        return sum(self.counts[:r])

    def rank_byte_offset(self, r: int) -> int:
        """Where rank r's slice starts inside a step's span."""
        return rank_byte_offset(self.shapes, r)

    def exact_slice(self) -> int:
        """The windows per slice of one process that computes this fleet's own
        slices as micro-batches: micro_batch, or with 0 the ranks' common batch
        (an uneven profile has none)."""
        if self.micro_batch:
            return self.micro_batch
        batches = {s.batch for s in self.shapes}
        if len(batches) != 1:
            raise PlanError("micro_batch", 0, f"reduce 'exact' with the uneven profile {self.profile!r} needs "
                            "micro_batch > 0: one process computes the fleet's own slices only when they are "
                            "one size, so give micro_batch a divisor of every rank's batch (e.g. 1)")
        return batches.pop()

    def lines(self) -> list[str]:
        """One description per rank (RankShape.line)."""
        return [s.line() for s in self.shapes]


def span_bytes(shapes: list[RankShape]) -> int:
    """Bytes one step reads over all slices."""
    return sum(s.nbytes for s in shapes)


def rank_byte_offset(shapes: list[RankShape], r: int) -> int:
    """Where slice r starts inside a step's span: after the slices of ranks < r."""
    return sum(s.nbytes for s in shapes[:r])


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
