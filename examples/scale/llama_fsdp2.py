"""A Llama-style model of real size (transformers' LlamaForCausalLM config, random init) trained
by a plain FSDP2 loop on CPU ranks, recorded for the gate: the scale page's Llama row
(docs/benchmarks.md). The loop is docs/clients/plain.md's, sharded with `fully_shard` (each
decoder layer, then the model) instead of wrapped in DDP.

    SCALE=small torchrun --standalone --nproc_per_node=2 examples/scale/llama_fsdp2.py runs/llama
    dormouse gate check --out runs/llama

SCALE picks the size (tiny ≈ 0.4M with a 256-token vocabulary; small ≈ 125M: 12 x 768, GQA 12/4
heads, MLP 2048, a 32,000-token vocabulary, untied), STEPS the optimizer steps (3), SEQ the
sequence (128), BATCH the rows per rank-step (2), LR the peak lr (1e-3), SKETCH (0 = full
tensors), RECORD=0 trains without the Recorder.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rows import token_rows

SIZES = {  # hidden, layers, heads, kv heads, mlp, vocab
    "tiny": (64, 2, 4, 2, 128, 256),
    "small": (768, 12, 12, 4, 2048, 32000),
}
SCALE = os.environ.get("SCALE", "tiny")
STEPS = int(os.environ.get("STEPS", "3"))
SEQ = int(os.environ.get("SEQ", "128"))
LR = float(os.environ.get("LR", "1e-3"))
BATCH = int(os.environ.get("BATCH", "2"))


def build_model(scale: str = SCALE, seq: int = SEQ, lr: float = LR, steps: int = STEPS):
    """The same initial model in any process (seeded here; the size reaches `gate check` through
    build_kwargs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d, layers, heads, kv, mlp, vocab = SIZES[scale]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                      tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
                      eos_token_id=1)
    return LlamaForCausalLM(cfg)


def build_optimizer(model, scale: str = SCALE, seq: int = SEQ, lr: float = LR, steps: int = STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = build_optimizer(model)
    data = token_rows(world * BATCH * STEPS, SEQ, SIZES[SCALE][5])
    rec = None
    if os.environ.get("RECORD", "1") != "0":
        from dormouse.gate import Recorder, RecordingSpec

        rec = Recorder(out, model, RecordingSpec(
            build_model="llama_fsdp2:build_model", build_optimizer="llama_fsdp2:build_optimizer",
            objective="causal_lm", max_grad_norm=1.0, dataset_len=len(data),
            build_kwargs=dict(scale=SCALE, seq=SEQ, lr=LR, steps=STEPS), sketch=int(os.environ.get("SKETCH", "0"))))
    for s in range(STEPS):
        idx = list(range((s * world + rank) * BATCH, (s * world + rank + 1) * BATCH))
        batch = {k: torch.stack([data[i][k] for i in idx]) for k in data[0]}
        n = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
        dist.all_reduce(n)  # the global batch's target count
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if rec is not None:
            rec.labels(batch["labels"])  # the loss's labels, which the model is not given
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")
        (loss_sum * world / n).backward()  # FSDP2's reduce-scatter averages over ranks: times W undoes it
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if rec is not None:
            rec.step(loss=float(total / n), optimizer=opt, grad_norm=norm, example_ids=torch.tensor(idx))
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {s + 1} loss {float(total / n):.4f}", flush=True)
    if rec is not None:
        rec.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/llama")
