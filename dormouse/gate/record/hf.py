"""The Recorder as a Hugging Face `transformers.TrainerCallback`.

    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.hf import TrainerRecorder
    spec = RecordingSpec(build_model="mypkg.train:build_model", build_optimizer="mypkg.train:build_optimizer")
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=build_optimizer(model),
                      callbacks=[TrainerRecorder("runs/rec", spec)])
    trainer.train()          # then: dormouse gate check --out runs/rec

This is the only module of dormouse that imports transformers (the `[hf]`
extra); the rest of the gate never needs it.

What the Trainer does, read from transformers 5.24's `Trainer._inner_training_loop`
and what the callback does about it:

* Per optimizer step: the micro-batches' forwards and backwards (DDP's
  `no_sync` on all but the last, so the gradient is synchronised after the
  last backward), then `_clip_grad_norm` (when `max_grad_norm > 0`), then
  `on_pre_optimizer_step`, `optimizer.step()`, `on_optimizer_step`, the lr
  scheduler's step, `zero_grad`, `on_step_end`, and the log (`on_log`).
* So `on_pre_optimizer_step` sees the synchronised gradient ALREADY CLIPPED:
  g' = c g with c = min(1, max_grad_norm / (||g|| + 1e-6)) (torch's
  `clip_grad_norm_`). The callback records g' there (the gradient the
  optimizer applies), with the parameters before the step and the lr of the
  optimizer's first parameter group (the scheduler has set it for this step).
* The pre-clip norm ||g|| and the loss reach no callback before the step: the
  Trainer logs them afterwards (`logs["grad_norm"]`, `logs["loss"]`, the
  loss gathered over ranks and averaged: `nested_gather(tr_loss).mean()`).
  The callback asks the Trainer to log every step (`control.should_log`)
  and hands both to the Recorder at `on_log` (`Recorder.report`), which
  turns ||g|| into c by the rule above: the judge then compares g' with c
  times the reference's gradient, and checks c against the reference's norm.
* The Recorder hooks the core model the callbacks are given (the Trainer's
  `self.model`; DDP's wrapper calls it, so every micro-batch's forward passes
  through the hook). Its state at `on_train_begin` (after the Trainer placed
  it, before any step) is the recording's initial state.
* A resumed Trainer (`trainer.train(resume_from_checkpoint=...)`) starts
  at `state.global_step = K > 0`: the callback records a new segment after K.

Refused, one line each (`RecorderError`), at `on_train_begin` (before the
first step): NEFTune (`neftune_noise_alpha`: the Trainer's forward hook adds
random noise to the input embeddings), DeepSpeed and the Trainer's FSDP
(the recorded tensors would be the engine's shards or partitions, which the
callback does not assemble: record an FSDP2 loop with the Recorder itself),
a Trainer that is not data-parallel or single-process (model parallel).
"""

from __future__ import annotations

import math
from pathlib import Path

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts.spec import OBJECTIVES, RecorderError, RecordingSpec
from dormouse.gate.record.recorder import Recorder

try:
    from transformers import TrainerCallback
except ImportError as e:  # the [hf] extra is not installed
    raise RecorderError(f"dormouse.gate.record.hf needs transformers and accelerate ({e}): "
                        "pip install 'dormouse[hf]'") from None


