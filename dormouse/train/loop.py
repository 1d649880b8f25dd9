"""train(): THE training loop, for one process and for every rank of a fleet.

The global batch of a step is cut into slices, as the synchroniser's
FleetPlan (`sync.plan`, plan.py) says: each process's windows in
micro-batches of train.micro_batch windows (0 = all of them in one slice),
numbered in rank order, so rank r's slices follow every slice of the ranks
before it. One step, for the slices this process computes (all of them
alone, its own on a rank of a fleet):

    sync.begin_step(k, hooks)                   # the step's number and hooks (hooks.py)
    for each own slice i with t_i tokens and mean loss L_i:
        backward(L_i * t_i / T)                 # T = plan.tokens, the whole step's
        sync.slice_done(model, i, ...)          # exact: take g_i into a buffer of its own
    sync.reduce(...)                            # combine the slices' gradients (on_local_grads
                                                #   sees each contribution before it is read)
    hooks.on_reduced, on_grads                  # the combined gradient, before clipping
    clip, hooks.on_clipped                      # the gradient the optimizer applies
    step the optimizer, then move the routing bias by the step's expert loads

so every process ends the step holding g = sum_i t_i g_i / T, the gradient of the
token-weighted mean loss over the global batch (for one slice, t_i / T = 1 and
this is plain backward). The synchroniser decides the order of that sum:
fp32/bf16 let autograd accumulate a process's slices as a left chain and a
fleet all-reduce the result; "exact" sums the N slices' gradients, losses and
loads by one fixed pairwise tree over the slice index (exact.py), so the
result depends only on the global batch and micro_batch, never on the ranks.
The synchroniser is the only thing a fleet changes; it is passed in, and the
loop never asks what it is.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from dormouse import atomic
from dormouse.config import RunConfig
from dormouse.errors import CheckpointError, DivergedError
from dormouse.model import DormouseModel
from dormouse.train.checkpoint import checkpoint_path, find_checkpoint, load_checkpoint, save_checkpoint
from dormouse.clip import clip_coef
from dormouse.train.data import ByteCorpus, FleetPlan, builtin_corpus
from dormouse.train.hooks import Batch, Clipped, Evaluated, Hooks, LocalGrads, Reduced, Saved, Start, for_call
from dormouse.train.exact import put_grads, split_stats, stats_row, take_grads, tree_sum
from dormouse.train.optim import MixOptimizer


class LocalSync:
    """The synchroniser of a single process: the step's whole batch is its own,
    so there is nothing to exchange. A fleet's synchroniser (distributed.py)
    has the same attributes and methods.

    With run.train.dist_reduce == "exact" this is the exact reference: each
    slice's gradient is taken into a buffer of its own and the slices are
    summed by the fixed tree (exact.py), as an exact fleet sums them."""

    rank, world_size, is_main, sharded = 0, 1, True, False

    def __init__(self, run: RunConfig, plan: FleetPlan | None = None):
        # The step's slices: one batch, or micro-batches whose gradients the
        # loop accumulates with the same token weights a fleet would apply
        # (plan: another cut of the step, e.g. a fleet's, computed alone).
        self.plan = plan or FleetPlan.single(run.train)
        self.mine = list(range(self.plan.world))  # this process computes all of them
        self.exact = run.train.dist_reduce == "exact"
        self._grads: list[torch.Tensor] = []
        self._stats: list[torch.Tensor] = []
        self._step, self._hooks = 0, Hooks()

    def begin_step(self, step: int, hooks: Hooks) -> None:
        """Step `step` (from 1) starts; `hooks` are the ones to call during it."""
        self._step, self._hooks = step, hooks

    def _local(self, model, index: int | None) -> None:
        if self._hooks.on_local_grads:
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
            self._hooks.local_grads(LocalGrads(self._step, 0, index, grads, self.plan))

    def slice_done(self, model, index: int, loss_part: torch.Tensor, loads: torch.Tensor) -> None:
        """Slice `index` has run its backward (exact: keep its gradient apart)."""
        if self.exact:
            self._local(model, index)
            self._grads.append(take_grads(_trainable(model)))
            self._stats.append(stats_row(loss_part, loads))

    def reduce(self, model, loss_share: torch.Tensor, loads: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Gradients are already the global ones (exact: the tree of the slices'); returns (loss, loads)."""
        if not self.exact:
            self._local(model, None)
            return float(loss_share), loads
        put_grads(_trainable(model), tree_sum(torch.stack(self._grads)))
        stats = tree_sum(torch.stack(self._stats))
        self._grads, self._stats = [], []
        return split_stats(stats, loads)

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients to total norm max_norm; returns the norm (clip_grad_norm)."""
        return clip_grad_norm(params, max_norm)

    def barrier(self) -> None:
        pass

    def agree_on_start(self, start: int) -> None:
        """A fleet checks every rank resumed at the same step; alone, nothing to check."""


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, *, whole: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_: N = || (||g_1||, ..., ||g_n||) ||_2 over
    the parameters' gradients, then g <- g * min(1, max_norm / (N + 1e-6)).
    whole=True (FSDP2 under the exact reduce): N is computed from each
    gradient gathered whole (`full_tensor`), by the same function and in the
    same order as one process computes it, so it is bitwise one process's
    norm; the scale is then applied to each rank's own shard (elementwise,
    so bitwise too). FSDP2's own norm sums per-shard partial norms, another
    order (18 ulps off at step 1 on the gate's fixture)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not whole:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = torch.nn.utils.get_total_norm([g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads])
    coef = clip_coef(max_norm, norm)
    for g in grads:
        (g.to_local() if hasattr(g, "to_local") else g).mul_(coef.to(g.device))
    return norm


def _trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def build_model(run: RunConfig) -> DormouseModel:
    """The model a run starts from: seeded by train.seed, cast to bfloat16 if
    the model config asks for it."""
    torch.manual_seed(run.train.seed)
    model = DormouseModel(run.model)
    return model.to(torch.bfloat16) if run.model.bf16 else model


def make_optimizer(model, run: RunConfig) -> MixOptimizer:
    """The one optimizer construction (the loop and the gate's gradref share it)."""
    t = run.train
    return MixOptimizer(
        model, lr=t.lr, wd=t.wd, opt=t.opt, ns_steps=t.ns_steps, ns_kind=t.ns_kind,
        colrow_3d=t.muon_colrow_3d, muon_state_dtype=t.muon_state_dtype, ns_dtype=t.ns_dtype,
        ns_kernel=t.ns_kernel,
        muon_variant=t.muon_variant, muon_sf=t.muon_sf, momentum=t.muon_momentum,
        nesterov=t.muon_nesterov, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
    )


def lr_at(step: int, run: RunConfig) -> float:
    """Learning rate of step `step` (0-based): linear warm-up, then constant or
    cosine down to lr * min_lr_frac at the last step."""
    t = run.train
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    if t.schedule == "constant":
        return t.lr
    progress = (step - t.warmup) / max(1, t.steps - 1 - t.warmup)
    return t.lr * (t.min_lr_frac + (1 - t.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def resolve_corpus(run: RunConfig) -> Path:
    """The corpus file: train.data, or the built-in corpus written into out_dir."""
    if run.train.data:
        return Path(run.train.data)
    return atomic.write_if_changed(Path(run.train.out_dir) / "builtin_corpus.bin", builtin_corpus())


def _span_batch(corpus: ByteCorpus, start: int, plan, mine: list[int]) -> tuple[list, list[int]]:
    """hooks.Batch.read_at: this process's windows of a span starting at byte `start`, and where each starts."""
    windows: list[int] = []
    return corpus.span_batch(start, plan.shapes, mine, windows), windows


def train(model, run: RunConfig, log: Callable[[str], None] = print, *, sync=None,
          on_step: Callable[[int, object, dict], None] | None = None,
          on_grads: Callable[[int, object], None] | None = None, hooks: Hooks | None = None) -> dict:
    """Train `model` as `run` says; returns a report with every step's loss.

    sync: the gradient synchroniser (None = a single process). on_step, if
    given, is called after each optimizer step with (step, model, info) where
    info holds the step's global loss, loads, this process's top-k choices and
    the clip coefficient applied (1.0 when clipping is off or did not bind)
    and the gradient norm it was computed from (None when clipping is off).
    on_grads, if given, is called with (step, model) once the step's gradient
    is reduced, before clipping and the optimizer (the gate records it there).
    hooks: the explicit points of hooks.py (after the local gradient, after
    the reduce, after the step), with every hook `hooks.install`ed in this
    process before them; on_grads and on_step run after the hooks of their point.

    The step's shape is the synchroniser's FleetPlan (sync.plan): which
    slices this process computes, of how many windows, and the step's T.
    """
    run.validate()
    cfg = run.train
    sync = sync or LocalSync(run)
    plan = sync.plan
    hooks = for_call(hooks)
    try:
        atomic.check_writable(cfg.out_dir)
    except OSError as e:
        raise CheckpointError(
            f"out_dir {cfg.out_dir!r} is not writable ({e.strerror or e}): choose another out_dir"
        ) from e
    if run.model.bf16:
        model.to(torch.bfloat16)  # the run owns the cast (a fleet refuses a pre-built bf16 model)
    corpus = ByteCorpus(resolve_corpus(run), cfg.eval_frac, order=cfg.data_order, seed=cfg.seed)
    total_tokens = plan.tokens
    # Fail before any work if the corpus cannot hold one global batch.
    corpus.step_batch(0, plan.shapes, [])
    if cfg.steps and cfg.eval_every:
        corpus.eval_batches(cfg.batch, cfg.seq_len)

    opt = make_optimizer(model, run)
    ckpt = checkpoint_path(run, sync.sharded) if cfg.ckpt_every else None
    start = 0
    if cfg.resume or cfg.resume_from:
        path = find_checkpoint(run, sync.sharded)
        if path is not None:
            start = load_checkpoint(path, model=model, opt=opt, run=run, peers=sync)
            log(f"resumed from {path} at step {start}"
                + (f": nothing to do, train.steps is {cfg.steps}" if start >= cfg.steps else ""))
    sync.agree_on_start(start)
    hooks.started(Start(start, sync.rank, sync.world_size, model, run, plan))
    metrics = Path(cfg.out_dir) / f"{cfg.ckpt_name}.metrics.jsonl"
    if sync.is_main and start == 0 and metrics.exists():
        metrics.unlink(missing_ok=True)  # a fresh run starts a fresh log

    device = next(model.parameters()).device
    losses: list[float] = []
    evals: list[list] = []  # [step, eval loss] at every eval
    t0 = last_t = time.perf_counter()
    last_step = start
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps  # this launch's last step
    for step in range(start, end):
        lr = lr_at(step, run)
        opt.set_lr(lr)
        opt.zero_grad()
        sync.begin_step(step + 1, hooks)
        loss_share = torch.zeros((), dtype=torch.float64, device=device)
        loads = None
        topk = []
        windows: list[int] = []  # where each window read starts: the examples' identities (hooks.Reduced)
        batch = Batch(step + 1, sync.rank, corpus.step_batch(step, plan.shapes, sync.mine, windows), windows,
                      lambda k: corpus.step_batch(k - 1, plan.shapes, sync.mine),
                      lambda start: _span_batch(corpus, start, plan, sync.mine))
        hooks.batch(batch)
        for r, (x, y) in zip(sync.mine, batch.batches):
            m = plan.slice_batch(r)
            for j, (xs, ys) in enumerate(zip(x.split(m), y.split(m))):
                share = ys.numel() / total_tokens  # t_i / T
                _, loss, aux = model(xs.to(device), ys.to(device))
                (loss * share).backward()
                part = loss.detach().double() * share
                loss_share += part
                loads = aux["loads"] if loads is None else loads + aux["loads"]
                topk.append(aux["topk"])
                sync.slice_done(model, plan.first_slice(r) + j, part, aux["loads"])
        local_loads = loads
        loss_value, loads = sync.reduce(model, loss_share, loads)
        if not math.isfinite(loss_value):
            kept = f"the last good checkpoint {str(ckpt)!r} is kept" if ckpt and ckpt.exists() else "no checkpoint was written"
            raise DivergedError(
                f"loss is {loss_value} at step {step + 1}: training stopped before the bad "
                f"update; {kept}. Lower train.lr or set train.grad_clip"
            )
        reduced = Reduced(step + 1, sync.rank, model, loss_value, loads, local_loads, plan, float(loss_share),
                          batch.windows, corpus.epoch_of(step, plan.span), topk)
        hooks.reduced(reduced)
        loss_value, loads = reduced.loss, reduced.loads
        if on_grads is not None:
            on_grads(step + 1, model)
        coef, grad_norm = 1.0, None
        if cfg.grad_clip:
            norm = sync.clip([p for p in model.parameters() if p.grad is not None], cfg.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            coef = clip_coef(cfg.grad_clip, grad_norm)  # what clip_grad_norm_ multiplied by
        hooks.clipped(Clipped(step + 1, sync.rank, model, coef, grad_norm))
        opt.step()
        model.balance_experts(loads)
        losses.append(loss_value)
        info = {"loss": loss_value, "loads": loads, "topk": topk, "clip_coef": coef, "grad_norm": grad_norm}
        hooks.stepped(step + 1, model, info)
        if on_step is not None:
            on_step(step + 1, model, info)

        done = step + 1
        if done % cfg.log_every == 0 or done == end:
            now = time.perf_counter()
            tps = total_tokens * (done - last_step) / max(now - last_t, 1e-9)
            last_t, last_step = now, done
            log(f"step={done}/{cfg.steps} loss={loss_value:.7f} lr={lr:.3e} tok/s={tps:.0f}")
            if sync.is_main:
                with open(metrics, "a") as f:
                    f.write(json.dumps({"step": done, "loss": loss_value, "lr": lr, "tokens_per_s": tps}) + "\n")
        if cfg.eval_every and done % cfg.eval_every == 0:
            ev = Evaluated(done, sync.rank, evaluate(model, corpus, run))
            hooks.evaluated(ev)
            evals.append([done, ev.loss])
            log(f"eval step={done} loss={evals[-1][1]:.7f}")
        if ckpt is not None and (done % cfg.ckpt_every == 0 or done == end):
            written = save_checkpoint(ckpt, model=model, opt=opt, step=done, run=run, peers=sync)
            hooks.saved(Saved(done, sync.rank, written, sync))

    wall = time.perf_counter() - t0
    steps_run = end - start
    report = {
        "rank": sync.rank,
        "world_size": sync.world_size,
        "start_step": start,
        "steps": cfg.steps,
        "losses": losses,
        "evals": evals,
        "final_loss": losses[-1] if losses else None,
        "tokens_per_step": total_tokens,
        "wall_s": wall,
        "tokens_per_s": total_tokens * steps_run / wall if wall > 0 else 0.0,
        "checkpoint": str(ckpt) if ckpt else None,
    }
    hooks.ended(report)
    return report


@torch.no_grad()
def evaluate(model, corpus: ByteCorpus, run: RunConfig) -> float:
    """Token-mean loss over the held-out tail (every process computes the same).
    The model is in eval mode meanwhile (the network has no train/eval
    difference; a Recorder's forward hook takes only training forwards)."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        for x, y in corpus.eval_batches(run.train.batch, run.train.seq_len):
            _, loss, _ = model(x.to(device), y.to(device))
            total += float(loss) * y.numel()
            count += y.numel()
    finally:
        model.train(was)
    return total / count
