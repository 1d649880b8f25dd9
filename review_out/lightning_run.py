"""Lightning client: strategy="ddp", 2 ranks, accumulate_grad_batches=K, the dormouse callback.

torchrun --standalone --nproc_per_node=2 lightning_run.py --out runs/NAME --fault none|double_k|local_mean_k1"""
import argparse

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

import common
import fw_common
from dormouse.gate.record.lightning import RecorderCallback

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--fault", default="none")
a, _ = ap.parse_known_args()
K = 2


class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = fw_common.build_net()
        self.saver = None

    def training_step(self, batch, idx):
        logits = self.net(input_ids=batch["input_ids"], labels=batch["labels"])
        lab = common.shifted(batch["labels"])
        loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100)   # token mean
        if a.fault == "double_k":
            loss = loss / self.trainer.accumulate_grad_batches    # the plain-PyTorch idiom, on top of Lightning's
        self.acc = getattr(self, "acc", 0.0) + float(loss.detach()) / K
        return loss

    def on_fit_start(self):
        self.saver = fw_common.Saver(a.out, self.global_rank, self.net)

    def on_before_optimizer_step(self, optimizer):
        t = torch.tensor(self.acc)
        torch.distributed.all_reduce(t)
        self.saver.step(t / self.trainer.world_size)
        self.acc = 0.0

    def on_train_batch_end(self, *args):
        if self.saver.batches == []:
            self.saver.after()

    def configure_optimizers(self):
        opt, sched = fw_common.build_optimizer(self.net)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(fw_common.Rows(16), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, accumulate_grad_batches=K, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[RecorderCallback(a.out, module="net", build_model="fw_common:build_net",
                                                     build_optimizer="fw_common:build_optimizer",
                                                     objective="causal_lm")])
    trainer.fit(Lit(), loader)
