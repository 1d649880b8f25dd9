"""Data-parallel training on torch.distributed: a fleet of ranks that trains the
network one process would train at the global batch.

Rank r computes the mean loss L_r and gradient g_r over its own t_r tokens (its
slice of the step's span, as the fleet's FleetPlan in plan.py says; made once
by refuse_incompatible and held by the synchroniser). The fleet applies

    g = (t_0 g_0 + ... + t_{W-1} g_{W-1}) / (t_0 + ... + t_{W-1})

the gradient of the token-weighted mean loss over the global batch, exactly the
single process's gradient up to the order of summation. Ranks may carry
different batches ("4,2"): a plain mean of g_r would then over-weight the small
rank's tokens, which is why the weights are token counts (accelerate's and
torchtitan's token-weighted losses are the same rule). The loop backpropagates
L_r * t_r / T, so the fleet only SUMs:

- replicated (dist_shard="none"): gradients are flattened into buckets of
  dist_bucket_mb and all-reduced (SUM) in float32 or, with dist_reduce="bf16",
  in bfloat16 on the wire; buckets start during backward, in a fixed order,
  as soon as they and every bucket before them are complete (overlapping the
  rest of backward). Every parameter takes part on
  every rank (a missing gradient is a zero), so the collectives never depend on
  which experts a rank's tokens happened to choose.
- exact (dist_reduce="exact", replicated only): every slice of the global
  batch (micro-batches of train.micro_batch windows, numbered in rank order)
  keeps its own float32 gradient, and the fleet sums the N slices by the
  fixed pairwise tree of exact.py, the same function of N alone that LocalSync
  applies in one process: all_to_all_single gives rank c chunk c of every
  slice, rank c tree-sums it, all_gather returns the sums. So the result is
  bitwise the single process's over the same slices, at any world size and
  any profile with the same slices ("3,1" and "2,2" and one process at batch 4).
- sharded (dist_shard="fsdp"): FSDP2 `fully_shard` reduce-scatters the same SUM
  during backward (divide factor 1, sum-only reduction, unused parameters
  reduced as zeros); MixOptimizer gathers each hidden matrix for Newton-Schulz.
  With exact, one slice per rank: a custom reduce-scatter (all_to_all_single,
  then tree_sum over the W ranks' chunks) sums the ranks' slices by the tree;
  several slices per rank are refused, because FSDP2 adds a rank's
  micro-batches into its gradient with += before reduce-scattering (at world
  1, where a shard is the whole tensor, each slice's gradient is taken apart
  and the slices tree-summed as LocalSync does). The clipping norm is then
  computed from whole gathered gradients (loop.clip_grad_norm), in one
  process's order.

The logged loss sum_i t_i L_i / T and the MoE expert loads (which move the
routing bias) are summed the same way (exact: by the same tree over slices), so they are identical on every rank and
equal to the single process's.
"""

from __future__ import annotations

import functools
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dormouse.config import RunConfig, TrainConfig
from dormouse.errors import FleetError
from dormouse.train.data import FleetPlan, RankShape, rank_byte_offset
from dormouse.train.plan import refuse_config
from dormouse.train.hooks import Hooks, LocalGrads
from dormouse.train.exact import flat_grads, put_grads, split_stats, stats_row, tree_sum
from dormouse.train.loop import build_model, clip_grad_norm, train
from dormouse.train.tensors import fingerprint, named_state

__all__ = ["FleetPlan", "RankShape", "parse_capacity", "rank_byte_offset", "refuse_incompatible",
           "train_dist", "close_fleet", "FleetSync"]

def parse_capacity(capacity: str, *, world_size: int, cfg: TrainConfig, max_seq_len: int) -> list[RankShape]:
    """The per-rank shapes of a fleet's profile (FleetPlan.make, which owns
    the syntax: "" = cfg.batch windows of cfg.seq_len on every rank, else one
    "B" or "BxT" entry per rank, e.g. "4,2" or "4x32,2x64")."""
    return list(FleetPlan.make(capacity, world=world_size, batch=cfg.batch, seq_len=cfg.seq_len,
                               max_seq_len=max_seq_len).shapes)


