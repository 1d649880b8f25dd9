"""The DPO recipe of docs/clients/hf.md as a whole script: sft_train.py's tiny
Llama trained by TRL's `DPOTrainer` (sigmoid loss, beta 0.1) on preference
pairs, two CPU ranks, recorded for the gate by the HF callback. From this folder:

    torchrun --standalone --nproc_per_node=2 dpo_train.py
    dormouse gate check --out runs/dpo

DPO's loss is not a sum over rows: a pair is two rows of one forward (TRL's
collator puts a micro-batch's chosen rows first, its rejected rows after), and
each pair's loss reads a frozen reference model. So the objective is declared
over the whole step (`objective_scope="step"`): `dpo_objective(model, batches)`
returns the step's summed loss over its pairs and the number of pairs, as one
process at the global batch computes it. TRL's micro-batch loss is the mean
over its pairs, the Trainer divides it by the accumulation steps and DDP
averages the ranks: with the same number of pairs in every micro-batch that is
the mean over the global batch's pairs, which the gate then checks.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dormouse.gate import RecordingSpec
from dormouse.gate.record.hf import TrainerRecorder
from sft_train import SEQ, STEPS, VOCAB, build_model, build_optimizer, tokenizer  # noqa: F401 (the gate imports them from here)

BETA = 0.1
_REFERENCE = []


def reference_model():
    """DPO's frozen reference: the initial model, built once (what the trainer below is given as ref_model)."""
    if not _REFERENCE:
        _REFERENCE.append(build_model().eval().requires_grad_(False))
    return _REFERENCE[0]


def completion_logps(model, batch):
    """Each row's summed log-probability of its labelled next tokens (labels are -100 outside the completion)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * labels.ne(-100)).sum(1)


def dpo_objective(model, batches):
    """The step's DPO (sigmoid) loss summed over its pairs, and the number of pairs: in each recorded
    micro-batch the first half of the rows are the chosen completions, the second half the rejected ones."""
    loss, pairs = 0.0, 0
    for b in batches:
        chosen, rejected = completion_logps(model, b).chunk(2)
        with torch.no_grad():
            ref_chosen, ref_rejected = completion_logps(reference_model(), b).chunk(2)
        loss = loss - F.logsigmoid(BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))).sum()
        pairs += chosen.shape[0]
    return loss, pairs


def pairs(n: int = 64, seed: int = 0):
    """Preference pairs as text of the toy tokenizer: a prompt of 1..5 tokens, a chosen and a rejected
    completion of 1..6 tokens each ending in the eos token "t1" (so that TRL adds none), each starting
    with a space (TRL tokenizes prompt + completion as one string)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def words(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (k,), generator=g).tolist())

    return Dataset.from_list([{"prompt": words(1, 5), "chosen": " " + words(1, 6) + " t1",
                               "rejected": " " + words(1, 6) + " t1"} for _ in range(n)])


if __name__ == "__main__":
    from trl import DPOConfig, DPOTrainer

    model = build_model()
    args = DPOConfig("runs/dpo-trainer", use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, max_steps=STEPS, max_grad_norm=1.0, max_length=SEQ,
                     beta=BETA, loss_type=["sigmoid"], bf16=False, logging_steps=1, save_strategy="no",
                     report_to="none", disable_tqdm=True, seed=0)
    trainer = DPOTrainer(model=model, ref_model=reference_model(), args=args, train_dataset=pairs(),
                         processing_class=tokenizer(), optimizers=build_optimizer(model),
                         callbacks=[TrainerRecorder("runs/dpo", RecordingSpec(build_model="dpo_train:build_model",
                                                                              build_optimizer="dpo_train:build_optimizer",
                                                                              objective="dpo_train:dpo_objective",
                                                                              objective_scope="step"))])
    trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()
