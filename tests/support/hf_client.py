"""A real Hugging Face Trainer client of the gate, for tests: a tiny random-init
GPT-2 trained by `transformers.Trainer` as a data-parallel fleet, recorded by
`dormouse.gate.record.hf.TrainerRecorder`. Nothing is downloaded: the model
comes from a config, the data is generated.

Run under torchrun, one or more runs per launch (the imports and the process
group are paid once):

    torchrun --standalone --nproc_per_node=2 tests/support/hf_client.py \\
        --out DIR clean_avg:avg=1 clean_local:avg=0 mom:avg=1:fault=mean_of_means

Each run trains from the same initial model (`build_model`) with the same
optimizer and schedule (`build_optimizer`), on the same generated data
(`dataset`), and records into DIR/<name>. A run's fields:

  avg=0|1     TrainingArguments.average_tokens_across_devices (default 1, HF's default)
  seed=S      TrainingArguments.seed (the sampler's shuffle) and the data's seed
  steps=N     optimizer steps (max_steps)
  ga=K        gradient_accumulation_steps (default 2)
  eval=N      evaluate on a held-out set every N steps (eval-mode forwards: the Recorder ignores them)
  leg=1|2     a checkpoint restart in two runs of one name: leg 1 trains `stop` steps and saves
              a checkpoint; leg 2 resumes from it (`trainer.train(resume_from_checkpoint=...)`)
              to `steps`, recording into the same directory
  stop=S      leg 1's last step (default 2)
  gc=1        gradient checkpointing (the layers' forwards re-run in backward)
  bf16=1      bf16 autocast (TrainingArguments.bf16)
  examples=N  the dataset's size (default EXAMPLES); 18 with the global batch of 8 ends each epoch
              on an uneven batch, which accelerate's even_batches fills with the epoch's first examples
  flat=1      packed sequences: DataCollatorWithFlattening puts a micro-batch's rows in one row, its
              position_ids restarting at each sequence (a forward keyword the callback is not told of)
  drop=1      dataloader_drop_last=True (the uneven end of an epoch is dropped instead)
  unused=1    the model holds a parameter its forward never uses (build_model(unused=True))
  dropout=P   GPT-2's dropouts (resid, embd, attn) at p P (build_model(dropout=P)): each micro-batch's masks
              are drawn from the RNG state the Trainer's forward starts from
  moe=1       the model is a tiny random-init Qwen3-MoE (build_model(moe=True)) with
              output_router_logits=True: its forward adds router_aux_loss_coef x
              transformers' load_balancing_loss_func over that forward's own router
              logits to its loss (modeling_qwen3_moe.py, Qwen3MoeForCausalLM.forward)
  bs=B        per_device_train_batch_size (default 2)
  scope=S     the TrainerRecorder's objective_scope (default "example")
  selfcheck=K the TrainerRecorder's in-run checks, K sampled elements per tensor (default 0: off)
  objective=O the TrainerRecorder's objective (default causal_lm; "global": moe_global_step below)
  build=main  name the builders "__main__:..." (the script itself: bad input, refused in one line)
  loss_type=T model.loss_type before the Trainer is built. GPT2LMHeadModel's is None
              (its class name holds no "ForCausalLM"), so transformers 5.24's
              Trainer counts num_items_in_batch over the UNSHIFTED labels (one
              target too many per row; #46204's fix keys on loss_type) while
              the loss sums over the shifted ones: loss_type=ForCausalLM makes it
              count the shifted labels, which the model's loss divides by.
  fault=F     a planted fault, through HF's own extension points (a Trainer
              subclass or a Trainer attribute), never by patching private names:

    mean_of_means   HF's pre-fix (2024) gradient accumulation: the model is told it
                    takes no loss kwargs, so each micro-batch's loss is its own
                    token mean, divided by the accumulation steps
                    (`trainer.model_accepts_loss_kwargs = False`; transformers
                    #34191/#34198 fixed the default path)
    no_world_comp   the loss is not multiplied back by the world size after
                    DDP's average (compute_loss divides HF's compensation out):
                    the gradient is 1/W of the global token mean's
    world_comp_x2   the world-size compensation applied twice: W x the gradient
    logged_rank_means  the gradient is right, but the loss the Trainer logs is the
                    mean over ranks of each rank's own token mean
                    (training_step returns S_r / N_r instead of the Trainer's W S_r / N)
    unused_zero     (with unused=1) a callback before the Recorder gives every parameter
                    without a gradient a zero one at on_pre_optimizer_step (what DDP
                    once did, pytorch #28294): AdamW's weight decay then moves it
    no_sched_file   (leg 2) the checkpoint's scheduler.pt is missing (a checkpoint copied
                    without it): transformers 5.24 then loads NEITHER the optimizer's nor
                    the scheduler's state, silently, and resumes with fresh ones

The model, optimizer and data are functions of this module so that the
judge's reference can rebuild them in one process: `build_model`,
`build_optimizer` are the import paths the recording names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

VOCAB = 64      # byte-free toy vocabulary; token 0 is the padding
SEQ = 16        # every sequence padded to SEQ tokens
EXAMPLES = 64   # examples in the generated dataset
LR = 3e-3       # AdamW's peak lr
WARMUP = 0      # linear warm-up steps (HF's default 0), then linear decay to 0 at MAX_STEPS
MAX_STEPS = 4   # the schedule's horizon (runs may stop earlier)
MODEL_SEED = 1234  # the initial model's seed: one initial model for every run
EXPERTS = 4     # the MoE model's experts (moe=1), two routed a token
AUX_COEF = 0.5  # its router_aux_loss_coef: large, so that the load-balancing term shows in the gradient
MODULE = "hf_client"  # this file's module name wherever tests/support is on sys.path (not __main__)


def build_model(unused: bool = False, moe: bool = False, dropout: float = 0.0):
    """The same random-init GPT-2 in any process: 2 layers, n_embd 32, no dropout (`dropout`: GPT-2's
    resid_pdrop, embd_pdrop and attn_pdrop at that p, torch's own dropout);
    `unused` adds a Linear(4, 4) the forward never calls (`model.extra`).
    moe: a Qwen3-MoE instead (1 layer, hidden 32, EXPERTS experts, top 2,
    output_router_logits=True, router_aux_loss_coef AUX_COEF)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=SEQ,
                             output_router_logits=True, router_aux_loss_coef=AUX_COEF, initializer_range=0.2,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0)
        model_class = Qwen3MoeForCausalLM
    else:
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)
        model_class = GPT2LMHeadModel
    g = torch.random.get_rng_state()
    torch.manual_seed(MODEL_SEED)
    try:
        model = model_class(cfg)
        if unused:
            model.extra = torch.nn.Linear(4, 4)
        return model
    finally:
        torch.random.set_rng_state(g)


