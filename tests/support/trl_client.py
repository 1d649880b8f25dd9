"""Hugging Face clients beyond the plain Trainer, for tests and the field sweep:
TRL's `SFTTrainer` and PEFT LoRA adapters, recorded by the HF callback
(`dormouse.gate.record.hf.RecorderCallback`), under torchrun (gloo, CPU).
Nothing is downloaded: random-init models from configs built here, a toy
tokenizer built here (64 word-level tokens "t0".."t63"; token 0 pads, 1 ends),
the data generated and handed over as token ids (TRL's "processed" path).

    torchrun --standalone --nproc_per_node=2 tests/support/trl_client.py --out DIR sft:trainer=sft ...

A run's fields:
  trainer=hf|sft   transformers.Trainer (with DataCollatorForLanguageModeling-style padding
                   done here) or trl.SFTTrainer (its own collator pads)
  model=llama|gpt2 LlamaForCausalLM (hidden 32, 2 layers) or GPT2LMHeadModel (n_embd 32, 2 layers),
                   or a family of families.py (qwen2, qwen3, mistral, gemma, gemma2, phi3, olmo2, granite,
                   and the MoE mixtral, qwen3_moe, olmoe)
  aux=1            (MoE) output_router_logits: the model adds its load-balancing loss to the loss
  gc=1             gradient checkpointing
  avg=0            average_tokens_across_devices=False (each rank divides by its own token count)
  lora=1           the model wrapped by peft.get_peft_model(LoraConfig(r=4, target q/v or c_attn)):
                   the base frozen, only the adapters train (build_model builds the same wrapped model)
  completion=1     prompt-completion rows: labels -100 on the prompt (SFT: completion_only_loss over
                   a "completion_mask" column; hf: labels built here)
  bf16=0|1         TrainingArguments.bf16 (SFTConfig's default is True: CPU bfloat16 autocast; default
                   here 0, float32, so the gate's bound is 1e-5 rather than 10x the bfloat16 floor)
  packing=1        SFTConfig(packing=True): rows packed into padding-free micro-batches (position_ids,
                   and TRL's max_length_q/k keywords, each micro-batch its own)
  ga=K             gradient_accumulation_steps (default 2); seed=S; steps=N (default 4)
  fault=no_items   an SFTTrainer subclass whose compute_loss drops num_items_in_batch (what TRL's
                   distillation trainers did until TRL PR #6006): each micro-batch's own token mean
  loss_type=T      model.loss_type (GPT-2's is None: the Trainer then counts unshifted labels)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402

VOCAB, SEQ, EXAMPLES, LR, MODEL_SEED = 64, 16, 64, 3e-3, 1234
MODULE = "trl_client"


def tokenizer():
    """A word-level toy tokenizer built in code (no download): t0 pads, t1 ends."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def build_model(arch: str = "llama", lora: bool = False, loss_type: str | None = None, router_aux: bool = False,
                **_):
    """The same random-init causal LM in any process (seeded, the caller's RNG restored)."""
    g = torch.random.get_rng_state()
    torch.manual_seed(MODEL_SEED)
    try:
        if arch in families.FAMILIES:
            net = families.build(arch, router_aux=router_aux)
            targets = ["q_proj", "v_proj"]
        elif arch == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            net = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                             eos_token_id=1, pad_token_id=0))
            targets = ["c_attn"]
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            net = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                               max_position_embeddings=SEQ, bos_token_id=1, eos_token_id=1,
                                               pad_token_id=0, attention_dropout=0.0))
            targets = ["q_proj", "v_proj"]
        if loss_type:
            net.loss_type = loss_type
        if lora:
            from peft import LoraConfig, get_peft_model

            net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                 task_type="CAUSAL_LM"))
        return net
    finally:
        torch.random.set_rng_state(g)


def build_optimizer(model, **_):
    """AdamW over the trainable parameters and a linear decay to 0 at 4 steps."""
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    return opt, get_linear_schedule_with_warmup(opt, 0, 4)


