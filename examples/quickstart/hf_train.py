"""The quick start of docs/your-loop.md: a tiny random-init GPT-2 trained by
transformers.Trainer on two CPU ranks, recorded for the gate. From this folder:

    torchrun --standalone --nproc_per_node=2 hf_train.py
    dormouse gate check --out runs/hf

The builders stay importable without training (the training sits under
`if __name__ == "__main__":`): `gate check` imports this module to rebuild
the initial model and the optimizer in one process.
"""

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_linear_schedule_with_warmup

from dormouse.gate import RecordingSpec
from dormouse.gate.record.hf import TrainerRecorder

STEPS, SEQ, VOCAB = 4, 32, 64


def build_model():
    """The same initial model in any process: seeded here."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = GPT2LMHeadModel(cfg)
    # transformers 5.x: GPT-2's loss_type is None, under which the Trainer counts one
    # target too many per row (the gate fails that run, rightly); ForCausalLM counts them right.
    model.loss_type = "ForCausalLM"
    return model


def build_optimizer(model):
    """(optimizer, lr scheduler): the Trainer gets these, the gate's replay too."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return opt, get_linear_schedule_with_warmup(opt, 0, STEPS)


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


if __name__ == "__main__":
    model = build_model()
    args = TrainingArguments("runs/hf-trainer", use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=STEPS, max_grad_norm=1.0, logging_steps=1,
                             save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), optimizers=build_optimizer(model),
                      callbacks=[TrainerRecorder("runs/hf", RecordingSpec(build_model="hf_train:build_model",
                                                                          build_optimizer="hf_train:build_optimizer",
                                                                          objective="causal_lm"))])
    trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()
