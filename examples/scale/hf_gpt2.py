"""A GPT-2 configuration of real size under transformers' Trainer, 2 CPU ranks,
recorded for the gate: the scale page's HF row (docs/benchmarks.md) and the
stand-in CI keeps small. Random init, the real vocabulary, nothing downloaded.

    SCALE=small torchrun --standalone --nproc_per_node=2 examples/scale/hf_gpt2.py runs/gpt2
    dormouse gate check --out runs/gpt2

SCALE picks the size (tiny ≈ 0.5M with a 256-token vocabulary; mini ≈ 6.9M: 2 x 128 with the
real vocabulary; mid ≈ 30M: 6 x 384;
small = GPT-2 small, 124M: 12 x 768; moe ≈ 133M in total: a Qwen3-MoE of 8 layers x 512, 8 experts
of 768 a layer, 2 routed a token, its router's auxiliary loss in the objective), STEPS the optimizer steps (3), SEQ the
sequence (128), LR the peak lr (1e-3), SKETCH (0 = full tensors), RECORD=0
trains without the Recorder (the overhead's baseline), FAULT one of
  scale1.001  rank 1's synchronised gradient x 1.001 at every step (a hook after the reduce:
              the ranks part, which the ranks check names)
  scale1.001_pre  rank 1's own gradient x 1.001 before DDP's all-reduce (its loss scaled): the
              synchronised gradient off on every rank alike (what the gradient's bound must see)
  local_norm  clip by the rank's local pre-reduce norm (a wrong clip; with ACCUM=1)
  no_avg_tokens  average_tokens_across_devices=False (each rank its own token count)
  micro_mean  the mean of micro-batch means (with ACCUM=2): the Trainer told the model takes no
              loss kwargs, so each micro-batch's loss is its own token mean, divided by the
              accumulation steps (the gradient-accumulation bug of transformers < 4.46)
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_linear_schedule_with_warmup

SIZES = {  # n_embd, n_layer, n_head, vocab
    "tiny": (64, 2, 2, 256),
    "mini": (128, 2, 2, 50257),
    "mid": (384, 6, 6, 50257),
    "small": (768, 12, 12, 50257),
    "medium": (1024, 24, 16, 50257),
    "moe": (512, 8, 8, 50257),  # Qwen3-MoE (_qwen3_moe): the width, layers, heads and vocabulary
}
SCALE = os.environ.get("SCALE", "tiny")
STEPS = int(os.environ.get("STEPS", "3"))
SEQ = int(os.environ.get("SEQ", "128"))
LR = float(os.environ.get("LR", "1e-3"))
BATCH = int(os.environ.get("BATCH", "2"))
ACCUM = int(os.environ.get("ACCUM", "1"))


def build_model(scale: str = SCALE, seq: int = SEQ, lr: float = LR, steps: int = STEPS):
    """The same initial model in any process: seeded here (the size reaches `gate check`
    through the Recorder's build_kwargs, not the environment)."""
    torch.manual_seed(0)
    if scale == "moe":
        return _qwen3_moe(seq)
    d, n_layer, n_head, vocab = SIZES[scale]
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def _qwen3_moe(seq: int):
    """A Qwen3-MoE configuration of ≈ 133M parameters (50,257-token vocabulary, untied): its forward
    adds router_aux_loss_coef x load_balancing_loss_func over its own router logits to the loss
    (modeling_qwen3_moe.py, Qwen3MoeForCausalLM.forward)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=50257, hidden_size=512, intermediate_size=1536, moe_intermediate_size=768,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=seq,
                         output_router_logits=True, router_aux_loss_coef=0.01, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = Qwen3MoeForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return model


def build_optimizer(model, scale: str = SCALE, seq: int = SEQ, lr: float = LR, steps: int = STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return opt, get_linear_schedule_with_warmup(opt, 0, steps)


def dataset(n: int = 512, seed: int = 0) -> list[dict]:
    """Random token rows of lengths SEQ/2..SEQ (rows.py), right-padded (labels -100 there)."""
    from rows import token_rows

    return token_rows(n, SEQ, SIZES[SCALE][3], seed)


def _faults(model, fault: str):
    if fault == "scale1.001" and int(os.environ.get("RANK", "0")) == 1:
        from transformers import TrainerCallback

        class Scale(TrainerCallback):  # after the reduce (and the Trainer's clip), before the step
            def on_pre_optimizer_step(self, args, state, control, **kw):
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.001)
        return [Scale()]
    return []


class PreScaleTrainer(Trainer):
    """FAULT=scale1.001_pre: rank 1 backpropagates its loss x 1.001, so its gradient enters the all-reduce
    x 1.001."""

    def compute_loss(self, model, inputs, *a, **kw):
        out = super().compute_loss(model, inputs, *a, **kw)
        if int(os.environ.get("RANK", "0")) != 1:
            return out
        return (out[0] * 1.001, *out[1:]) if isinstance(out, tuple) else out * 1.001


class LocalNormTrainer(Trainer):
    """FAULT=local_norm: clips by this rank's own gradient's norm, summed from the gradients each
    parameter receives in the backward (before DDP's all-reduce), not the synchronised gradient's."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._local = {}
        for n, p in self.model.named_parameters():
            p.register_hook(lambda g, n=n: self._local.__setitem__(n, g.detach().float().pow(2).sum()))

    def _clip_grad_norm(self, model):
        local = torch.sqrt(sum(self._local.values()))
        self._local.clear()
        coef = torch.clamp(self.args.max_grad_norm / (local + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return local


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/gpt2"
    fault = os.environ.get("FAULT", "")
    model = build_model()
    args = TrainingArguments(out + "-trainer", use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, max_grad_norm=1.0,
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                             average_tokens_across_devices=fault != "no_avg_tokens")
    callbacks = []
    if os.environ.get("RECORD", "1") != "0":
        from dormouse.gate import RecordingSpec
        from dormouse.gate.record.hf import TrainerRecorder

        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, here)
        callbacks.append(TrainerRecorder(out, RecordingSpec(
            build_model="hf_gpt2:build_model", build_optimizer="hf_gpt2:build_optimizer", objective="causal_lm",
            build_kwargs=dict(scale=SCALE, seq=SEQ, lr=LR, steps=STEPS), sketch=int(os.environ.get("SKETCH", "0")),
            # the MoE's load-balancing term is each forward's own (routeraux.py): declared, as the Trainer computes it
            objective_scope="forward" if SCALE == "moe" else "example")))
    # the fault callbacks come first: the Recorder sees the faulty gradient the optimizer applies
    trainer = {"local_norm": LocalNormTrainer, "scale1.001_pre": PreScaleTrainer}.get(fault, Trainer)(
        model=model, args=args, train_dataset=dataset(), optimizers=build_optimizer(model),
        callbacks=_faults(model, fault) + callbacks)
    if fault == "micro_mean":
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()
