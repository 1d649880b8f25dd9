"""Hugging Face clients beyond the plain Trainer, for tests and the field sweep:
TRL's `SFTTrainer` and PEFT LoRA adapters, recorded by the HF callback
(`dormouse.gate.record.hf.TrainerRecorder`), under torchrun (gloo, CPU).
Nothing is downloaded: random-init models from configs built here, a toy
tokenizer built here (64 word-level tokens "t0".."t63"; token 0 pads, 1 ends),
the data generated and handed over as token ids (TRL's "processed" path).

    torchrun --standalone --nproc_per_node=2 tests/support/trl_client.py --out DIR sft:trainer=sft ...

A run's fields:
  trainer=hf|sft|dpo transformers.Trainer (with DataCollatorForLanguageModeling-style padding
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
  pack=1           SFT: packing=True (TRL's default "bfd" strategy, which turns padding-free on: each
                   micro-batch one row of concatenated examples, position_ids restarting at each, no
                   attention_mask; the Recorder records position_ids as it records every tensor keyword
                   with the batch's rows)
  pf=1             SFT: padding_free=True without packing (the micro-batch's examples concatenated)
  pad=left         hf: the rows padded on the left (Padded; the attention mask starts with zeros)
  examples=N       the dataset's examples (default 64); drop=1 dataloader_drop_last=True
  compile=1        TrainingArguments.torch_compile=True (torch.compile of the model, inductor on CPU)
  trainer=dpo      trl.DPOTrainer (sigmoid loss, beta 0.1) on generated preference pairs (prompt, chosen,
                   rejected, text of the toy tokenizer), with the reference model passed in: a second
                   model built by build_model (the initial policy, frozen). The objective is declared
                   per pair over the whole step (dpo_objective, objective_scope="step"): see below
  dpo=sigmoid+sft  DPOConfig(loss_type=["sigmoid", "sft"]): the pairwise loss plus the chosen
                   completions' negative log-likelihood (RPO), declared as one process at the global
                   batch computes it (dpo_sft_objective)

DPO, read from trl 1.16's `trl/trainer/dpo_trainer.py`:
* The collator (`DataCollatorForPreference.torch_call`) puts a micro-batch's B pairs in ONE forward of
  2B rows, chosen rows first, rejected rows after (prompt + completion, right-padded), with a
  `completion_mask`; `DPOTrainer._compute_loss` passes `labels = input_ids` masked to -100 outside
  the completion (and on padding) with `fused_lm_head=True` (`add_fused_lm_head`, `trainer/utils.py`:
  per-token log-probabilities of the next-token labels instead of logits), sums them per row, and
  splits the rows back into pairs (`logps.chunk(2, dim=0)`).
* The reference log-probabilities come from `self.ref_model` under `torch.no_grad()` (a separate
  module: the Recorder, hooked on the trained model, does not see its forward). The loss per pair
  ("sigmoid") is -logsigmoid(beta * ((c - c_ref) - (r - r_ref))), and the micro-batch's loss is the
  MEAN over its pairs (`per_sequence_loss.mean()`); "sft" adds `-chosen_per_token_logps[mask].mean()`,
  the micro-batch's own token mean over its chosen completions.
* `DPOTrainer.loss_is_scaled_for_ga = False` and `compute_loss` ignores `num_items_in_batch`: the
  Trainer divides each micro-batch's loss by the accumulation steps, DDP averages the ranks. With B
  pairs in every micro-batch (accelerate's even_batches fills the last), the fleet's gradient is the
  mean over every pair of the global batch: what one process computes. The "sft" term is the mean
  of the micro-batches' token means instead, which one process at the global batch does not compute.
* The gate's objectives are sums over rows; a pair is two rows of one forward (row i and row i + B),
  so a row alone is no example and the merged forward of the step's rows would pair the wrong rows.
  The objective is therefore declared over the whole step (objective_scope="step",
  fn(model, batches) -> (loss sum over pairs, pairs)): it pairs the rows within each recorded
  micro-batch, and computes the reference log-probabilities from the initial model (build_model),
  which is the reference DPOTrainer was given. What the gate then does not check for DPO: that a
  pair's gradient is independent of the pairs beside it (no per-example or merged-forward check under
  scope "step"), and it names no alternative weighting (micro_mean, rank_mean) on a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402  (tests/support)
import families  # noqa: E402

VOCAB, SEQ, EXAMPLES, LR, MODEL_SEED = 64, 16, 64, 3e-3, 1234
DPO_BETA = 0.1
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


def preference_pairs(seed: int, n: int = EXAMPLES) -> list[dict]:
    """Preference rows as text of the toy tokenizer: a prompt of 1..5 tokens, a chosen and a rejected
    completion of 1..8 tokens each, each ending in the eos "t1" (so that TRL adds none) and starting
    with a space (TRL tokenizes prompt + completion as one string)."""
    g = torch.Generator().manual_seed(30_000 + seed)

    def words(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (k,), generator=g).tolist())

    return [{"prompt": words(1, 5), "chosen": " " + words(1, 8) + " t1", "rejected": " " + words(1, 8) + " t1"}
            for _ in range(n)]


class Padded(torch.utils.data.Dataset):
    """rows() padded to SEQ for the plain Trainer (on the right, or the left): attention_mask, labels
    -100 on padding (and prompt)."""

    def __init__(self, data: list[dict], side: str = "right"):
        self.data, self.side = data, side

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        r = self.data[i]
        n = len(r["input_ids"])
        at = slice(SEQ - n, SEQ) if self.side == "left" else slice(0, n)
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[at] = torch.tensor(r["input_ids"])
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[at] = 1
        keep = mask.clone()
        if "completion_mask" in r:
            keep[at] = torch.tensor(r["completion_mask"])
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(keep.bool(), ids, -100)}


# --------------------------------------------------------------------------- DPO's objective, declared

_REFERENCES: dict = {}


def _reference_model(model):
    """DPO's frozen reference beside `model`: the initial model of the same architecture (build_model),
    which is what the client hands DPOTrainer as ref_model."""
    arch = model.config.model_type
    arch = arch if arch in families.FAMILIES or arch == "gpt2" else "llama"
    if arch not in _REFERENCES:
        ref = build_model(arch)
        ref.eval()
        ref.requires_grad_(False)
        _REFERENCES[arch] = ref
    return _REFERENCES[arch]


def _completion_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its labelled next tokens, the per-token ones, and where
    a label is (what DPOTrainer's fused LM head gives: labels -100 outside the completion)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    y = batch["labels"][:, 1:]
    keep = y.ne(-100)
    per = torch.log_softmax(logits.float(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    return per.sum(1), per, keep


def _dpo(model, batches: list[dict], sft: bool):
    ref = _reference_model(model)
    loss, pairs, nll, tokens = 0.0, 0, 0.0, 0
    for b in batches:  # each recorded micro-batch: B chosen rows, then their B rejected rows
        logps, per, keep = _completion_logps(model, b)
        with torch.no_grad():
            ref_logps = _completion_logps(ref, b)[0]
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = ref_logps.chunk(2)
        loss = loss - F.logsigmoid(DPO_BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))).sum()
        pairs += chosen.shape[0]
        if sft:
            nll = nll - per[: chosen.shape[0]].sum()
            tokens += int(keep[: chosen.shape[0]].sum())
    if sft:  # one process at the global batch: the chosen completions' token mean over the whole batch
        loss = loss + pairs * nll / tokens
    return loss, pairs


def dpo_objective(model, batches):
    """DPO (sigmoid): the step's pairs' summed -logsigmoid(beta (chosen - rejected log-ratio)), per pair"""
    return _dpo(model, batches, sft=False)


def dpo_sft_objective(model, batches):
    """DPO (sigmoid) plus the chosen completions' negative log-likelihood, its token mean over the global batch"""
    return _dpo(model, batches, sft=True)


