"""Reproduction: TRL's DPOTrainer with loss_type ["sigmoid", "sft"] trains another
gradient under gradient accumulation than at the same batch in one forward.

    python examples/field/dpo_sft_term.py          # one process, CPU, well under a minute

`DPOTrainer._compute_loss` (trl 1.16, `trl/trainer/dpo_trainer.py`) computes
each micro-batch's loss as the mean over its pairs of the per-pair loss
(`per_sequence_loss.mean()`), and its "sft" term (the RPO-style negative
log-likelihood of the chosen completions) as the micro-batch's OWN token mean,
`-chosen_per_token_logps[chosen_mask.bool()].mean()`. The trainer declares
`loss_is_scaled_for_ga = False` and ignores `num_items_in_batch`, so the
Trainer divides each micro-batch's loss by the accumulation steps (and DDP
averages the ranks). With the same number of pairs in every micro-batch the
pairwise "sigmoid" term is then the mean over the global batch, as one process
computes it; the "sft" term is the mean of the micro-batches' token means,
which one process at the global batch does not compute: the micro-batches'
completion lengths weight it. The same holds across data-parallel ranks
(docs/field-report.md, row `dpo_sft`: 2 gloo ranks, gradient accumulation 2).

One process is enough to see it: the script trains one step on the same four
preference pairs twice, as 2 micro-batches of 2 pairs (gradient accumulation 2)
and as 1 batch of 4 pairs, with max_grad_norm 0 (nothing clips), reads the
gradient the Trainer hands the optimizer (`on_pre_optimizer_step`), and
compares the two, for loss_type ["sigmoid"] (equal) and ["sigmoid", "sft"].
"""

from __future__ import annotations

import sys
import tempfile

import torch

VOCAB, SEQ = 64, 16
PAIRS = [  # prompt, chosen, rejected (text of the toy tokenizer; completions of different lengths)
    ("t5 t9", " t3 t1", " t7 t8 t9 t10 t11 t12 t1"),
    ("t20 t21 t22", " t30 t31 t32 t33 t34 t35 t36 t1", " t40 t1"),
    ("t6", " t50 t51 t1", " t52 t53 t54 t1"),
    ("t60 t61", " t2 t3 t4 t5 t6 t7 t8 t9 t1", " t11 t1"),
]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        bos_token_id=1, eos_token_id=1, pad_token_id=0))


def gradient(loss_type: list[str], batch: int, ga: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    seen = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, use_cpu=True, bf16=False, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=ga, max_steps=1, max_grad_norm=0.0, report_to="none",
                         disable_tqdm=True, save_strategy="no", learning_rate=1e-3, loss_type=loss_type, beta=0.1,
                         max_length=SEQ, dataloader_num_workers=0, seed=0)
        DPOTrainer(model=model(), ref_model=model(), args=args, train_dataset=data, processing_class=tokenizer(),
                   callbacks=[Grab()]).train()
    return seen


def compare(g: dict, ref: dict) -> tuple[float, float, float]:
    """(least-squares factor c in g = c ref, ||g - ref|| / ||ref||, the residual after the factor)."""
    num = sum(float((g[k].double() * ref[k].double()).sum()) for k in ref)
    den = sum(float((ref[k].double() ** 2).sum()) for k in ref)
    diff = sum(float(((g[k].double() - ref[k].double()) ** 2).sum()) for k in ref) ** 0.5 / den ** 0.5
    c = num / den
    resid = sum(float(((g[k].double() - c * ref[k].double()) ** 2).sum()) for k in ref) ** 0.5 / den ** 0.5
    return c, diff, resid


def main() -> int:
    import transformers
    import trl

    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; "
          f"{len(PAIRS)} pairs, one optimizer step")
    for loss_type in (["sigmoid"], ["sigmoid", "sft"]):
        one = gradient(loss_type, batch=4, ga=1)       # the 4 pairs in one forward
        accumulated = gradient(loss_type, batch=2, ga=2)  # the same 4 pairs as 2 micro-batches of 2
        c, diff, resid = compare(accumulated, one)
        print(f"loss_type={loss_type!s:20} GA 2 x 2 pairs vs 1 x 4 pairs: ||g_GA - g_one|| / ||g_one|| = {diff:.2e} "
              f"(least-squares factor {c:.6f}, residual {resid:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
