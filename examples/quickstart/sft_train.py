"""The TRL recipe of docs/clients/hf.md as a whole script: a tiny random-init
Llama trained by TRL's `SFTTrainer` on two CPU ranks (gradient accumulation 2,
clipping at 1.0, rows of varied lengths that its collator pads), recorded for
the gate by the HF callback. From this folder:

    torchrun --standalone --nproc_per_node=2 sft_train.py
    dormouse gate check --out runs/sft

Nothing is downloaded: the model is built from a config, the tokenizer in
code, the data is token ids (TRL's "already tokenized" path). The builders
stay importable without training: `gate check` imports this module to rebuild
the initial model and the optimizer in one process.
"""

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

from dormouse.gate import RecordingSpec
from dormouse.gate.record.hf import TrainerRecorder

STEPS, SEQ, VOCAB = 4, 16, 64


def build_model():
    """The same initial model in any process: seeded here."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=1))


def build_optimizer(model):
    """(optimizer, lr scheduler) over the trainable parameters: the trainer gets these, the gate's replay too."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    return opt, get_linear_schedule_with_warmup(opt, 0, STEPS)


def tokenizer():
    """A word-level tokenizer of VOCAB tokens "t0".."t63" built in code: t0 pads, t1 ends."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def dataset(n: int = 64, seed: int = 0):
    """Token rows of lengths 3..SEQ ending in the eos token, as a datasets.Dataset."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, SEQ + 1, (n,), generator=g).tolist()
    return Dataset.from_list([{"input_ids": torch.randint(2, VOCAB, (k - 1,), generator=g).tolist() + [1]}
                              for k in lengths])


def train(model, name: str = "sft") -> None:
    """TRL's SFTTrainer on `model`, recorded to runs/<name> for the gate, which rebuilds the model and the
    optimizer from <name>_train.py's build_model and build_optimizer."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(f"runs/{name}-trainer", use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, max_steps=STEPS, max_grad_norm=1.0, max_length=SEQ,
                     bf16=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    spec = RecordingSpec(build_model=f"{name}_train:build_model", build_optimizer=f"{name}_train:build_optimizer",
                         objective="causal_lm")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
                         optimizers=build_optimizer(model), callbacks=[TrainerRecorder(f"runs/{name}", spec)])
    trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    train(build_model())