def build_optimizer(model, unused: bool = False, moe: bool = False, dropout: float = 0.0):
    """AdamW (weight decay 0.01 on matrices, none on biases and LayerNorm, HF's
    split) and a linear warm-up/decay schedule: what every run hands the Trainer."""
    from transformers import get_linear_schedule_with_warmup

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    return opt, get_linear_schedule_with_warmup(opt, WARMUP, MAX_STEPS)


def moe_global_step(model, batches):
    """The MoE model's objective over the GLOBAL batch, for objective_scope="step"
    (what a user declares who means one process at the global batch): every row
    of the step in ONE forward, the token mean of the shifted labels' cross-entropy
    plus router_aux_loss_coef x the model's load-balancing term over that
    forward's routing statistics, the global batch's. Returns (loss_sum, count)."""
    import torch.nn.functional as F

    ids, mask, labels = (torch.cat([b[k] for b in batches]) for k in ("input_ids", "attention_mask", "labels"))
    out = model(input_ids=ids, attention_mask=mask)
    y = labels[:, 1:]
    n = int((y != -100).sum())
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum")
    return ce + model.router_aux_loss_coef * out.aux_loss * n, n


class PaddedSequences(torch.utils.data.Dataset):
    """n (EXAMPLES) random token sequences of lengths 3..SEQ, right-padded with 0:
    attention_mask 0 and labels -100 at the padding."""

    def __init__(self, seed: int, n: int = EXAMPLES, flat: bool = False):
        g = torch.Generator().manual_seed(10_000 + seed)
        self.rows, self.flat = [], flat
        for _ in range(n):
            n = int(torch.randint(3, SEQ + 1, (1,), generator=g))
            ids = torch.zeros(SEQ, dtype=torch.long)
            ids[:n] = torch.randint(1, VOCAB, (n,), generator=g)
            mask = (torch.arange(SEQ) < n).long()
            self.rows.append({"input_ids": ids, "attention_mask": mask,
                              "labels": torch.where(mask.bool(), ids, torch.full_like(ids, -100))})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        if self.flat:  # the row unpadded, for DataCollatorWithFlattening
            return {"input_ids": self.rows[i]["input_ids"][self.rows[i]["attention_mask"].bool()].tolist()}
        return dict(self.rows[i])


def trainer_class(fault: str | None):
    """transformers.Trainer, or a subclass with the planted fault."""
    from transformers import Trainer

    if fault in (None, "", "mean_of_means", "no_sched_file", "unused_zero"):
        return Trainer  # mean_of_means: a Trainer attribute; no_sched_file: a file; unused_zero: a callback

    class Faulty(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if fault not in ("no_world_comp", "world_comp_x2"):
                return out
            w = self.accelerator.num_processes
            f = 1.0 / w if fault == "no_world_comp" else float(w)
            return (out[0] * f, out[1]) if return_outputs else out * f

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            # this rank's own target tokens in the step (labels shifted by one)
            self._local_items = sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in batches)
            return batches, n

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if fault != "logged_rank_means":
                return loss
            # the Trainer's value is W S_rm / N (N the global count); report S_rm / N_r instead
            w = self.accelerator.num_processes
            return loss * float(num_items_in_batch) / (w * self._local_items)

    if fault not in ("no_world_comp", "world_comp_x2", "logged_rank_means"):
        raise SystemExit(f"hf_client: unknown fault {fault!r}")
    return Faulty


