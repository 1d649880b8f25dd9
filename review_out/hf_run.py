"""HF Trainer / TRL SFTTrainer / PEFT LoRA clients with the dormouse HF callback.

torchrun --standalone --nproc_per_node=2 hf_run.py --out runs/NAME --kind sft|sft_pack|hf_lora [--fault double_k]
Toy word-level tokenizer built here, tiny random-init Llama, data handed over as token ids."""
import argparse
import math
import os

import torch

VOCAB, SEQ = 64, 16


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(5)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        bos_token_id=1, eos_token_id=1, pad_token_id=0))


def build_model(**_):
    return _llama()


def build_lora(**_):
    from peft import LoraConfig, get_peft_model
    net = _llama()
    torch.manual_seed(6)
    return get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                          task_type="CAUSAL_LM"))


def build_optimizer(model, **_):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def rows(n=32):
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(n):
        L = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(2, VOCAB, (L - 1,), generator=g).tolist() + [1]})
    return out


if __name__ == "__main__":
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from dormouse.gate.record.hf import RecorderCallback

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="sft")
    ap.add_argument("--fault", default="none")
    a, _ = ap.parse_known_args()
    rank = int(os.environ.get("RANK", 0))
    lora = a.kind in ("hf_lora", "sft_lora")
    builder = "hf_run:build_lora" if lora else "hf_run:build_model"
    model = build_lora() if lora else build_model()
    os.makedirs(f"{a.out}_truth", exist_ok=True)

    class Saver(TrainerCallback):
        """The client's own record (independent of the gate): inputs, parameters, applied gradient."""
        def __init__(self):
            self.batches, self.k = [], 0
            self.params = {n: p.detach().clone() for n, p in model.named_parameters()}
            model.register_forward_pre_hook(self.pre, with_kwargs=True)

        def pre(self, mod, args, kw):
            if mod.training and torch.is_grad_enabled():
                self.batches.append({k: kw[k].detach().clone() for k in
                                     ("input_ids", "labels", "attention_mask", "position_ids") if kw.get(k) is not None})

        def on_pre_optimizer_step(self, args, state, control, **k):
            self.k += 1
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            torch.save({"params": self.params, "grads": grads, "loss": math.nan, "batches": self.batches},
                       f"{a.out}_truth/rank{rank}_step{self.k}.pt")
            self.batches = []

        def on_step_end(self, args, state, control, **k):
            self.params = {n: p.detach().clone() for n, p in model.named_parameters()}

    cbs = [RecorderCallback(a.out, build_model=builder, build_optimizer="hf_run:build_optimizer",
                            objective="causal_lm"), Saver()]
    common_args = dict(output_dir=f"{a.out}_hf", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       max_steps=3, max_grad_norm=0.0, report_to=[], save_strategy="no", logging_steps=1,
                       use_cpu=True, bf16=False, seed=0, dataloader_drop_last=True)
    if a.kind.startswith("sft"):
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer
        cfg = SFTConfig(**common_args, max_length=SEQ if a.kind != "sft_pack" else 24,
                        packing=(a.kind == "sft_pack"), dataset_num_proc=None)
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows()),
                             processing_class=tokenizer(), optimizers=build_optimizer(model), callbacks=cbs)
    else:
        class Padded(torch.utils.data.Dataset):
            def __init__(self):
                self.r = rows()

            def __len__(self):
                return len(self.r)

            def __getitem__(self, i):
                ids = torch.zeros(SEQ, dtype=torch.long)
                n = len(self.r[i]["input_ids"])
                ids[:n] = torch.tensor(self.r[i]["input_ids"])
                m = (torch.arange(SEQ) < n).long()
                return {"input_ids": ids, "attention_mask": m, "labels": torch.where(m.bool(), ids, -100)}

        class MyTrainer(Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                if a.fault == "double_k":       # the pre-2024 idiom kept after HF started dividing itself
                    loss = loss / self.args.gradient_accumulation_steps
                return loss

        model.loss_type = "ForCausalLM"
        trainer = MyTrainer(model=model, args=TrainingArguments(**common_args), train_dataset=Padded(),
                            optimizers=build_optimizer(model), callbacks=cbs)
    trainer.train()
