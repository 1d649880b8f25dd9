"""Reproduction: gradient accumulation over torch.distributed.pipelining's
schedules with scale_grads on (the default) trains a moving average of the
calls' gradients, not their sum (torchtitan #1733).

    torchrun --standalone --nproc_per_node=2 examples/field/pp_accumulation.py   # CPU, gloo, seconds

`_PipelineSchedule` is built with `scale_grads=True` by default; after its
backwards, each `step()` calls `PipelineStage.perform_reduce_grad(n_microbatches)`
-> `scale_grads`, which divides EVERY parameter's `.grad` in place by the number
of micro-batches (torch 2.13, `torch/distributed/pipelining/stage.py`,
`scale_grads`: `p.grad.div_(grad_scale_factor)`). A loop that accumulates over
A calls of `step()` without zeroing (gradient accumulation on top of the
pipeline's own micro-batches) therefore divides the earlier calls' gradients
again at every later call: with A = 2 and K micro-batches a call, the stage
holds g_1 / K^2 + g_2 / K, where the sum is (g_1 + g_2) / K (the mean over the
2K micro-batches, 2x the sum's scale aside).

The script runs a 2-stage pipeline (a tiny MLP, one linear layer a stage,
ScheduleGPipe, K = 2 micro-batches a call, a mean-squared loss) for A = 2 calls
on two different halves of a batch, and compares the stages' gradients with
one process's gradient of the mean loss over the whole batch: with
scale_grads=True (and the loss divided by A) they differ; with
scale_grads=False and the loss divided by K x A they agree to float32 round-off.
docs/field-report.md rows `pp_accum`, `pp_accum_1f1b` (failing the gate) and
`pp_accum_fixed` (passing) are the same on a 2-stage llama.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

K, A, ROWS, D = 2, 2, 4, 8


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Linear(D, 1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(A * ROWS, D, generator=g), torch.randn(A * ROWS, 1, generator=g)


def pipeline_gradient(scale_grads: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = dist.get_rank()
    full = model()
    stage_mod = full[rank]  # stage 0: the first linear layer, stage 1: the second
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))

    def loss_fn(out, target):
        loss = ((out - target) ** 2).mean()
        return loss / A if scale_grads else loss / (K * A)  # scale_grads divides by K itself

    schedule = ScheduleGPipe(stage, K, loss_fn=loss_fn, scale_grads=scale_grads)
    x, y = data()
    for a in range(A):  # accumulation: A calls, no zero_grad between them
        rows = slice(a * ROWS, (a + 1) * ROWS)
        if rank == 0:
            schedule.step(x[rows])
        else:
            schedule.step(target=y[rows], losses=[])
    grads = {f"{rank}.{n}": p.grad.clone() for n, p in stage_mod.named_parameters()}
    everyone: list = [None, None]
    dist.all_gather_object(everyone, grads)
    return {k: v for g in everyone for k, v in g.items()}


def one_process_gradient() -> dict[str, torch.Tensor]:
    net = model()
    x, y = data()
    ((net(x) - y) ** 2).mean().backward()
    return {n: p.grad for n, p in net.named_parameters()}


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b) ** 0.5
    return num / sum(float(b[k].pow(2).sum()) for k in b) ** 0.5


def main() -> int:
    dist.init_process_group("gloo")
    try:
        want = one_process_gradient()
        default = pipeline_gradient(scale_grads=True)
        fixed = pipeline_gradient(scale_grads=False)
        if dist.get_rank() == 0:
            print(f"torch {torch.__version__}, {K} micro-batches a schedule.step(), {A} calls accumulated")
            print(f"scale_grads=True  (default): relative difference from one process {rel(default, want):.3e}")
            for n in want:
                ratio = float(default[n].norm() / want[n].norm())
                print(f"    {n}: |pipeline| / |one process| = {ratio:.4f}")
            print(f"scale_grads=False, loss / (K A): relative difference from one process {rel(fixed, want):.3e}")
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