def refuse_incompatible(run: RunConfig, *, world_size: int, model=None) -> FleetPlan:
    """Refuse, before any collective, every configuration under which the fleet
    would train a different network than one process; returns the fleet's plan
    (plan.refuse_config: the run's settings, and a malformed profile or
    micro-batch; here, a pre-built model that is not the run's)."""
    m = run.model
    plan = refuse_config(run, world_size)
    if model is not None:
        if m.bf16 and any(p.dtype != torch.bfloat16 for p in model.parameters() if p.is_floating_point()):
            raise FleetError(
                "model.bf16 is True but the pre-built model holds float32 parameters: build it and cast it "
                "before the fleet starts (model.to(torch.bfloat16)), the same way on every rank and in the "
                "reference, or pass model=None"
            )
        built = getattr(model, "cfg", None)
        if built is not None and built != m:
            diffs = [k for k in vars(m) if getattr(built, k, None) != getattr(m, k)]
            raise FleetError(
                f"the pre-built model was made from another ModelConfig (differs in "
                f"{', '.join(diffs[:4])}): build it from run.model"
            )
        if any(hasattr(p, "placements") for p in model.parameters()):
            raise FleetError("the pre-built model is already sharded: pass the plain model; train_dist shards it")
    return plan


class FleetSync:
    """The loop's gradient synchroniser for one rank of a fleet (see module doc).

    Replicated: parameters are cut into buckets of about bucket_mb, in REVERSE
    order (backward produces the output end's gradients first). Once `attach`
    has hooked the model, a bucket's collective starts during the backward of
    the rank's LAST slice as soon as that backward has delivered the bucket's
    last gradient, so communication overlaps the rest of backward (as DDP
    does). Buckets are always launched in index order, and the loss/loads
    collective after the last bucket, so every rank issues the same
    collectives in the same order whatever gradients it happens to have: a
    bucket holding a parameter without a gradient waits for `reduce`, which
    sends a zero in its place.

    The buckets and hooks are shared by both ways of combining:

    - fp32 / bf16: autograd accumulates the rank's slices in p.grad; each
      bucket is all-reduced (SUM) in the wire dtype, in the backend's order.
    - exact: after each slice but the last, `slice_done` takes every bucket's
      gradient into a float32 buffer of that slice (the last slice's is read
      from p.grad by the hook). A bucket of P values (padded to W*C) goes out
      by one all_to_all_single: rank c receives chunk c (C values) of every
      global slice, in global slice order, sums the N rows by `tree_sum`, and
      an all_gather returns the summed chunks to every rank. Per step and
      bucket a rank sends (n_r + 1) P (W-1)/W values and receives
      (N - n_r) P/W + P (W-1)/W (n_r its slices, N the fleet's): with one
      slice per rank, 2 P (W-1)/W each way, a ring all-reduce's bandwidth. The stats rows ([t_i L_i / T, loads_i]) are all-gathered and
      tree-summed the same way.
    """

    def __init__(self, plan: FleetPlan, rank: int, *, reduce: str, sharded: bool, bucket_mb: float):
        self.plan, self.mine = plan, [rank]
        self.rank, self.world_size, self.is_main = rank, plan.world, rank == 0
        self._step, self._step_hooks = 0, Hooks()
        self._names: dict[int, str] = {}
        self.sharded = sharded
        self.exact = reduce == "exact"
        self.wire = torch.bfloat16 if reduce == "bf16" else torch.float32
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.counts = plan.counts  # every rank's number of slices
        self.n_local = self.counts[rank]
        self._buckets: list[list[torch.Tensor]] = []
        self._arrived: list[int] = []  # gradients each bucket received in the current backward
        self._launched: list[tuple[torch.Tensor, object]] = []
        self._done = 0  # this step's slices whose backward has finished
        self._slices: list[list[torch.Tensor]] = []  # exact: per bucket, the finished slices' vectors
        self._stats: list[torch.Tensor] = []  # exact: the rank's slices' stats rows
        self._shard_slices: list[torch.Tensor] = []  # exact FSDP2 at world 1: the earlier slices' gradients
        self._hooks: list = []

    def attach(self, model) -> None:
        """Bucket the model's parameters and hook them for overlapped reduces
        (until `detach`: the model must not reach for the fleet afterwards)."""
        if self.sharded:
            return  # FSDP2 reduce-scatters during backward itself
        self._ensure_buckets(model)
        for i, bucket in enumerate(self._buckets):
            for p in bucket:
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_arrived, i)))

    def begin_step(self, step: int, hooks: Hooks) -> None:
        """Step `step` (from 1) starts; `hooks` are the ones to call during it."""
        self._step, self._step_hooks = step, hooks

    def _ensure_buckets(self, model) -> None:
        if not self._names:
            self._names = {id(p): n for n, p in model.named_parameters()}
        if not self._buckets:
            self._buckets = self._bucket([p for p in model.parameters() if p.requires_grad])
            self._arrived = [0] * len(self._buckets)
            self._slices = [[] for _ in self._buckets]

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def agree_on_start(self, start: int) -> None:
        """Every rank must resume at the same step (each reads the checkpoint
        from its own filesystem): otherwise they would run different numbers of
        collectives."""
        starts = [None] * self.world_size
        dist.all_gather_object(starts, start)
        if len(set(starts)) != 1:
            raise FleetError(
                f"ranks resumed at different steps {starts}: every rank must see the same "
                "checkpoint (a shared out_dir, or resume_from pointing at the same file)"
            )

    def slice_done(self, model, index: int, loss_part: torch.Tensor, loads: torch.Tensor) -> None:
        """One of this rank's slices has run its backward (exact: keep its
        gradient apart unless it is the last, whose buckets the hooks send)."""
        if self.exact:
            self._stats.append(stats_row(loss_part, loads))
            if self.sharded and self._done < self.n_local - 1:  # world 1 only (refuse_incompatible)
                self._take_shard_slice(model)
            if not self.sharded and self._done < self.n_local - 1:
                self._ensure_buckets(model)
                for i, bucket in enumerate(self._buckets):
                    self._slices[i].append(self._flatten(bucket, index))
                    for p in bucket:
                        p.grad = None  # the next slice's backward starts from nothing
        self._done += 1
        self._arrived = [0] * len(self._arrived)

    def _grad_arrived(self, i: int, _param) -> None:
        self._arrived[i] += 1
        if self._done != self.n_local - 1:
            return  # only the last slice's backward completes the rank's sum
        # Launch, in index order, every bucket whose gradients are all in.
        while (len(self._launched) < len(self._buckets)
               and self._arrived[len(self._launched)] == len(self._buckets[len(self._launched)])):
            self._launch(len(self._launched))

    def _launch(self, i: int) -> None:
        bucket = self._buckets[i]
        if not self.exact:
            flat = self._flatten(bucket, None)
            self._launched.append((flat, dist.all_reduce(flat, async_op=True)))
            return
        last = self.plan.first_slice(self.rank) + self.n_local - 1  # the slice p.grad holds now
        rows = torch.stack([*self._slices[i], self._flatten(bucket, last)])  # (n_local, P), global slice order
        self._slices[i] = []
        chunk = -(-rows.shape[1] // self.world_size)  # C: pad P to W * C
        rows = torch.nn.functional.pad(rows, (0, chunk * self.world_size - rows.shape[1]))
        send = rows.view(self.n_local, self.world_size, chunk).transpose(0, 1).reshape(-1)
        recv = torch.empty(sum(self.counts) * chunk, dtype=rows.dtype, device=rows.device)
        work = dist.all_to_all_single(recv, send, output_split_sizes=[n * chunk for n in self.counts],
                                      input_split_sizes=[self.n_local * chunk] * self.world_size, async_op=True)
        self._launched.append((recv, work))

    def _flatten(self, bucket: list[torch.Tensor], index: int | None) -> torch.Tensor:
        """One bucket's gradients as one wire-dtype vector (a missing one is zeros):
        every gradient this rank contributes, each slice's under exact, passes
        here, and the on_local_grads hooks see it (views into the vector sent)."""
        flat = flat_grads(bucket, self.wire)
        if self._step_hooks.on_local_grads:
            views, at = {}, 0
            for p in bucket:
                views[self._names[id(p)]] = flat[at:at + p.numel()].view(p.shape)
                at += p.numel()
            self._step_hooks.local_grads(LocalGrads(self._step, self.rank, index, views, self.plan))
        return flat

    def reduce(self, model, loss_share: torch.Tensor, loads: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Combine gradients (unless FSDP already did), the loss share and the loads."""
        if not self.sharded:
            self._ensure_buckets(model)  # not attached: no overlap, same collectives
            while len(self._launched) < len(self._buckets):
                self._launch(len(self._launched))
        if self._shard_slices:
            self._put_shard_tree(model)
        if self.exact:
            stats_work, stats = self._gather_stats()
            grads = self._exact_gradients()
        else:
            stats = stats_row(loss_share, loads)
            stats_work = dist.all_reduce(stats, async_op=True)
            grads = []
            for flat, work in self._launched:
                work.wait()
                grads.append(flat)
        for bucket, flat in zip(self._buckets, grads):
            put_grads(bucket, flat)
        stats_work.wait()
        if self.exact:
            stats = tree_sum(self._own_rows(stats))
        self._launched, self._arrived, self._done, self._stats = [], [0] * len(self._buckets), 0, []
        return split_stats(stats, loads)

    def _exact_gradients(self) -> list[torch.Tensor]:
        """Each bucket: tree-sum the received chunk of every slice, all-gather the sums."""
        gathers = []
        for bucket, (recv, work) in zip(self._buckets, self._launched):
            work.wait()
            mine = tree_sum(recv.view(sum(self.counts), -1))
            whole = torch.empty(mine.numel() * self.world_size, dtype=mine.dtype, device=mine.device)
            gathers.append((whole, dist.all_gather_single(whole, mine, async_op=True)))
        out = []
        for bucket, (whole, work) in zip(self._buckets, gathers):
            work.wait()
            out.append(whole[:sum(p.numel() for p in bucket)])
        return out

    def _gather_stats(self):
        """All-gather every rank's stats rows, padded to the most slices any rank has."""
        most = max(self.counts)
        rows = torch.stack(self._stats)
        rows = torch.nn.functional.pad(rows, (0, 0, 0, most - rows.shape[0]))
        out = torch.empty(self.world_size * most, rows.shape[1], dtype=rows.dtype, device=rows.device)
        return dist.all_gather_single(out, rows, async_op=True), out

    def _own_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """The gathered stats rows without padding: (N, 1 + loads), in global slice order."""
        most = max(self.counts)
        return torch.cat([gathered[r * most:r * most + n] for r, n in enumerate(self.counts)])

    def _bucket(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Parameters in reverse order, about bucket_bytes per bucket: the same on every rank."""
        buckets, cur, size = [], [], 0
        for p in reversed(params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes:
                buckets.append(cur)
                cur, size = [], 0
        if cur:
            buckets.append(cur)
        return buckets

    @staticmethod
    def _shard_grads(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(parameter, its gradient's local shard or None) per trainable
        parameter; at world 1 a shard is the whole tensor."""
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t
        return [(p, None if p.grad is None else local(p.grad)) for p in model.parameters() if p.requires_grad]

    def _take_shard_slice(self, model) -> None:
        """Exact FSDP2 at world 1: an earlier slice's gradient into a float32
        vector of its own (take_grads' layout), p.grad emptied for the next."""
        pairs = self._shard_grads(model)
        self._shard_slices.append(torch.cat([
            g.reshape(-1).float() if g is not None else
            torch.zeros((p.to_local() if hasattr(p, "to_local") else p).numel(), device=p.device)
            for p, g in pairs]))
        for p, _ in pairs:
            p.grad = None

    def _put_shard_tree(self, model) -> None:
        """The tree over the slices (the last one still in p.grad) back into p.grad."""
        self._take_shard_slice(model)
        total = tree_sum(torch.stack(self._shard_slices))
        self._shard_slices = []
        offset = 0
        for p in model.parameters():
            if not p.requires_grad:
                continue
            local = p.to_local() if hasattr(p, "to_local") else p
            g = total[offset:offset + local.numel()].view_as(local).to(local.dtype)
            offset += local.numel()
            p.grad = torch.zeros_like(p)
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).copy_(g)

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip to total norm max_norm; under the exact reduce with FSDP2 the
        norm of whole gathered gradients (one process's order, bitwise)."""
        return clip_grad_norm(params, max_norm, whole=self.exact and self.sharded)

    def barrier(self) -> None:
        dist.barrier()


def fleet_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    except KeyError as e:
        raise FleetError(
            f"{e.args[0]} is not set: train_dist runs under torchrun, e.g. "
            "python -m torch.distributed.run --standalone --nproc_per_node=2 -m dormouse.gate --mode rank ..."
        ) from None


def train_dist(run: RunConfig, *, log=print, device_type: str = "cpu", model=None, close: bool = True,
               on_step=None, on_grads=None, hooks: Hooks | None = None) -> dict:
    """Join the fleet described by torchrun's environment and run THE training
    loop with a gradient synchroniser. Returns the loop's report (which carries
    rank and world_size). With close=False the process group stays up (for
    gathering sharded parameters afterwards); call close_fleet() when done."""
    rank, world_size, local_rank = fleet_env()
    run.validate()
    plan = refuse_incompatible(run, world_size=world_size, model=model)
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise FleetError("device_type='cuda' but CUDA is not available: use device_type='cpu' (gloo)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    elif device_type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise FleetError(f"device_type = {device_type!r} is not one of 'cpu', 'cuda'")

    if not dist.is_initialized():
        _stop_quietly_on_sigterm()
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(minutes=5), **_attempt_store(rank, world_size), **kwargs)
    model = build_model(run) if model is None else model
    model.to(device)
    _check_identical(model, rank)

    if run.train.dist_shard == "fsdp":
        model = _shard(model, device_type, world_size, run.train.dist_reduce)
    sync = FleetSync(plan, rank, reduce=run.train.dist_reduce, sharded=run.train.dist_shard == "fsdp",
                     bucket_mb=run.train.dist_bucket_mb)
    sync.attach(model)
    if rank == 0:
        log(f"fleet: world_size={world_size} backend={backend} shard={run.train.dist_shard} "
            f"reduce={run.train.dist_reduce} | " + " | ".join(f"rank{r} {line}" for r, line in enumerate(plan.lines())))
    try:
        report = train(model, run, log, sync=sync, on_step=on_step, on_grads=on_grads, hooks=hooks)
    finally:
        sync.detach()
    report["model"] = model  # the (possibly sharded) model the fleet trained
    if close:
        close_fleet()
    return report


def _stop_quietly_on_sigterm() -> None:
    """A torchrun worker ends on SIGTERM as the signal's default does: the
    agent sends it to stop the other ranks when one has failed. A rank started
    as its own interpreter has that default already; a rank forked from the
    agent (launcher.FORKED_RANKS) inherits the agent's handler instead, which
    raises SignalException, so such a rank printed a traceback and reported
    itself crashed ("SignalException: Process N got signal: 15") beside the rank
    that did fail. Only in the main thread, where signal handlers are set."""
    import signal
    import threading

    if "TORCHELASTIC_RUN_ID" in os.environ and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _attempt_store(rank: int, world_size: int) -> dict:
    """init_process_group's store under torchrun: the agent's store, with this
    attempt's keys apart from a killed attempt's. torchrun (--max-restarts)
    restarts the workers on the SAME store, where the dead attempt's addresses
    still stand: a restarted rank could read its peer's stale address before
    the peer rewrites it and fail to connect (pytorch/pytorch#135712). Keys are
    therefore prefixed by TORCHELASTIC_RESTART_COUNT, which one agent keeps
    for all its workers. Outside torchrun: {} (init_process_group's own env://)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return {}
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timedelta(minutes=5)))
    return {"store": dist.PrefixStore(f"dormouse/attempt{attempt}/", store), "rank": rank, "world_size": world_size}


def _check_identical(model, rank: int) -> None:
    """Every rank must start from the same parameters: compare fingerprints."""
    mine = fingerprint(named_state(model))
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, mine)
    odd = [r for r, f in enumerate(prints) if f != prints[0]]
    if odd:
        raise FleetError(
            f"ranks {odd} start from different parameters than rank 0: seed identically "
            "(torch.manual_seed) before building the model on every rank, or pass model=None"
        )


def _shard(model, device_type: str, world_size: int, reduce: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    reduce_dtype = torch.bfloat16 if reduce == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.set_gradient_divide_factor(1.0)  # the loss already carries t_r / T: plain SUM
    model.set_force_sum_reduction_for_comms(True)
    model.set_reduce_scatter_unused_params(True)  # a missing gradient is a zero, never a skipped collective
    if reduce == "exact":
        model.set_custom_reduce_scatter(_tree_reduce_scatter())
    return model


def _tree_reduce_scatter():
    """FSDP2's reduce-scatter as the exact reduce over one slice per rank: an
    all_to_all_single gives rank c chunk c of every rank's gradient, in rank
    order, and rank c keeps their `tree_sum` (the tree over W slices that
    LocalSync applies to W micro-batches). Same bandwidth as a reduce-scatter."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class TreeReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            recv = torch.empty_like(input_tensor)
            dist.all_to_all_single(recv, input_tensor, group=group)
            output_tensor.copy_(tree_sum(recv.view(group.size(), -1)))
            return None

    return TreeReduceScatter()


def close_fleet(*, wait: bool = True) -> None:
    """Leave the fleet cleanly: wait for every rank, drop what holds the process
    group, destroy it. A gloo process that exits without this can abort in
    C++ teardown ("terminate called without an active exception").
    wait=False: a rank leaving on an error does not wait for its peers (they
    may be inside a collective this rank will never join: a barrier would
    hang them all); its exit ends their collective with an error instead."""
    if not dist.is_initialized():
        return
    if wait:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
