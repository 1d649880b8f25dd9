"""TRL's GRPOTrainer as a client of the HF callback (`dormouse.gate.record.hf.TrainerRecorder`),
generation included, under torchrun (gloo, CPU), for tests and the field sweep. Nothing is
downloaded: the random-init tiny Llama and the toy tokenizer of trl_client.py, prompts of 1..3
toy words, a reward computed here (the fraction of a completion's tokens with an even id).

    torchrun --standalone --nproc_per_node=2 tests/support/grpo_client.py --out DIR dapo:loss=dapo ...

A run's fields:
  loss=dapo|grpo|dr_grpo|bnpo  GRPOConfig.loss_type (trl 1.16's default is dapo)
  ga=K          gradient_accumulation_steps (default 2); per-device batch 2 rows
  spg=S         steps_per_generation (default: K, TRL's default): S > K spreads one generation batch
                over S / K optimizer steps, its later micro-batches trained off-policy (old log-probs)
  gens=G        num_generations (default 4: a step's 8 rows are 2 prompts x 4 completions)
  steps=N       optimizer steps (default 2); seed=S
  declare=D     the objective the recording declares: token (the global token mean), sequence (the
                mean over completions of each one's token mean), dr (the sum over completion tokens /
                (completions x max_completion_length)); default: the loss type's own (below)
  fault=half    a GRPOTrainer subclass whose loss is halved (the x 0.5 class of TRL PR #6024)
  fault=async   (with loss=dapo) the loss normalised as trl 1.16's AsyncGRPOTrainer normalises it
                (trl/experimental/async_grpo/async_grpo_trainer.py: line 615, the collator's
                global_n_tokens = the micro-batch's trained tokens over every rank; lines 1535-1544,
                loss = sum / (global_n_tokens / W) / K): the mean over the K accumulation micro-batches
                of each one's global token mean (TRL #7206). AsyncGRPO itself needs a vLLM server.

What each loss type computes, read from trl 1.16's `trl/trainer/grpo_trainer.py`
(`GRPOTrainer._compute_loss`; line numbers of that file):
* per-token loss (lines 3112-3120): coef_1 = exp(logp - old_logp), coef_2 = clamp(coef_1, 1 - eps,
  1 + eps_high), loss_t = -min(coef_1 A, coef_2 A), A the completion's advantage; old_logp is
  logp.detach() when no old log-probabilities were computed (lines 3060-3065: num_iterations 1 and
  steps_per_generation <= gradient_accumulation_steps), else the generation-time ones.
* grpo (3153-3157): mean over the micro-batch's completions of each one's token mean, / K: with B rows
  in every micro-batch and DDP's average over W ranks, the mean over the step's completions of each
  one's token mean (declare=sequence).
* bnpo (3158-3162): the micro-batch's token mean, / K: the mean of the micro-batches' token means,
  which one process at the global batch does not compute (its "local batch" is the global batch: the
  global token mean, declare=token). The gate must fail it, naming the micro-batch means.
* dr_grpo (3163-3167): the micro-batch's sum / (B x max_completion_length), / K: the step's sum over
  (rows x max_completion_length) (declare=dr).
* dapo (3168-3174): the micro-batch's sum / (num_items_in_batch / W x K / S), num_items_in_batch the
  completion tokens of the whole generation batch, gathered over the ranks (line 2498): with S = K the
  step's global token mean (declare=token); with S > K the generation batch's tokens per step on
  average, not the step's own.
The loss the forward reads beyond its inputs is recorded beside each micro-batch (`rec.beside`):
"advantages" (one per row) and, where TRL computed them, "old_logps" (the generation-time per-token
log-probabilities, laid out on the forward's positions), and "example_id" (each generated sample's
own, numbered here: the data check's identity, since two equal completions of one prompt are two
samples). The completion mask is the forward's own
`labels` (TRL passes input_ids with -100 outside the completion). What the gate does not judge: the
rollout itself (generation, rewards, the advantages' group statistics): they are the recorded data.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402  (tests/support)
import trl_client  # noqa: E402  (the toy model, tokenizer and optimizer)

MODULE = "grpo_client"
MAX_COMPLETION, EPS, EOS_BIAS = 6, 0.2, 3.0
DEFAULT_DECLARE = {"dapo": "token", "bnpo": "token", "grpo": "sequence", "dr_grpo": "dr"}


def build_model(**kw):
    return trl_client.build_model(**kw)


def build_optimizer(model, **kw):
    return trl_client.build_optimizer(model, **kw)


def reward_even(completions, **_) -> list[float]:
    """The fraction of the completion's tokens with an even id (words "t<id>")."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in str(text).split() if w.startswith("t") and w[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
    return out


