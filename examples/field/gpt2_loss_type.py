"""Reproduction: transformers' Trainer scales GPT-2's gradient by N / (N + rows).

    python examples/field/gpt2_loss_type.py          # one process, CPU, well under a minute

`GPT2LMHeadModel.loss_type` is None (its class name holds no "ForCausalLM"), so
`Trainer._get_num_items_in_batch` counts `num_items_in_batch` over the
UNSHIFTED labels (it counts `labels[..., 1:]` only when the model's loss_type
maps to ForCausalLMLoss: `Trainer._loss_shifts_labels`), one target per row
too many, while the model's loss sums the cross-entropy over the SHIFTED
labels and divides by that count. The gradient the optimizer gets is the
global token mean's times N / (N + rows), a factor that changes with every
batch's lengths (so no lr retuning absorbs it). TRL's SFTTrainer divides by
the same count and inherits it. Setting `model.loss_type = "ForCausalLM"`
before building the Trainer makes the count right.

One process is enough to see it (no fleet): the script trains one step of a
tiny random-init GPT-2 with the Trainer (max_grad_norm 0, so nothing clips),
reads the gradient the Trainer hands the optimizer (`on_pre_optimizer_step`),
and compares it with the gradient of the token mean computed by hand. The
gate (tests/gate/catches/test_hf_trainer.py, `stock`; docs/field-report.md) fails
the same configuration on its gradient check, "not by a constant factor".
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.nn.functional as F

ROWS, SEQ, VOCAB = 4, 16, 64


def model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def data():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(ROWS):
        n = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask = (torch.arange(SEQ) < n).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
    return out


def trainer_gradient(loss_type):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    seen = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    net = model()
    if loss_type:
        net.loss_type = loss_type
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=ROWS, max_steps=1,
                                 max_grad_norm=0.0, report_to="none", disable_tqdm=True, save_strategy="no",
                                 learning_rate=1e-3)
        Trainer(model=net, args=args, train_dataset=data(), callbacks=[Grab()]).train()
    return seen


def by_hand():
    net = model()
    rows = data()
    ids = torch.stack([r["input_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])
    mask = torch.stack([r["attention_mask"] for r in rows])
    logits = net(input_ids=ids, attention_mask=mask).logits
    y = labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
    n = int(y.ne(-100).sum())
    (loss / n).backward()
    return {k: p.grad.detach().clone() for k, p in net.named_parameters() if p.grad is not None}, n


def main() -> int:
    import transformers

    ref, n = by_hand()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; {ROWS} rows, {n} shifted targets")
    for loss_type in (None, "ForCausalLM"):
        g = trainer_gradient(loss_type)
        num = sum(float((g[k].double() * ref[k].double()).sum()) for k in ref)
        den = sum(float((ref[k].double() ** 2).sum()) for k in ref)
        ratio = num / den  # the least-squares factor g = ratio * ref
        resid = sum(float(((g[k].double() - ratio * ref[k].double()) ** 2).sum()) for k in ref) ** 0.5 / den ** 0.5
        print(f"model.loss_type={loss_type!s:12} Trainer's gradient = {ratio:.6f} x the token mean's "
              f"(residual {resid:.1e}); N / (N + rows) = {n / (n + ROWS):.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
