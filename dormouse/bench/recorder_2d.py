"""The Recorder's cost on a 2-D run (issue 28), beside the DP figures of
dormouse.bench.recorder: a torchtitan-style llama (dormouse.bench.tp_llama,
random init) parallelised the way torchtitan does on a (dp 2, tp 2) mesh of 4
gloo ranks (its TP plan with sequence-parallel norms and loss_parallel on tp,
FSDP2 on dp), trained with gradient accumulation and AdamW. Each DP replica
reads its own rows (both TP ranks of a replica the same rows); each
micro-batch's loss is its token sum of cross-entropy on the vocabulary-sharded
logits over the replica's token count of the step; FSDP2 averages over dp.

recorder_2d_overhead, recorder_2d_judge_cost
    as recorder_overhead and recorder_judge_cost (the same rounds, rotation,
    warm-up and medians: dormouse.bench.recorder.timed_rounds and
    bench_recorder), for full tensors every step and CountSketch k=256 every
    step; the check's cost is over the 4-rank fleet's compute.

Rank side: `torchrun --nproc_per_node=4 ... -m dormouse.bench.recorder_2d --out DIR ...`;
driver: `bench_recorder_2d`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dormouse.bench.recorder import KINDS, bench_recorder, timed_rounds

KINDS_2D = ("none", "full", "sketch")
TP = 2
SIZE = {"vocab": 256, "dim": 128, "n_heads": 4, "n_layers": 2, "hidden": 256}


def _rank_main(argv: list[str]) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from dormouse.bench.tp_llama import build_model, build_optimizer, parallelize
    from dormouse.gate import Recorder, RecordingSpec

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--kinds", default=",".join(KINDS_2D))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % TP:
        raise SystemExit(f"the 2-D bench needs a multiple of tp {TP} ranks, not {world}")
    dp = world // TP
    mesh = init_device_mesh("cpu", (dp, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = rank // TP
    kw = {"seed": 0, **SIZE}
    K, B, T = a.micro, a.rows, a.seq
    g = torch.Generator().manual_seed(dp_rank)  # a replica's rows: the same on its TP ranks
    batches = [torch.randint(0, SIZE["vocab"], (B, T), generator=g) for _ in range(K)]
    count = K * B * (T - 1)  # the replica's tokens of the step

    def new_run(kind: str, path: Path):
        """A fresh model, parallelised on the (dp, tp) mesh, and (for a recorded kind) its Recorder."""
        model = parallelize(build_model(**kw), mesh)
        opt = build_optimizer(model)
        rec = None
        if KINDS[kind] is not None:
            rec = Recorder(path, model, RecordingSpec(build_model="dormouse.bench.tp_llama:build_model",
                                                      build_optimizer="dormouse.bench.tp_llama:build_optimizer",
                                                      objective="causal_lm", build_kwargs=kw, **KINDS[kind]))

        def step() -> tuple[float, float]:
            """One optimizer step: (its wall seconds, those inside rec.step)."""
            t0 = time.perf_counter()
            total, inside = 0.0, 0.0
            for m, ids in enumerate(batches):
                model.set_requires_gradient_sync(m == K - 1)
                z = model(ids)
                with loss_parallel():
                    loss = F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum") / count
                    loss.backward()
                loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                total += float(loss.detach())
            logged = torch.tensor(total)
            dist.all_reduce(logged, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            if rec is not None:
                t1 = time.perf_counter()
                rec.step(loss=logged, optimizer=opt)
                inside = time.perf_counter() - t1
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0, inside

        return step, rec, model

    timed_rounds(Path(a.out), a.kinds.split(","), a.rounds, a.steps, new_run, tokens_per_rank_step=K * B * T,
                 mesh={"dp": dp, "tp": TP})
    dist.destroy_process_group()
    return 0


def bench_recorder_2d(quick: bool, tmp: Path, log=print, *, sizes=((2, 2), (4, 3)), args: tuple[str, ...] = ()) -> dict:
    """One 4-rank torchrun launch of the rank side, then the check of its first round's recordings."""
    return bench_recorder(quick, tmp, log, module="dormouse.bench.recorder_2d", world=2 * TP, name="recorder_2d",
                          sizes=sizes, args=args)


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