def prompts(seed: int, n: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(40_000 + seed)
    return [{"prompt": " ".join(f"t{i}" for i in torch.randint(2, trl_client.VOCAB,
                                                                (int(torch.randint(1, 4, (1,), generator=g)),),
                                                                generator=g).tolist())} for _ in range(n)]


# --------------------------------------------------------------------------- the declared objectives


def _per_token(model, batch):
    """TRL's per-token loss at each labelled position (next-token log-probability of labels[:, t]),
    and where a label is."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    y = batch["labels"][:, 1:]
    keep = y.ne(-100)
    logp = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    old = batch["old_logps"][:, 1:] if "old_logps" in batch else logp.detach()
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS)
    a = batch["advantages"].float().unsqueeze(1)
    return -torch.min(coef_1 * a, coef_2 * a) * keep, keep


def token_objective(model, batch):
    """GRPO's clipped surrogate, the global token mean over the completions (dapo; bnpo at the global batch)"""
    loss, keep = _per_token(model, batch)
    return loss.sum(), int(keep.sum())


def sequence_objective(model, batch):
    """GRPO's clipped surrogate, the mean over completions of each one's token mean (grpo)"""
    loss, keep = _per_token(model, batch)
    return (loss.sum(1) / keep.sum(1).clamp(min=1)).sum(), loss.shape[0]


def dr_objective(model, batch):
    """GRPO's clipped surrogate summed over tokens / (completions x max_completion_length) (dr_grpo)"""
    loss, _ = _per_token(model, batch)
    return loss.sum() / MAX_COMPLETION, loss.shape[0]


OBJECTIVES = {"token": "token_objective", "sequence": "sequence_objective", "dr": "dr_objective"}


def parse_run(text: str) -> dict:
    name, *fields = text.split(":")
    run = {"name": name, "loss": "dapo", "ga": 2, "spg": 0, "gens": 4, "steps": 2, "seed": 0, "declare": None,
           "fault": None}
    for f in fields:
        k, _, v = f.partition("=")
        if k in ("ga", "spg", "gens", "steps", "seed"):
            run[k] = int(v)
        elif k in ("loss", "declare", "fault"):
            run[k] = v
        else:
            raise SystemExit(f"grpo_client: unknown run field {k!r} in {text!r}")
    if run["loss"] not in DEFAULT_DECLARE or run["fault"] not in (None, "half", "async"):
        raise SystemExit(f"grpo_client: loss {run['loss']!r} / fault {run['fault']!r} is not one of this client's")
    return run


def build_kwargs(run: dict) -> dict:
    return {"arch": "llama"}


def train(run: dict, out: Path) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.hf import TrainerRecorder

    kw = build_kwargs(run)
    model = build_model(**kw)
    declare = run["declare"] or DEFAULT_DECLARE[run["loss"]]
    callback = TrainerRecorder(out / run["name"], RecordingSpec(build_model=f"{MODULE}:build_model",
                                                                build_optimizer=f"{MODULE}:build_optimizer",
                                                                objective=f"{MODULE}:{OBJECTIVES[declare]}",
                                                                build_kwargs=kw))
    fault = run["fault"]

    class Recorded(GRPOTrainer):
        """GRPOTrainer whose loss's inputs beyond the forward's are recorded beside each micro-batch."""

        _generations = 0

        def _generate_and_score_completions(self, inputs):
            # each generated sample its own id (the data check's identity: two equal completions of one prompt
            # are two samples), carried through TRL's shuffle and split of the generation batch
            out = super()._generate_and_score_completions(inputs)
            n, world, rank = out["advantages"].shape[0], self.accelerator.num_processes, self.accelerator.process_index
            out["sample_id"] = torch.arange(n) + (self._generations * world + rank) * n
            self._generations += 1
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if self.model.training and callback.rec is not None:
                beside = {"advantages": inputs["advantages"], "example_id": inputs["sample_id"]}
                old = inputs.get("old_per_token_logps")
                if old is not None:  # on the forward's positions: prompt (zeros) then completion
                    full = torch.zeros(old.shape[0], inputs["prompt_ids"].shape[1] + old.shape[1], dtype=old.dtype)
                    full[:, -old.shape[1]:] = old.detach().cpu()
                    beside["old_logps"] = full
                callback.rec.beside(**beside)
            if fault == "async" and self.model.training:  # AsyncGRPO's normalisation (see the docstring)
                mask = inputs["completion_mask"]
                per_token = (loss * inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
                             * self.current_gradient_accumulation_steps / self.args.steps_per_generation)
                n_micro = self.accelerator.reduce(mask.sum().float(), reduction="sum")  # this micro-batch, every rank
                return per_token / (n_micro / self.accelerator.num_processes).clamp(min=1.0) \
                    / self.current_gradient_accumulation_steps
            return loss * 0.5 if fault == "half" else loss

    cfg = GRPOConfig(output_dir=str(out / run["name"] / "hf"), use_cpu=True, ddp_backend="gloo", bf16=False,
                     per_device_train_batch_size=2, gradient_accumulation_steps=run["ga"], max_grad_norm=1.0,
                     max_steps=run["steps"], logging_steps=1, save_strategy="no", report_to="none",
                     disable_tqdm=True, seed=run["seed"], dataloader_num_workers=0, loss_type=run["loss"],
                     num_generations=run["gens"], max_completion_length=MAX_COMPLETION, epsilon=EPS,
                     steps_per_generation=run["spg"] or None,
                     # the end token's logit + 3 while sampling: completions of 1..6 tokens, not all cut at 6
                     generation_kwargs={"sequence_bias": [[[1], EOS_BIAS]]})
    trainer = Recorded(model=model, reward_funcs=reward_even, args=cfg,
                       train_dataset=Dataset.from_list(prompts(run["seed"])), processing_class=trl_client.tokenizer(),
                       optimizers=build_optimizer(model), callbacks=[callback])
    trainer.train()


def main(argv: list[str] | None = None) -> int:
    return plan.runs_main(train, parse_run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
