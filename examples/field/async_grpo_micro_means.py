"""Reproduction: TRL's AsyncGRPOTrainer trains the mean of its accumulation
micro-batches' token means, not the token mean of the step (TRL #7206).

    python examples/field/async_grpo_micro_means.py      # one process, CPU, seconds

trl 1.16, `trl/experimental/async_grpo/async_grpo_trainer.py`: the collator sets
`global_n_tokens` to the trained tokens of ONE micro-batch over every rank
(line 615), and `AsyncGRPOTrainer.compute_loss` divides the micro-batch's summed
per-token loss by `global_n_tokens / world_size` and then by
`current_gradient_accumulation_steps` (lines 1535-1544). Under gradient
accumulation (K > 1) the step's gradient is therefore
(1/K) sum_m (sum of micro-batch m's token losses) / (tokens of micro-batch m),
which weights a token of a short micro-batch more than a token of a long one;
the step's token mean (what the same samples give in one micro-batch, and what
GRPOTrainer's default `dapo` computes with `num_items_in_batch`) is
sum_m (sum) / sum_m (tokens).

The trainer itself needs a vLLM server to generate, so the script calls its real
`compute_loss` (unbound) on a stand-in `self` holding only what that method
reads (epsilons, the accelerator's world size and reductions for one process,
the accumulation steps, metric sinks) and a tiny stand-in policy whose forward
returns the per-token log-probabilities the fused LM head would. Two completions
of 2 and 6 trained tokens, their advantages and old log-probabilities fixed, are
trained once as two accumulation micro-batches (K = 2) and once as one (K = 1),
and the two gradients compared; then with two completions of equal length
(equal, as expected). Measured here (trl 1.16.0, torch 2.13 CPU): 8.1e-1 apart
for 2 and 6 tokens, 4e-8 for 4 and 4. docs/field-report.md row `grpo` `async` is the same
normalisation on GRPOTrainer over 2 gloo ranks.
"""

from __future__ import annotations

import collections
import os
import sys
import types
import warnings

import torch
from torch import nn

VOCAB, D = 16, 8


class Policy(nn.Module):
    """Per-token log-probabilities of the shifted labels (what fused_lm_head=True returns), from an embedding
    and a linear head; the tree-attention keywords are accepted and unused (one completion a row here)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)

    def forward(self, input_ids, position_ids=None, shift_labels=None, fused_lm_head=True, **_):
        logp = torch.log_softmax(self.head(torch.tanh(self.emb(input_ids))), -1)
        per_token = logp.gather(-1, shift_labels.clamp(min=0)[..., None])[..., 0]
        return types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token), aux_loss=None)


def stand_in(k: int):
    class Accelerator:
        num_processes = 1

        @staticmethod
        def reduce(x, reduction="sum"):
            return x

        @staticmethod
        def gather(x):
            return x.reshape(-1)

    return types.SimpleNamespace(epsilon_low=0.2, epsilon_high=0.2, accelerator=Accelerator(),
                                 current_gradient_accumulation_steps=k, aux_loss_enabled=False,
                                 _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
                                 _last_forward_time_s=0.0, _step_forward_tokens=0.0, _step_trained_tokens=0.0,
                                 _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0)


def completion(seed: int, prompt: int, trained: int, advantage: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (prompt + trained,), generator=g)
    shift = torch.full_like(ids, -100)
    shift[prompt - 1:-1] = ids[prompt:]  # position t predicts token t + 1: the completion's tokens
    token_index = torch.arange(prompt - 1, prompt - 1 + trained)
    return {"ids": ids, "shift": shift, "token_index": token_index, "advantage": advantage,
            "old": torch.randn(trained, generator=g) * 0.01 - 2.7}


def micro_batch(parts: list[dict]) -> dict:
    """One packed row of `parts` (one rank, as the collator packs it): token_index into the flat row."""
    ids = torch.cat([p["ids"] for p in parts])[None]
    offsets = torch.tensor([0] + [len(p["ids"]) for p in parts]).cumsum(0)
    index = torch.cat([p["token_index"] + offsets[i] for i, p in enumerate(parts)])
    n = index.numel()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "position_ids": torch.cat([torch.arange(len(p["ids"])) for p in parts])[None],
            "shift_labels": torch.cat([p["shift"] for p in parts])[None], "token_index": index[None],
            "old_log_probs": torch.cat([p["old"] for p in parts])[None],
            "advantages": torch.cat([torch.full((p["token_index"].numel(),), p["advantage"]) for p in parts])[None],
            "segment_id": torch.cat([torch.full((p["token_index"].numel(),), i) for i, p in enumerate(parts)])[None],
            "global_n_tokens": torch.tensor([float(n)]), "global_n_forward_tokens": torch.tensor([float(ids.numel())]),
            "mean_seq_len": torch.tensor([ids.numel() / len(parts)]),
            "tree_kv_index": torch.full((1, 1), -1), "tree_cu_seqlens_q": torch.full((1, 1), -1),
            "tree_cu_seqlens_k": torch.full((1, 1), -1), "tree_max_seqlens": torch.tensor([[0, 0]])}


def step_gradient(micro_batches: list[dict]) -> dict:
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    policy, me = Policy(), stand_in(len(micro_batches))
    for mb in micro_batches:  # the Trainer's accumulation: one backward a micro-batch, gradients summed
        AsyncGRPOTrainer.compute_loss(me, policy, mb).backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b) ** 0.5
    return num / sum(float(b[k].pow(2).sum()) for k in b) ** 0.5


def main() -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore")
    import trl

    print(f"trl {trl.__version__}, torch {torch.__version__}")
    for lengths in ((2, 6), (4, 4)):
        a, b = completion(1, 3, lengths[0], 1.0), completion(2, 3, lengths[1], -0.5)
        two = step_gradient([micro_batch([a]), micro_batch([b])])
        one = step_gradient([micro_batch([a, b])])
        print(f"completions of {lengths[0]} and {lengths[1]} trained tokens: 2 accumulation micro-batches vs 1: "
              f"relative difference {rel(two, one):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
