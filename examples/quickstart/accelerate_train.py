"""The accelerate recipe of docs/clients/plain.md as a whole script: the tiny
causal LM of ddp_train.py trained by a hand-written `accelerate` loop on two
CPU ranks (gradient accumulation with `accumulate()`, clipping), recorded for
the gate. From this folder:

    torchrun --standalone --nproc_per_node=2 accelerate_train.py
    dormouse gate check --out runs/accelerate

(`python accelerate_train.py` runs it as one process.) The builders stay
importable without training: `gate check` imports this module to rebuild the
initial model and the optimizer in one process.
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from dormouse.gate import Recorder, RecordingSpec
from ddp_train import build_model, build_optimizer, dataset  # noqa: F401 (the gate imports them from here)

STEPS, ACCUM, MICRO = 4, 2, 4


def loss_sum(model, batch):
    """The micro-batch's summed next-token cross-entropy (padding's labels are -100)."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def micro_batches(accelerator):
    """This rank's micro-batches, each with its step's target count over every rank and micro-batch."""
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=accelerator.num_processes,
                                                  rank=accelerator.process_index, shuffle=True, seed=0,
                                                  drop_last=True)
    loader = iter(torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler, drop_last=True))
    for _ in range(STEPS):
        batches = [next(loader) for _ in range(ACCUM)]
        n = torch.tensor(float(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)))
        n_step = accelerator.reduce(n, reduction="sum")
        for b in batches:
            yield {**b, "n_step": n_step}


def main() -> None:
    K = ACCUM
    accelerator = Accelerator(gradient_accumulation_steps=K, cpu=True)
    model = build_model()
    opt, sched = build_optimizer(model)
    model, opt = accelerator.prepare(model, opt)  # the scheduler is not prepared: this loop steps it
    rec = Recorder("runs/accelerate", model, RecordingSpec(build_model="accelerate_train:build_model",
                                                           build_optimizer="accelerate_train:build_optimizer",
                                                           objective="causal_lm", max_grad_norm=1.0,
                                                           dataset_len=len(dataset())))
    total = torch.zeros(())
    for batch in micro_batches(accelerator):
        with accelerator.accumulate(model):
            s = loss_sum(model, batch)
            loss = s / batch["n_step"] * K * accelerator.num_processes
            accelerator.backward(loss)                  # divides by K; DDP averages the ranks
            total += s.detach()
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                global_loss = float(accelerator.reduce(total, reduction="sum") / batch["n_step"])
                rec.step(loss=global_loss, optimizer=opt, grad_norm=norm)
                total = torch.zeros(())
            opt.step()
            if accelerator.sync_gradients:
                sched.step()                            # after opt.step(): it sets the next step's lr
            opt.zero_grad()
    rec.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