def parse_run(text: str) -> dict:
    name, *fields = text.split(":")
    run = {"name": name, "trainer": "sft", "model": "llama", "lora": 0, "completion": 0, "ga": 2, "seed": 0,
           "steps": 4, "fault": None, "loss_type": None, "bf16": 0, "aux": 0, "gc": 0,
           "avg": 1, "pack": 0, "pf": 0, "pad": "right", "examples": EXAMPLES, "drop": 0, "compile": 0,
           "dpo": "sigmoid"}
    ints = ("lora", "completion", "ga", "seed", "steps", "bf16", "aux", "gc", "avg", "pack", "pf", "examples",
            "drop", "compile")
    for f in fields:
        k, _, v = f.partition("=")
        if k in ints:
            run[k] = int(v)
        elif k in ("trainer", "model", "fault", "loss_type", "pad", "dpo"):
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
    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.hf import TrainerRecorder

    kw = build_kwargs(run)
    model = build_model(**kw)
    objective, scope = "causal_lm", "example"
    if run["trainer"] == "dpo":  # per pair, over the whole step (see the module docstring)
        objective = f"{MODULE}:{'dpo_sft_objective' if 'sft' in run['dpo'].split('+') else 'dpo_objective'}"
        scope = "step"
    callback = TrainerRecorder(out / run["name"], RecordingSpec(build_model=f"{MODULE}:build_model",
                                                                build_optimizer=f"{MODULE}:build_optimizer",
                                                                objective=objective, build_kwargs=kw,
                                                                objective_scope=scope))
    common = dict(output_dir=str(out / run["name"] / "hf"), use_cpu=True, ddp_backend="gloo",
                  per_device_train_batch_size=2, gradient_accumulation_steps=run["ga"], max_grad_norm=1.0,
                  max_steps=run["steps"], logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                  seed=run["seed"], dataloader_num_workers=0, bf16=bool(run["bf16"]),
                  gradient_checkpointing=bool(run["gc"]), average_tokens_across_devices=bool(run["avg"]),
                  dataloader_drop_last=bool(run["drop"]), torch_compile=bool(run["compile"]))
    data = rows(run["seed"], bool(run["completion"]), run["examples"])
    if run["trainer"] == "hf":
        from transformers import Trainer, TrainingArguments

        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=Padded(data, run["pad"]),
                          optimizers=build_optimizer(model), callbacks=[callback])
    elif run["trainer"] == "dpo":
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        cfg = DPOConfig(**common, max_length=SEQ, beta=DPO_BETA, loss_type=run["dpo"].split("+"),
                        dataset_num_proc=None, precompute_ref_log_probs=False)
        trainer = DPOTrainer(model=model, ref_model=build_model(**kw), args=cfg,
                             train_dataset=Dataset.from_list(preference_pairs(run["seed"], run["examples"])),
                             processing_class=tokenizer(), optimizers=build_optimizer(model), callbacks=[callback])
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
        # padding-free without packing enforces no max_length (TRL refuses one): the rows are short already
        cfg = SFTConfig(**common, max_length=None if run["pf"] and not run["pack"] else SEQ, completion_only_loss=bool(run["completion"]),
                        dataset_num_proc=None, packing=bool(run["pack"]), padding_free=bool(run["pf"]))
        trainer = cls(model=model, args=cfg, train_dataset=Dataset.from_list(data), processing_class=tokenizer(),
                      optimizers=build_optimizer(model), callbacks=[callback])
    trainer.train()


def main(argv: list[str] | None = None) -> int:
    return plan.runs_main(train, parse_run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
