"""The quick start of docs/your-loop.md for a plain DDP loop: a tiny causal LM
trained on two CPU ranks with gradient accumulation and clipping, recorded
for the gate. From this folder:

    torchrun --standalone --nproc_per_node=2 ddp_train.py
    dormouse gate check --out runs/ddp

The builders stay importable without training (the loop sits under
`if __name__ == "__main__":`): `gate check` imports this module to rebuild
the initial model and the optimizer in one process.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dormouse.gate import Recorder, RecordingSpec

STEPS, ACCUM, MICRO, SEQ, VOCAB = 4, 2, 4, 32, 64


class TinyLM(torch.nn.Module):
    """Embedding, one GRU layer, a head: logits for each position."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.rnn = torch.nn.GRU(32, 32, batch_first=True)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.rnn(self.embed(input_ids))[0])


def build_model():
    """The same initial model in any process: seeded here."""
    torch.manual_seed(0)
    return TinyLM()


def build_optimizer(model):
    """(optimizer, lr scheduler): the loop uses these, the gate's replay too."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / STEPS)


def dataset(n: int = 64, seed: int = 0) -> list[dict]:
    """Random token rows of lengths 4..SEQ, right-padded with 0 (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, SEQ + 1, (1,), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(build_model())
    opt, sched = build_optimizer(model.module)
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                                  drop_last=True)
    loader = iter(torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler, drop_last=True))
    rec = Recorder("runs/ddp", model, RecordingSpec(build_model="ddp_train:build_model",
                                                    build_optimizer="ddp_train:build_optimizer", objective="causal_lm",
                                                    max_grad_norm=1.0, dataset_len=len(data),
                                                    selfcheck=64))  # selfcheck: the in-run checks (docs/follow.md)
    for _ in range(STEPS):
        batches = [next(loader) for _ in range(ACCUM)]
        # the causal-LM token mean over the GLOBAL batch: every rank's targets counted
        n = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
        dist.all_reduce(n)
        total = torch.zeros(())
        for i, b in enumerate(batches):
            sync = torch.enable_grad() if i == ACCUM - 1 else model.no_sync()  # all-reduce at the last
            with sync:
                logits = model(b["input_ids"], attention_mask=b["attention_mask"])
                loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                           ignore_index=-100, reduction="sum")
                (loss_sum * world / n).backward()  # DDP averages over ranks: times W undoes it
            total += loss_sum.detach()
        dist.all_reduce(total)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        rec.step(loss=float(total / n), optimizer=opt, grad_norm=norm)  # after the backward, before the step
        opt.step()
        sched.step()
        opt.zero_grad()
    rec.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