def rows(seed: int, completion: bool, n: int = EXAMPLES) -> list[dict]:
    """Token rows of lengths 3..SEQ (ids 2..63, ending in 1); with completion, a prompt of 1..len-2 tokens."""
    g = torch.Generator().manual_seed(20_000 + seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length - 1,), generator=g).tolist() + [1]
        row = {"input_ids": ids}
        if completion:
            p = int(torch.randint(1, length - 1, (1,), generator=g))
            row["completion_mask"] = [0] * p + [1] * (length - p)
        out.append(row)
    return out


class Padded(torch.utils.data.Dataset):
    """rows() right-padded to SEQ for the plain Trainer: attention_mask, labels -100 on padding (and prompt)."""

    def __init__(self, data: list[dict]):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        r = self.data[i]
        n = len(r["input_ids"])
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:n] = torch.tensor(r["input_ids"])
        mask = (torch.arange(SEQ) < n).long()
        keep = mask.clone()
        if "completion_mask" in r:
            keep[:n] = torch.tensor(r["completion_mask"])
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(keep.bool(), ids, -100)}


def parse_run(text: str) -> dict:
    name, *fields = text.split(":")
    run = {"name": name, "trainer": "sft", "model": "llama", "lora": 0, "completion": 0, "ga": 2, "seed": 0,
           "steps": 4, "fault": None, "loss_type": None, "bf16": 0, "aux": 0, "gc": 0,
           "avg": 1, "packing": 0}
    for f in fields:
        k, _, v = f.partition("=")
        if k in ("lora", "completion", "ga", "seed", "steps", "bf16", "aux", "gc", "avg", "packing"):
            run[k] = int(v)
        elif k in ("trainer", "model", "fault", "loss_type"):
            run[k] = v
        else:
            raise SystemExit(f"trl_client: unknown run field {k!r} in {text!r}")
    return run


def build_kwargs(run: dict) -> dict:
    kw = {"arch": run["model"], "lora": bool(run["lora"])}
    if run["loss_type"]:
        kw["loss_type"] = run["loss_type"]
    if run["aux"]:
        kw["router_aux"] = True
    return kw


def train(run: dict, out: Path) -> None:
    from dormouse.gate.record.hf import RecorderCallback

    kw = build_kwargs(run)
    model = build_model(**kw)
    callback = RecorderCallback(out / run["name"], build_model=f"{MODULE}:build_model",
                                build_optimizer=f"{MODULE}:build_optimizer", objective="causal_lm", build_kwargs=kw)
    common = dict(output_dir=str(out / run["name"] / "hf"), use_cpu=True, ddp_backend="gloo",
                  per_device_train_batch_size=2, gradient_accumulation_steps=run["ga"], max_grad_norm=1.0,
                  max_steps=run["steps"], logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                  seed=run["seed"], dataloader_num_workers=0, bf16=bool(run["bf16"]),
                  gradient_checkpointing=bool(run["gc"]), average_tokens_across_devices=bool(run["avg"]))
    data = rows(run["seed"], bool(run["completion"]))
    if run["trainer"] == "hf":
        from transformers import Trainer, TrainingArguments

        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=Padded(data),
                          optimizers=build_optimizer(model), callbacks=[callback])
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        cls = SFTTrainer
        if run["fault"] == "no_items":
            class NoItems(SFTTrainer):
                def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                    return super().compute_loss(model, inputs, return_outputs, None)

            cls = NoItems
        elif run["fault"]:
            raise SystemExit(f"trl_client: unknown fault {run['fault']!r}")
        cfg = SFTConfig(**common, max_length=SEQ, completion_only_loss=bool(run["completion"]),
                        dataset_num_proc=None, packing=bool(run["packing"]))
        trainer = cls(model=model, args=cfg, train_dataset=Dataset.from_list(data), processing_class=tokenizer(),
                      optimizers=build_optimizer(model), callbacks=[callback])
    trainer.train()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("runs", nargs="+")
    a = p.parse_args(argv)
    import torch.distributed as dist

    from dormouse.errors import DormouseError

    rc = 0
    for text in a.runs:
        try:
            train(parse_run(text), a.out)
        except DormouseError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            rc = 2
            break
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
