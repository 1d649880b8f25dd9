"""The Lightning recipe of docs/clients/lightning.md as a whole script: the
tiny causal LM of ddp_train.py inside a LightningModule, trained by
`pl.Trainer(strategy="ddp")` on two CPU ranks with `accumulate_grad_batches`
and `gradient_clip_val`, recorded for the gate. From this folder:

    torchrun --standalone --nproc_per_node=2 lightning_train.py
    dormouse gate check --out runs/lightning

(`python lightning_train.py` runs it as one process.) The builders stay
importable without training: `gate check` imports this module to rebuild the
initial network and the optimizer in one process.
"""

import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from ddp_train import build_model, build_optimizer, dataset  # noqa: F401 (the gate imports them from here)
from dormouse.gate import RecordingSpec
from dormouse.gate.record.lightning import LightningRecorder

STEPS, ACCUM, MICRO = 4, 2, 4
WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def targets(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def micro_batches() -> list[dict]:
    """This rank's micro-batches, each with its step's target count over every rank and micro-batch
    (counted ahead from every rank's sampler, as HF's Trainer counts num_items_in_batch)."""
    data = dataset()

    def of_rank(r):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=True, seed=0,
                                                      drop_last=True)
        return list(torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler, drop_last=True))

    every = [of_rank(r) for r in range(WORLD)]
    out = []
    for s in range(STEPS):
        step = slice(s * ACCUM, (s + 1) * ACCUM)
        n_step = sum(targets(b) for r in range(WORLD) for b in every[r][step])
        out += [{**b, "n_step": n_step} for b in every[RANK][step]]
    return out


class LitLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = build_model()  # the network the callback records (module="net")

    def configure_optimizers(self):
        opt, sched = build_optimizer(self.net)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def training_step(self, batch, i):
        logits = self.net(batch["input_ids"], attention_mask=batch["attention_mask"])
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")
        return loss_sum / batch["n_step"] * ACCUM * WORLD  # Lightning divides by K, DDP averages the ranks


if __name__ == "__main__":
    spec = RecordingSpec(build_model="lightning_train:build_model", build_optimizer="lightning_train:build_optimizer",
                         objective="causal_lm", dataset_len=len(dataset()))
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=WORLD, max_steps=STEPS,
                         accumulate_grad_batches=ACCUM, gradient_clip_val=1.0, use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[LightningRecorder("runs/lightning", spec, module="net")])
    trainer.fit(LitLM(), train_dataloaders=torch.utils.data.DataLoader(micro_batches(), batch_size=None))
