"""dormouse's own trainer as a client of the Recorder (record/recorder.py):
one recording format and one judge for every loop, this one included.

    rec = LoopRecorder(out_dir)                  # e.g. `dormouse train --out DIR --record`
    train(model, run, hooks=rec.hooks())         # or train_dist(run, hooks=rec.hooks())

It enters train() only through its explicit hooks (dormouse.train.hooks):

    on_start    builds the Recorder on the module the loop calls (an FSDP2
                module's local shards under sharding), so its forward pre-hook
                sees every training forward and its init is the state before
                the first step this call trains (resumed: a new segment after
                the checkpoint's step, in the same directory)
    on_reduced  the step's global token-weighted loss (the loop's reported loss),
                and where each window this process read starts in the corpus
                and the data's epoch (Reduced.examples, .epoch): the data
                check's exact example ids and the loop's own epochs, so text
                that repeats in the corpus is not taken for a window read
                twice; the ids are checked against the corpus's bytes
                (RecordingSpec(example_corpus=...)), not taken on trust
    on_clipped  rec.step(loss, lr, clip_coef, grad_norm, example_ids, epoch): the gradient the
                optimizer is about to apply, after the loop's clipping
                (max_grad_norm = train.grad_clip; the loop's own norm and
                coefficient are passed, so the Recorder takes the gradient as
                clipped: the replay steps on exactly what the optimizer
                applied, the gradient check divides by clip_coef, the clip
                check compares the loop's norm with one process's). Under
                FSDP2 the loop's norm sums per-shard partial norms in another
                order than one process (ulps), which a replay that re-clipped
                would carry through Muon's Newton-Schulz to 1e-4; lr =
                lr_at(step) (the loop's one schedule)
    on_end      rec.close() (every rank: it synchronises)

How one process rebuilds the run (build_kwargs = {"run": the RunConfig as a
dict}; a run continued from a checkpoint of another run and recorded afresh
(LoopRecorder(fresh=True)) adds "checkpoint" and "start", its steps done):

    build_model      loop.build_model(run): seeded by train.seed, the same init
                     (with a checkpoint: its weights, read whole)
    build_optimizer  MixOptimizer (Muon for hidden matrices, AdamW for the rest;
                     loop.make_optimizer) behind an optimizer's interface
                     (step, zero_grad, param_groups; with a checkpoint: its
                     state), and the loop's lr schedule: lr of step k (0-based)
                     = lr_at(k, run), counting from `start`
    objective        next_byte: the model's loss, a token mean of next-byte
                     cross-entropy over the GLOBAL batch, declared as
                     loss_sum(b) = sum_{i,t} CE(z_{i,t}, y_{i,t}), count(b) = |y|,
                     z = model(x) logits, (x, y) = the forward's positional
                     (arg0, arg1): targets already aligned (the built-in
                     "token_mean" reads a "labels" keyword, which dormouse's
                     forward(x, y) does not take)

State outside the optimizer: the MoE's routing bias (a buffer) moves after
every step by b += rate * sign(mean(load) - load) from the step's global
expert loads. It changes which experts each token chooses, so the
one-process gradient at step k must be taken at the fleet's bias before k:
the Recorder stores the model's persistent buffers (A.BUFFER, full-tensor steps,
and after the last) and the reference loads them with the parameters. The
replay of the optimizer does not need the bias (it steps on the recorded
gradients); the bias's own update is the recording's declared buffer_update,
`routing_bias_update` below, when the bias moves (moving_bias): the
reference counts the loads in one process over every rank's recorded
micro-batches at the recorded state before each step and applies the
documented rule, and the verdict's "buffers" check holds the recorded bias
before the next step to it bitwise.
Engram memory is parameters only (its hash multipliers are a constant,
non-persistent buffer): the optimizer and the gradient check cover it.

Beside what every recording holds, for dormouse's own gate: each step's
expert choices of this rank's tokens (x/topk: a routing flip explains where
two runs part), the loop's evals and the gate's settings and provenance
(recording.json's "extra"). gradref (the data rule's bytes by its own
arithmetic), the single process and the exact reference are the gate's own
references (record/modes/), written into the recording's reference folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from dormouse.config import RunConfig
from dormouse.gate import artifacts as A
from dormouse.gate.record.options import RecorderError
from dormouse.gate.record.recorder import Recorder, RecordingSpec
from dormouse.train import loop
from dormouse.train.hooks import Clipped, Evaluated, Hooks, Reduced, Start

HERE = __name__
BUILD_MODEL = f"{HERE}:build_model"
BUILD_OPTIMIZER = f"{HERE}:build_optimizer"
OBJECTIVE = f"{HERE}:next_byte"
BUFFER_UPDATE = f"{HERE}:routing_bias_update"
BIAS = "block.moe.router_bias"


def _run(run) -> RunConfig:
    return run if isinstance(run, RunConfig) else RunConfig.from_dict(run)


_BUILD_HOOKS: list = []


def install_build_hook(hook: Callable[[torch.nn.Module], None]) -> Callable[[], None]:
    """Add `hook` to every model build_model rebuilds in this process (the
    recording's one-process reference): hook(model) right after its seeded
    build. The seam for a change to the network itself that the reference
    must see as the fleet does (a test's planted batch statistic, beside
    modes.install_model_hook); nothing here installs one. Returns the
    function that removes it."""
    _BUILD_HOOKS.append(hook)
    return lambda: _BUILD_HOOKS.remove(hook)


def _built(run: RunConfig) -> torch.nn.Module:
    model = loop.build_model(run)
    for hook in _BUILD_HOOKS:
        hook(model)
    return model


def build_model(run: dict, checkpoint: str | None = None, **_) -> torch.nn.Module:
    """The run's initial model in a fresh process (loop.build_model), or the
    checkpoint's weights it continued from."""
    if checkpoint is None:
        return _built(_run(run))
    from dormouse.train.checkpoint import load_model_weights

    return load_model_weights(Path(checkpoint), build=lambda r: _built(_run(run)))[0]


class MixAsOptimizer:
    """loop.make_optimizer's MixOptimizer behind the interface the replay steps (rebuild.build_optimizer):
    one param group whose "lr" the schedule sets; step() hands it to MixOptimizer.set_lr and steps (the
    very update the loop applies). Not a torch.optim.Optimizer: constructing one imports torch._dynamo
    (torch/_compile.py's _disable_dynamo, on add_param_group), seconds of CPU on the verdict's path, for an
    interface nothing here uses."""

    def __init__(self, model: torch.nn.Module, run: RunConfig):
        self.mix = loop.make_optimizer(model, run)
        self.param_groups = [{"params": list(model.parameters()), "lr": run.train.lr}]

    @torch.no_grad()
    def step(self, closure=None):
        self.mix.set_lr(self.param_groups[0]["lr"])
        self.mix.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mix.zero_grad()

    def state_dict(self):
        return self.mix.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.mix.load_state_dict(state_dict)


class LoopSchedule:
    """The loop's schedule: the lr of step k (0-based) is lr_at(k, run), the first step being `start` (the
    steps a checkpoint had done). Set on the optimizer's group at construction and at every step(), as an
    LRScheduler sets it (its first step() is its construction's)."""

    def __init__(self, optimizer: MixAsOptimizer, run: RunConfig, start: int = 0):
        self.optimizer, self.run, self.start, self.last_epoch = optimizer, run, start, -1
        self.step()

    def step(self) -> None:
        self.last_epoch += 1
        for group in self.optimizer.param_groups:
            group["lr"] = loop.lr_at(self.start + self.last_epoch, self.run)


def build_optimizer(model: torch.nn.Module, run: dict, checkpoint: str | None = None, start: int = 0, **_):
    """(optimizer, scheduler) as the loop steps them, for `model` (with a
    checkpoint: its optimizer state, and the schedule from step `start`)."""
    run = _run(run)
    opt = MixAsOptimizer(model, run)
    if checkpoint is not None:
        from dormouse.train.checkpoint import load_checkpoint

        alone = dataclasses.replace(run, train=dataclasses.replace(run.train, dist=False, dist_profile="",
                                                                   micro_batch=0))  # read in one process
        load_checkpoint(Path(checkpoint), model=model, opt=opt.mix, run=alone, peers=loop.LocalSync(alone))
    return opt, LoopSchedule(opt, run, start)


def next_byte(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The declared objective of one micro-batch: (sum of next-byte
    cross-entropies, number of targets), from the logits of model(x) against
    the aligned targets y; x, y are the forward's positional arguments."""
    if "arg0" not in batch or "arg1" not in batch:
        raise RecorderError("the recorded batch has no positional (x, y): dormouse's model is called as "
                            "model(x, y); record the loop that calls it so")
    x, y = batch["arg0"], batch["arg1"]
    z = model(x)[0].float()
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="sum"), int(y.numel())


def moving_bias(run: RunConfig) -> bool:
    """The model has a routing bias that moves (an MoE with moe_bias_rate > 0)."""
    return run.model.moe_on and run.model.moe_bias_rate > 0


class LoopRecorder:
    """Records one train() (or train_dist()) call into `out_dir` through the
    Recorder, by the hooks of `hooks()` (see the module docstring). `extra`:
    what the caller keeps in recording.json beside the run (the gate's settings
    and provenance); the loop's evals are added to it as "evals" ([step, loss],
    every segment's), and each step's expert choices (an MoE's, this rank's
    tokens in order) kept as its x/topk (the curve's routing flips). A run
    that resumes continues the recording in out_dir; `fresh`: a new recording
    even so (a run continued from another run's checkpoint: its first step
    is the checkpoint's next, rebuilt from that checkpoint)."""

    def __init__(self, out_dir, extra: dict | None = None, *, fresh: bool = False):
        self.out = Path(out_dir)
        self.extra, self.fresh = extra, fresh
        self.rec: Recorder | None = None
        self.run: RunConfig | None = None
        self.loss: float | None = None
        self.examples: list[int] | None = None  # the windows' byte offsets: the data check's exact ids
        self.epoch: int | None = None
        self.routes: torch.Tensor | None = None

    def hooks(self) -> Hooks:
        return Hooks(on_start=[self._start], on_reduced=[self._reduced], on_clipped=[self._clipped],
                     on_eval=[self._evaluated], on_end=[self._end])

    def _start(self, st: Start) -> None:
        run = st.run
        if st.step and not self.fresh and not A.recording_path(self.out).exists():
            raise RecorderError(f"the run resumed at step {st.step} but {self.out} holds no recording of its first "
                                "steps: record from step 0 into that directory, or drop --record")
        # what rebuilds the run: its recipe, not this launch's resuming or stopping
        rebuild = dataclasses.replace(run, train=dataclasses.replace(run.train, resume=False, resume_from="",
                                                                     stop_at=0))
        kwargs = {"run": rebuild.to_dict()}
        if self.fresh and st.step:  # rebuilt from the checkpoint it continues
            kwargs.update(checkpoint=str(Path(run.train.resume_from).resolve()), start=st.step)
        self.run = run
        self.rec = Recorder(self.out, st.model, RecordingSpec(
            build_model=BUILD_MODEL, build_optimizer=BUILD_OPTIMIZER, objective=OBJECTIVE,
            max_grad_norm=run.train.grad_clip, build_kwargs=kwargs, start=st.step,
            buffer_update=BUFFER_UPDATE if moving_bias(run) else None,
            wire="bf16" if run.train.dist and run.train.dist_reduce == "bf16" else "fp32",
            example_corpus=str(loop.resolve_corpus(run)), extra=self.extra))
        # a resumed segment keeps the evals of the steps before it, not those it runs again
        self.rec.extra["evals"] = [e for e in self.rec.extra.get("evals", []) if e[0] <= st.step]

    def _reduced(self, st: Reduced) -> None:
        self.loss, self.examples, self.epoch = st.loss, st.examples, st.epoch
        slices = [torch.stack(per_it, dim=2) for per_it in (st.routes or []) if per_it]  # each (B, T, I, k)
        self.routes = torch.cat(slices, dim=0).to(torch.int16) if slices else None

    def _clipped(self, st: Clipped) -> None:
        clipping = self.run.train.grad_clip > 0
        self.rec.step(loss=self.loss, lr=loop.lr_at(st.step - 1, self.run),
                      clip_coef=st.clip_coef if clipping else None, grad_norm=st.grad_norm if clipping else None,
                      example_ids=self.examples, epoch=self.epoch,
                      extra={"topk": self.routes} if self.routes is not None else None)
        if self.rec.k != st.step:
            raise RecorderError(f"the recording's step {self.rec.k} is not the loop's step {st.step}: "
                                "record each run into its own directory")

    def _evaluated(self, ev: Evaluated) -> None:
        self.rec.extra["evals"].append([ev.step, ev.loss])

    def _end(self, report: dict) -> None:
        if self.rec is not None:
            self.rec.close()


@torch.no_grad()
def routing_bias_update(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], **_) -> dict[str, torch.Tensor]:
    """the routing bias's update b += rate * sign(mean(L) - L), L the step's expert loads over every rank's
    micro-batches

    The Recorder's buffer_update rule (MoE.balance through
    model.balance_experts, the loop's own call): L = sum over the micro-batches
    of model(x, y)'s loads (max_iter, E), exact counts, at the parameters and
    bias `model` holds (the recorded ones before the step); returns the bias
    after the step."""
    model.train()
    loads = sum(model(b["arg0"], b["arg1"])[2]["loads"] for b in batches)
    model.balance_experts(loads)
    return {BIAS: model.block.moe.router_bias.detach().clone()}
