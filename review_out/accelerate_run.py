"""Hand-written accelerate loop: Accelerator(gradient_accumulation_steps=K), accumulate(), the Recorder.

torchrun --standalone --nproc_per_node=2 accelerate_run.py --out runs/NAME --fault none|double_k"""
import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import common
import fw_common
from dormouse.gate import Recorder

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--fault", default="none")
a, _ = ap.parse_known_args()
K = 2

if __name__ == "__main__":
    acc = Accelerator(gradient_accumulation_steps=K, cpu=True)
    model = fw_common.build_net()
    opt, sched = fw_common.build_optimizer(model)
    ds = fw_common.Rows(16)
    loader = torch.utils.data.DataLoader(ds, batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    core = model.module if hasattr(model, "module") else model
    saver = fw_common.Saver(a.out, acc.process_index, core)
    rec = Recorder(a.out, model, build_model="fw_common:build_net", build_optimizer="fw_common:build_optimizer",
                   objective="causal_lm", dataset_len=len(ds))
    run = 0.0
    for batch in loader:
        with acc.accumulate(model):
            logits = model(input_ids=batch["input_ids"], labels=batch["labels"])
            lab = common.shifted(batch["labels"])
            loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100)   # token mean
            run += float(loss) / K
            if a.fault == "double_k":
                loss = loss / K             # the plain-PyTorch idiom, on top of accelerate's own division
            acc.backward(loss)
            if acc.sync_gradients:
                t = torch.tensor(run)
                torch.distributed.all_reduce(t)
                saver.step(t / acc.num_processes)
                rec.step(loss=t / acc.num_processes, optimizer=opt)
                sched.step()
                run = 0.0
            opt.step(); opt.zero_grad()
            if acc.sync_gradients:
                saver.after()
    rec.close()
