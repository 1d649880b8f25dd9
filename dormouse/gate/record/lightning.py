"""The Recorder as a PyTorch Lightning `Callback`.

    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.lightning import LightningRecorder
    spec = RecordingSpec(build_model="mypkg.train:build_model", build_optimizer="mypkg.train:build_optimizer")
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, accumulate_grad_batches=2,
                         gradient_clip_val=1.0, callbacks=[LightningRecorder("runs/rec", spec, module="net")])
    trainer.fit(lit_module, datamodule)    # then: dormouse gate check --out runs/rec

This is the only module of dormouse that imports Lightning (the `[lightning]`
extra). `module` names the LightningModule's attribute holding the network
whose forward takes the batch (`self.net(input_ids=..., attention_mask=...)`
in `training_step`); `build_model` rebuilds that network, `build_optimizer(net)`
its optimizer and lr scheduler (the scheduler stepped once per optimizer step:
`configure_optimizers` returns it with `"interval": "step"`). None records the
LightningModule itself (its `forward` must then take the batch).

What Lightning does, read from pytorch-lightning 2.6.6, and what the callback
does about it:

* Gradient accumulation (`loops/optimization/automatic.py`, `_AutomaticOptimization.run`,
  lines 174-190): on every micro-batch but the last of a step the closure
  (training_step, backward) runs inside `_block_parallel_sync_behavior`, i.e.
  `strategy.block_backward_sync()` = DDP's `no_sync()` (`strategies/parallel.py`
  117-128): the gradient is synchronised by the last micro-batch's backward.
* Each micro-batch's loss is divided by `accumulate_grad_batches` before the
  backward (`ClosureResult.from_training_step_output`, automatic.py 80-83:
  `closure_loss = closure_loss / normalize`), and DDP averages over ranks:
  `training_step` returning a micro-batch's own token mean trains the mean of
  per-micro-batch means, not the global batch's token mean. The callback does
  not change this; the gate judges it against the declared objective.
* The optimizer step (`plugins/precision/precision.py`, `Precision._after_closure`,
  lines 84-94) calls the callbacks' `on_before_optimizer_step` FIRST, then the
  LightningModule's, and only then `_clip_gradients` ->
  `configure_gradient_clipping` -> `clip_grad_by_norm` =
  `torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)` (precision.py
  163-166). So the callback's hook sees the synchronised gradient BEFORE
  clipping: it records that with `max_grad_norm = gradient_clip_val`, and the
  judge clips by torch's rule (c = min(1, max / (||g|| + 1e-6))) itself.
  `gradient_clip_algorithm="value"` is refused (the gate's clip is the norm's).
* Manual optimization (`automatic_optimization = False`): the hook runs inside
  the module's `opt.step()` (`LightningOptimizer.step` -> the same
  `_after_closure`), after whatever the module did to the gradients. A module
  that clips before `opt.step()` says so by logging its pre-clip norm
  (`self.log(grad_norm_key, norm)`, rank-local, no sync_dist) with
  the spec's `max_grad_norm` given: the gradient is then recorded as
  clipped, and a norm that differs between ranks (a clip before the reduce)
  is what the judge's clip check names.
* The loss: Lightning logs what the module logs. `loss_key` names a metric the
  module logs each step (`self.log(loss_key, value)`, read from
  `trainer.callback_metrics` in the hook: the last micro-batch's training_step
  has run) holding the step's loss over the GLOBAL batch; without it no loss is
  reported (the judge says so and checks the gradient alone).
* The epoch is `trainer.current_epoch`; dataset_len is `len(dataset)` of the
  train dataloader unless given, when its loader batches the dataset's items
  (a loader with `batch_size=None` reads a dataset of ready-made batches: its
  length counts micro-batches, not examples, so dataset_len is left unknown and
  the data check goes by the epochs alone; give the spec's `dataset_len` the examples).

Refused, one line each (`RecorderError`), at `on_fit_start`: a strategy other
than single-device or `ddp` (`fsdp` is FSDP1, whose FlatParameter shards the
Recorder does not assemble, and does not run on CPU anyway: 2.6.6's
`_AcceleratorConnector._check_strategy_and_fallback`,
`trainer/connectors/accelerator_connector.py` 431-438, raises "The strategy
`fsdp` requires a GPU accelerator"; DeepSpeed's partitions likewise; ModelParallel),
`gradient_clip_algorithm="value"`, a `module` the LightningModule lacks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dormouse.gate.artifacts.spec import RecorderError, RecordingSpec
from dormouse.gate.record.recorder import Recorder

try:
    import pytorch_lightning as pl
except ImportError as e:  # the [lightning] extra is not installed
    raise RecorderError(f"dormouse.gate.record.lightning needs pytorch-lightning ({e}): "
                        "pip install 'dormouse[lightning]'") from None


class LightningRecorder(pl.Callback):
    """Records a `pytorch_lightning.Trainer` run for the gate (see the module docstring).

    out_dir          where the recording goes (one run per directory; `dormouse gate check --out` it)
    spec             a RecordingSpec (docs/recording.md): build_model's fn() returns the network, the same
                     initial one, in a fresh process; build_optimizer's fn(net) returns (optimizer, lr scheduler
                     stepped per optimizer step). Read from the Trainer where left None: max_grad_norm
                     (gradient_clip_val; manual optimization that clips: give the threshold), dataset_len
                     (len(dataset) of the train dataloader)
    module           the LightningModule's attribute holding the network the batch goes through
                     (None: the LightningModule itself)
    loss_key         a metric the module logs every step: the step's loss over the global batch
    grad_norm_key    manual optimization that clips before opt.step(): the metric holding the
                     pre-clip norm (rank-local); the spec's max_grad_norm its clip threshold
    """

    def __init__(self, out_dir, spec: RecordingSpec, *, module: str | None = None, loss_key: str | None = None,
                 grad_norm_key: str | None = None):
        if not isinstance(spec, RecordingSpec):
            raise RecorderError(f"LightningRecorder(out_dir, spec): spec is a {type(spec).__name__}, not a "
                                "RecordingSpec: pass RecordingSpec(build_model=..., build_optimizer=..., ...)")
        if grad_norm_key is not None and not spec.max_grad_norm:
            raise RecorderError(f"grad_norm_key={grad_norm_key!r} without max_grad_norm in the spec: give the "
                                "threshold your module clips at (the judge checks the clip coefficient by it)")
        self.out_dir = Path(out_dir)
        self.spec, self.module = spec, module
        self.loss_key, self.grad_norm_key = loss_key, grad_norm_key
        self.rec: Recorder | None = None

    # ------------------------------------------------------------------ Lightning's events

    def on_fit_start(self, trainer, pl_module):
        strategy = trainer.strategy
        from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

        if type(strategy) is not SingleDeviceStrategy and type(strategy) is not DDPStrategy:
            raise RecorderError(f"LightningRecorder records single-device and strategy='ddp' runs, not "
                                f"{type(strategy).__name__} (its parameters are the engine's shards or partitions, "
                                "which the callback does not assemble): record a DDP run, or an FSDP2 loop with "
                                "the Recorder itself")
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm))
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm is not None and algorithm != "norm":
            raise RecorderError(f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: the gate judges "
                                "clipping by the global norm (gradient_clip_algorithm='norm') only")
        if self.module is not None and not isinstance(getattr(pl_module, self.module, None), torch.nn.Module):
            raise RecorderError(f"module={self.module!r}: {type(pl_module).__name__} has no network attribute "
                                f"{self.module!r} (name the attribute whose forward takes the batch)")

    def on_train_start(self, trainer, pl_module):
        net = pl_module if self.module is None else getattr(pl_module, self.module)
        mgn = self.spec.max_grad_norm if self.spec.max_grad_norm is not None else trainer.gradient_clip_val
        self.rec = Recorder(self.out_dir, net, self.spec.replace(max_grad_norm=float(mgn or 0.0),
                                                                 dataset_len=self._dataset_len(trainer)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.rec is None:
            raise RecorderError("LightningRecorder saw an optimizer step before on_train_start: add it to the "
                                "Trainer's callbacks before trainer.fit()")
        metrics = trainer.callback_metrics
        loss = metrics.get(self.loss_key) if self.loss_key else None
        norm = metrics.get(self.grad_norm_key) if self.grad_norm_key else None
        # automatic optimization: the synchronised gradient before Lightning's clip (see the docstring)
        self.rec.step(loss=loss, optimizer=optimizer, grad_norm=norm, epoch=trainer.current_epoch)

    def on_train_end(self, trainer, pl_module):
        if self.rec is not None:
            self.rec.close()

    # ------------------------------------------------------------------ plumbing

    def _dataset_len(self, trainer) -> int:
        if self.spec.dataset_len is not None:
            return self.spec.dataset_len
        loader = trainer.train_dataloader
        ds = getattr(loader, "dataset", None)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.batch_sampler is None:
            return 0  # batch_size=None: each item of the dataset is a batch, not an example (rows unknown)
        try:
            return len(ds) if ds is not None else 0
        except TypeError:  # an IterableDataset without a length
            return 0
