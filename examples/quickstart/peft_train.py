"""The PEFT recipe of docs/clients/hf.md as a whole script: LoRA adapters on
sft_train.py's tiny Llama, trained by its `train` (TRL's `SFTTrainer`) on two CPU ranks and
recorded for the gate. `build_model` returns the wrapped model (the frozen
base is recorded as frozen, the adapters carry the gradients), so the gate
rebuilds exactly what was trained. From this folder:

    torchrun --standalone --nproc_per_node=2 peft_train.py
    dormouse gate check --out runs/peft
"""

import torch
from peft import LoraConfig, get_peft_model

from sft_train import build_optimizer, train  # noqa: F401 (the gate imports build_optimizer from here)
from sft_train import build_model as build_base


def build_model():
    """The base model with LoRA adapters on its attention's q and v projections, seeded: the same in any
    process (the adapters' initialisation draws from the RNG)."""
    base = build_base()
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM"))


if __name__ == "__main__":
    train(build_model(), "peft")  # sft_train.py's SFTTrainer, recorded to runs/peft