def parse_run(text: str) -> dict:
    name, *fields = text.split(":")
    run = {"name": name, "avg": True, "seed": 0, "steps": MAX_STEPS, "ga": 2, "eval": 0, "fault": None,
           "loss_type": None, "build": MODULE, "leg": 0, "stop": 2, "gc": 0, "bf16": 0,
           "unused": 0, "examples": EXAMPLES, "drop": 0, "flat": 0, "moe": 0, "bs": 2, "scope": "example",
           "objective": "causal_lm", "selfcheck": 0, "dropout": 0.0}
    for f in fields:
        k, _, v = f.partition("=")
        if k == "avg":
            run["avg"] = v == "1"
        elif k in ("seed", "steps", "ga", "eval", "leg", "stop", "gc", "bf16", "unused", "examples", "drop", "flat", "moe", "bs",
                   "selfcheck"):
            run[k] = int(v)
        elif k in ("fault", "loss_type", "scope", "objective"):
            run[k] = v
        elif k == "dropout":
            run[k] = float(v)
        elif k == "build":
            run[k] = "__main__" if v == "main" else v
        else:
            raise SystemExit(f"hf_client: unknown run field {k!r} in {text!r}")
    return run


def train(run: dict, out: Path, record: bool = True) -> dict:
    """One Trainer run, recorded into out/<name>; returns what the Trainer logged."""
    from transformers import TrainerCallback, TrainingArguments

    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.hf import TrainerRecorder

    # the gate's line: a bad argument fails here, in one line, before anything is built
    kw = {**({"unused": True} if run["unused"] else {}), **({"moe": True} if run["moe"] else {}),
          **({"dropout": run["dropout"]} if run["dropout"] else {})}
    recorder = [TrainerRecorder(out / run["name"], RecordingSpec(
        build_model=f"{run['build']}:build_model", build_optimizer=f"{run['build']}:build_optimizer",
        objective=run["objective"] if run["objective"] != "global" else f"{run['build']}:moe_global_step",
        build_kwargs=kw, objective_scope=run["scope"], selfcheck=run["selfcheck"]))] if record else []
    args = TrainingArguments(
        output_dir=str(out / run["name"] / "hf"), use_cpu=True, ddp_backend="gloo",
        per_device_train_batch_size=run["bs"], gradient_accumulation_steps=run["ga"], max_grad_norm=1.0,
        max_steps=run["stop"] if run["leg"] == 1 else run["steps"], logging_steps=1,
        save_strategy="steps" if run["leg"] == 1 else "no", save_steps=run["stop"], report_to="none",
        disable_tqdm=True, seed=run["seed"], average_tokens_across_devices=run["avg"],
        dataloader_num_workers=0, eval_strategy="steps" if run["eval"] else "no", eval_steps=run["eval"] or None,
        per_device_eval_batch_size=4, gradient_checkpointing=bool(run["gc"]), bf16=bool(run["bf16"]),
        dataloader_drop_last=bool(run["drop"]),
    )
    model = build_model(**kw)
    if run.get("loss_type"):
        model.loss_type = run["loss_type"]
    logged: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            logged.append({"step": state.global_step, **(logs or {})})

    class ZeroUnused(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    callbacks = [Keep()] + ([ZeroUnused()] if run["fault"] == "unused_zero" else []) + recorder
    held_out = PaddedSequences(run["seed"] + 1_000) if run["eval"] else None
    data = PaddedSequences(run["seed"], run["examples"], flat=bool(run["flat"]))
    if run["flat"]:
        from transformers import DataCollatorWithFlattening

        extra = {"data_collator": DataCollatorWithFlattening()}
    else:
        extra = {}
    trainer = trainer_class(run["fault"])(model=model, args=args, train_dataset=data, **extra,
                                          eval_dataset=held_out,
                                          optimizers=build_optimizer(model, **kw), callbacks=callbacks)
    if run["fault"] == "mean_of_means":
        trainer.model_accepts_loss_kwargs = False
    checkpoint = None
    if run["leg"] == 2:
        checkpoint = out / run["name"] / "hf" / f"checkpoint-{run['stop']}"
        if run["fault"] == "no_sched_file" and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            (checkpoint / "scheduler.pt").unlink(missing_ok=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    return {"name": run["name"], "logged": logged}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("runs", nargs="+", help="name[:field=value...], fields as in the module docstring")
    p.add_argument("--no-record", action="store_true", help="train without the Recorder (overhead figures)")
    a = p.parse_args(argv)
    import torch.distributed as dist

    from dormouse.errors import DormouseError

    results, rc = [], 0
    for text in a.runs:
        t0 = time.perf_counter()
        try:
            res = train(parse_run(text), a.out, record=not a.no_record)
        except DormouseError as e:  # bad input: one line, exit 2 (what a researcher's script should do too)
            print(f"error: {e}", file=sys.stderr, flush=True)
            rc = 2
            break
        res["seconds"] = time.perf_counter() - t0
        results.append(res)
    if rc == 0 and int(os.environ.get("RANK", "0")) == 0:
        (a.out / "hf_client.json").write_text(json.dumps(results, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
