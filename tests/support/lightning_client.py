"""A real PyTorch Lightning client of the gate, for tests: loopmodel's tiny
causal LM inside a LightningModule, trained by `pl.Trainer(accelerator="cpu",
strategy="ddp", devices=W)` under torchrun (gloo), recorded by
`dormouse.gate.record.lightning.LightningRecorder`. Nothing is downloaded.

    torchrun --standalone --nproc_per_node=2 tests/support/lightning_client.py --out DIR clean:mode=clean ...

One launch fits every run in turn (one Trainer each, the process group kept).
The data (fieldkit.step_batches) is laid out per step, each micro-batch with
the step's global target count `n_step` and this rank's `n_rank`. A run's
fields: seed=S, k=K (accumulate_grad_batches, default 2), steps=N, clip=C
(gradient_clip_val; manual runs clip by hand at C), infer_len=1 (no dataset_len given: the
callback infers it from the loader), and mode=M, the loss the
module's training_step backpropagates (S_m the micro-batch's summed
cross-entropy, n_m its target count; Lightning divides by K, DDP averages over
W ranks):

  clean        S_m / n_step * K * W: the global batch's token mean
  rank_mean    S_m / n_rank * K: each rank normalised by its own token count
  micro_mean   S_m / n_m: each micro-batch's own token mean (Lightning's idiom)
  manual       manual optimization, K = 1: backward (DDP synchronises), then
               clip_grad_norm_ by the synchronised norm, opt.step()
  clip_local   manual optimization, K = 1: backward without synchronisation
               (`opt.toggle_model(sync_grad=False)`, Lightning's own no-sync),
               clip_grad_norm_ by the rank's OWN gradient norm, then an all-reduce
               by hand (strategy.reduce): clipping before the reduce

Every mode logs `step_loss` (the value its backward trains, averaged over ranks:
the global token mean for clean) and the manual ones `grad_norm` (rank-local).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402  (tests/support)
import fieldkit  # noqa: E402
import loopmodel  # noqa: E402

LR = 1e-2
MODES = ("clean", "rank_mean", "micro_mean", "manual", "clip_local")


def make_module(run: dict, world: int):
    import pytorch_lightning as pl

    class LitLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = loopmodel.build_model(seed=run["seed"])
            self.automatic_optimization = run["mode"] not in ("manual", "clip_local")
            self._acc = 0.0

        def configure_optimizers(self):
            opt, sched = loopmodel.build_optimizer(self.net, lr=LR)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def _log_step(self, value: torch.Tensor) -> None:
            v = value.detach().clone()
            dist.all_reduce(v)
            self.log("step_loss", v / world)

        def training_step(self, batch, i):
            s, n = fieldkit.loss_sum(self.net, batch)
            k, mode = run["k"], run["mode"]
            if not self.automatic_optimization:
                return self._manual(batch, s)
            if mode == "clean":
                loss = s / batch["n_step"] * k * world
            elif mode == "rank_mean":
                loss = s / batch["n_rank"] * k
            else:  # micro_mean
                loss = s / n
            self._acc = self._acc + loss.detach() / k
            if (i + 1) % k == 0:  # the step's last micro-batch (Lightning steps the optimizer after it)
                self._log_step(self._acc)
                self._acc = 0.0
            return loss

        def _manual(self, batch, s):
            opt, sched = self.optimizers(), self.lr_schedulers()
            loss = s / batch["n_step"] * world
            params = list(self.net.parameters())
            if run["mode"] == "clip_local":
                with opt.toggle_model(sync_grad=False):
                    self.manual_backward(loss)
                norm = torch.nn.utils.clip_grad_norm_(params, run["clip"])  # this rank's own gradient
                for p in params:
                    if p.grad is not None:
                        p.grad.copy_(self.trainer.strategy.reduce(p.grad, reduce_op="mean"))
            else:
                self.manual_backward(loss)  # DDP synchronises here
                norm = torch.nn.utils.clip_grad_norm_(params, run["clip"])
            self.log("grad_norm", norm)
            self._log_step(loss.detach())
            opt.step()
            sched.step()
            opt.zero_grad()

    return LitLM()


def parse_run(text: str) -> dict:
    name, *fields = text.split(":")
    run = {"name": name, "mode": "clean", "seed": 0, "k": 2, "steps": 4, "clip": 1.0, "infer_len": 0}
    for f in fields:
        key, _, v = f.partition("=")
        if key == "mode":
            if v not in MODES:
                raise SystemExit(f"lightning_client: unknown mode {v!r}")
            run[key] = v
        elif key in ("seed", "k", "steps", "infer_len"):
            run[key] = int(v)
        elif key == "clip":
            run[key] = float(v)
        else:
            raise SystemExit(f"lightning_client: unknown run field {key!r} in {text!r}")
    if run["mode"] in ("manual", "clip_local"):
        run["k"] = 1
    return run


def fit(run: dict, out: Path) -> None:
    import pytorch_lightning as pl

    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.lightning import LightningRecorder

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    manual = run["mode"] in ("manual", "clip_local")
    items = fieldkit.step_batches(seed=run["seed"], world=world, rank=rank, k=run["k"], steps=run["steps"])
    loader = torch.utils.data.DataLoader(fieldkit.Listed(items), batch_size=None, shuffle=False)
    spec = RecordingSpec(build_model="loopmodel:build_model", build_optimizer="loopmodel:build_optimizer",
                         objective="causal_lm", build_kwargs={"seed": run["seed"], "lr": LR},
                         max_grad_norm=run["clip"] if manual else None,
                         dataset_len=None if run["infer_len"] else len(items) * world * fieldkit.B)
    callback = LightningRecorder(out / run["name"], spec, module="net", loss_key="step_loss",
                                 grad_norm_key="grad_norm" if manual else None)
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=world, max_steps=run["steps"],
                         accumulate_grad_batches=run["k"], gradient_clip_val=None if manual else run["clip"],
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback])
    trainer.fit(make_module(run, world), train_dataloaders=loader)


def main(argv: list[str] | None = None) -> int:
    return plan.runs_main(fit, parse_run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