class TrainerRecorder(TrainerCallback):
    """Records a `transformers.Trainer` run for the gate (see the module docstring).

    out_dir          where the recording goes (one run per directory; `dormouse gate check --out` it)
    spec             a RecordingSpec (docs/recording.md): build_model's fn() returns the same initial model in a
                     fresh process, build_optimizer's fn(model) the optimizer and lr scheduler the Trainer uses
                     (hand the same to the Trainer: `optimizers=build_optimizer(model)`); the objective
                     "causal_lm" is HF's convention (logits against labels shifted by one, ignore_index -100,
                     token mean over the GLOBAL batch; an MoE model's own router_aux_loss_coef x aux_loss of
                     each forward with it, record/routeraux.py). Read from the Trainer where left None:
                     max_grad_norm (TrainingArguments.max_grad_norm), dataset_len (len(train_dataset));
                     start is the Trainer's global_step, reports is on (the step's marker comes after the log)
    """

    def __init__(self, out_dir, spec: RecordingSpec):
        # bad options fail where the spec is made, in one line, before the Trainer trains
        if not isinstance(spec, RecordingSpec):
            raise RecorderError(f"TrainerRecorder(out_dir, spec): spec is a {type(spec).__name__}, not a "
                                "RecordingSpec: pass RecordingSpec(build_model=..., build_optimizer=..., ...)")
        if spec.start:
            raise RecorderError(f"TrainerRecorder: spec start={spec.start}: the Trainer's global_step says where "
                                "the recording starts: leave start at 0")
        self.out_dir = Path(out_dir)
        self.spec = spec
        self.rec: Recorder | None = None
        self._step_logged = -1  # the Trainer's global_step whose log reached the Recorder
        self._epoch: int | None = None  # the Trainer's epoch (on_epoch_begin), for the data check's epochs

    # ------------------------------------------------------------------ the Trainer's events

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if getattr(args, "deepspeed", None):
            raise RecorderError("TrainerRecorder does not record DeepSpeed runs (the gradients live in the "
                                "engine's partitions): record a DDP run, or call the Recorder from your own loop")
        if model is None:
            raise RecorderError("TrainerRecorder.on_train_begin was given no model: add it to a "
                                "transformers.Trainer (callbacks=[...]), not call it by hand")
        smoothing = float(getattr(args, "label_smoothing_factor", 0.0) or 0.0)
        if smoothing > 0 and self.spec.objective in OBJECTIVES:
            raise RecorderError(
                f"label_smoothing_factor = {smoothing}: the Trainer takes the labels out of the batch before the "
                f"model's forward (its label smoother computes the loss), so the recording holds no labels and "
                f"the built-in objective {self.spec.objective!r} is not the loss it trains: declare "
                "objective='pkg.mod:fn' computing your smoothed loss from the recorded batch, or record the run "
                "with label_smoothing_factor = 0")
        alpha = getattr(args, "neftune_noise_alpha", None)
        hooked = [n for n, m in model.named_modules()
                  if any("neftune" in getattr(h, "__name__", "") for h in m._forward_hooks.values())]
        if alpha or hooked:  # the Trainer's own forward hook on the input embeddings (transformers' neftune.py)
            raise RecorderError(
                f"NEFTune (neftune_noise_alpha = {alpha}{', hooked on ' + hooked[0] if hooked else ''}): the Trainer "
                "adds uniform noise to the input embeddings in every training forward, drawn from each rank's "
                "random state, which one process cannot redraw: the fleet's gradient is not a function of the "
                "recorded batches; record the run with neftune_noise_alpha = None (NEFTune changes the inputs, "
                "not how the fleet splits the batch)")
        sharded = type(model).__name__ == "FullyShardedDataParallel" or any(
            hasattr(p, "placements") for p in model.parameters())
        if getattr(args, "fsdp", None) or sharded:
            raise RecorderError("TrainerRecorder does not record the Trainer's FSDP (its parameters are the "
                                "engine's shards): record a DDP run, or an FSDP2 loop with the Recorder itself")
        self.rec = Recorder(self.out_dir, model, self._spec(args, state, train_dataloader))
        return control

    def on_epoch_begin(self, args, state, control, **kwargs):
        # the Trainer's loop runs `for epoch in range(epochs_trained, ...)`, epochs_trained =
        # floor(state.epoch) on a resume (state.epoch = epoch + steps done / steps in the epoch)
        if self._epoch is not None:
            self._epoch += 1
        else:
            self._epoch = math.floor(state.epoch or 0) if state.global_step else 0
        return control

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # the gradient is synchronised and (max_grad_norm > 0) already clipped: see the module docstring.
        # The epoch is the Trainer's own: an uneven last batch, which accelerate's even_batches fills
        # on every rank by repeating the epoch's first examples, is then seen as a read twice
        self._live().step(optimizer=optimizer, epoch=self._epoch)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = True  # the loss and the pre-clip norm of every step come through the log
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.rec is None or "loss" not in logs or state.global_step == self._step_logged:
            return control  # an eval log, or the final summary (train_loss), or a step already reported
        self._step_logged = state.global_step
        self.rec.report(loss=logs["loss"], grad_norm=logs.get("grad_norm"))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.rec is not None:
            self.rec.close()
        return control

    # ------------------------------------------------------------------ plumbing

    def _live(self) -> Recorder:
        if self.rec is None:
            raise RecorderError("TrainerRecorder saw an optimizer step before on_train_begin: add it to the "
                                "Trainer's callbacks before trainer.train()")
        return self.rec

    def _spec(self, args, state, loader) -> RecordingSpec:
        """The spec with what the Trainer says: its clip threshold, its dataset's length where the spec leaves
        them None, the step it resumed at (a new segment of the recording in out_dir)."""
        mgn = float(args.max_grad_norm or 0.0)
        if self.spec.max_grad_norm is not None and self.spec.max_grad_norm != mgn:
            raise RecorderError(f"spec max_grad_norm={self.spec.max_grad_norm} but the Trainer clips at "
                                f"TrainingArguments.max_grad_norm={mgn}: leave max_grad_norm None (read from the "
                                "Trainer)")
        step = int(state.global_step or 0)
        if step and not A.recording_path(self.out_dir).exists():
            raise RecorderError(f"the Trainer resumed at step {step} but {self.out_dir} holds no recording.json: "
                                "record the run's first steps there (train from step 0)")
        return self.spec.replace(max_grad_norm=mgn, dataset_len=self._dataset_len(loader), start=step,
                                 reports=True)

    def _dataset_len(self, loader) -> int:
        if self.spec.dataset_len is not None:
            return self.spec.dataset_len
        ds = getattr(loader, "dataset", None)
        try:
            return len(ds) if ds is not None else 0
        except TypeError:  # an IterableDataset without a length
            return 0
