"""The fleet's plan: each rank's shape in a step (`RankShape`), the micro-batch
slices and the token counts, made and validated once (`FleetPlan`: the
profile's syntax and the rule "micro_batch divides every rank's batch" live
here and nowhere else), and where each slice sits in a step's span of bytes
(data.py reads them). Plain arithmetic, no torch: the gate validates a fleet's
settings, and launches it, before anything imports torch."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dormouse.config import RunConfig
from dormouse.errors import FleetError, PlanError


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


def refuse_config(run: RunConfig, world_size: int) -> FleetPlan:
    """The fleet's refusals that its settings alone decide (distributed.refuse_incompatible adds a
    pre-built model's): every configuration under which the fleet would train a different network
    than one process, before any collective; returns the fleet's plan (FleetPlan.of_run: a malformed
    profile or micro-batch is refused there)."""
    m, t = run.model, run.train
    if not t.dist:
        raise FleetError("train.dist is False: set it to True for a fleet run (train_dist)")
    if m.moe_on and m.moe_capacity > 0:
        raise FleetError(
            f"model.moe_capacity = {m.moe_capacity}: a capacity-dropping MoE drops assignments "
            "by a rule that depends on which windows share a batch, so a fleet's split batch "
            "is a different network. Use moe_capacity = 0 (dropless) for data-parallel runs"
        )
    plan = FleetPlan.of_run(run, world_size)
    # (at world 1 a shard is the whole tensor: FleetSync tree-sums the slices itself)
    if t.dist_reduce == "exact" and t.dist_shard == "fsdp" and world_size > 1 and max(plan.counts) > 1:
        raise FleetError(
            f"train.dist_reduce = 'exact' with dist_shard = 'fsdp' and micro_batch = {t.micro_batch} gives a "
            "rank several slices, which FSDP2 adds with += before its reduce-scatter, off the fixed slice "
            "tree: use micro_batch = 0 (one slice per rank), or dist_shard = 'none' for micro-batches"
        )
    # Every FSDP2 forward and backward is a collective (all-gather, reduce-scatter) of all ranks:
    # a rank with more slices than another waits for it in a gather that never comes.
    if t.dist_shard == "fsdp" and world_size > 1 and len(set(plan.counts)) > 1:
        counts = ", ".join(f"rank {r} {c}" for r, c in enumerate(plan.counts))
        raise FleetError(
            f"dist_shard = 'fsdp' with micro_batch = {t.micro_batch} gives the ranks different numbers of "
            f"slices ({counts}), and every FSDP2 forward and backward is a collective of all ranks: use "
            "micro_batch = 0 (one slice per rank), a micro-batch that cuts every rank's batch into as many "
            "slices, or dist_shard = 'none'"
        )
    return plan


