"""A hand-written `accelerate` loop, recorded with the plain Recorder, for tests:
loopmodel's tiny causal LM, `Accelerator(gradient_accumulation_steps=K, cpu=True)`
under torchrun (gloo), `with accelerator.accumulate(model):`,
`accelerator.clip_grad_norm_`, AdamW with a LambdaLR schedule.

    torchrun --standalone --nproc_per_node=2 tests/support/accelerate_loop.py --out DIR clean micro:mode=micro_mean

The gate's lines are the Recorder's three (marked `# gate`). The data
(fieldkit.step_batches) is this rank's micro-batches laid out per step, each
with the step's global target count n_step. Modes (S_m the micro-batch's
summed cross-entropy; `accelerator.backward` divides by K, DDP averages over W):

  clean        S_m / n_step * K * W: the global batch's token mean
  micro_mean   S_m / n_m: each micro-batch's own token mean
  sched_prepared  clean, but the lr scheduler goes through accelerator.prepare:
               accelerate's AcceleratedScheduler steps it num_processes times
               per optimizer step (accelerate/scheduler.py, `step`, lines 71-82:
               "the training dataloader batch size was multiplied by
               num_processes"), so the fleet's lr runs W times faster through
               the schedule than one process's at the same global batch

What accelerate does, read from accelerate 1.16: `accumulate(model)` calls
`_do_sync` (accelerator.py 1190-1197: sync when step % K == 0) and enters
`no_sync(model)` on the other micro-batches (1245-1252), so DDP synchronises in
the last micro-batch's backward; `backward` divides the loss by K (2755-2757);
the prepared optimizer's `step` and `zero_grad` act only when `sync_gradients`.
So `rec.step` goes inside `if accelerator.sync_gradients:` after the clip, with
the pre-clip norm `clip_grad_norm_` returns, before `optimizer.step()`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fieldkit  # noqa: E402
import loopmodel  # noqa: E402

from dormouse.gate import Recorder, RecordingSpec  # noqa: E402

LR, CLIP = 1e-2, 1.0
MODES = ("clean", "micro_mean", "sched_prepared")


def train(run: dict, out: Path, accelerator) -> None:
    world, rank, k = accelerator.num_processes, accelerator.process_index, accelerator.gradient_accumulation_steps
    items = fieldkit.step_batches(seed=run["seed"], world=world, rank=rank, k=k, steps=run["steps"])
    loader = torch.utils.data.DataLoader(fieldkit.Listed(items), batch_size=None, shuffle=False)
    model = loopmodel.build_model(seed=run["seed"])
    opt, sched = loopmodel.build_optimizer(model, lr=LR)
    if run["mode"] == "sched_prepared":
        model, opt, sched = accelerator.prepare(model, opt, sched)
    else:
        model, opt = accelerator.prepare(model, opt)
    rec = Recorder(out / run["name"], model, RecordingSpec(build_model="loopmodel:build_model",   # gate
                                                           build_optimizer="loopmodel:build_optimizer", objective="causal_lm",
                                                           build_kwargs={"seed": run["seed"], "lr": LR}, max_grad_norm=CLIP,
                                                           dataset_len=len(items) * world * fieldkit.B))
    reported = torch.zeros(())
    for batch in loader:
        with accelerator.accumulate(model):
            s, n = fieldkit.loss_sum(model, batch)
            if run["mode"] == "micro_mean":
                loss = s / n
            else:
                loss = s / batch["n_step"] * k * world
            reported += loss.detach() / (k * world)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                logged = accelerator.reduce(reported, reduction="sum")
                rec.step(loss=logged, optimizer=opt, grad_norm=norm)               # gate
                reported = torch.zeros(())
            opt.step()
            if run["mode"] == "sched_prepared":
                sched.step()  # accelerate's: steps only at sync, num_processes times
            elif accelerator.sync_gradients:
                sched.step()
            opt.zero_grad()
    rec.close()                                                                  # gate
    accelerator.free_memory()


def parse_run(text: str) -> dict:
    name, *fields = text.split(":")
    run = {"name": name, "mode": "clean", "seed": 0, "steps": 4}
    for f in fields:
        key, _, v = f.partition("=")
        if key == "mode" and v in MODES:
            run[key] = v
        elif key in ("seed", "steps"):
            run[key] = int(v)
        else:
            raise SystemExit(f"accelerate_loop: bad run field {f!r} in {text!r}")
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--k", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("runs", nargs="+")
    a = p.parse_args(argv)
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=a.k, cpu=True)
    for text in a.runs:
        train(parse_run(text), a.out, accelerator)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
