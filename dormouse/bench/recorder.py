"""The Recorder's cost (issue 13), measured on a plain 2-rank DDP loop of a
small GPT-like model (this module's `build_model`: a researcher's model, not
dormouse's) with gradient accumulation, AdamW and clipping:

recorder_overhead
    step time of the loop with the Recorder over the same loop without it,
    in one torchrun launch: full tensors every step, CountSketch k=256 every
    step, and the sketch every 10th step. Each round runs every kind once, in
    an order rotated round by round (so no kind always follows another's
    writer or runs first), each on a fresh model from build_model (so every
    round's recording is valid); a kind's run is one untimed warm-up step
    (recorded: the first step's allocations, the writer thread's start, first
    kernels) and then `steps` timed steps, summarised by their median. The
    figure is the median over rounds of (kind's median step) / (the plain
    loop's median step in the same round), with its spread (goal: <= 1.05
    with sketches); beside it `in_step_fraction`, the median time inside
    rec.step() over the plain step (the part the Recorder puts on the loop's
    thread), and `cpu_ratio`, the fleet's CPU seconds per timed step (all
    ranks and threads, the Recorder's writer and close included) with the
    Recorder over without: both less exposed to a loaded machine than a
    ratio of wall times.
recorder_judge_cost
    `dormouse gate check`'s work on a recording (the one-process reference and
    the judge, one process) over the fleet's compute for the recorded steps,
    in CPU seconds (the fleet's: all ranks), for the full and the sketched
    recording (goal: <= 3), after one untimed warm-up check (imports, first
    kernels); `wall_ratio` beside it (W x the steps' wall time). The fleet's
    compute for the recorded steps is the first round's median step times the
    recorded steps (the warm-up step included: it is recorded and judged).

Rank side: `torchrun ... -m dormouse.bench.recorder --out DIR ...`; driver: `bench_recorder`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dormouse.gate.record.launcher import torchrun

VOCAB = 256
KINDS = {"none": None, "full": {"sketch": 0, "every": 1}, "sketch": {"sketch": 256, "every": 1},
         "sketch_every10": {"sketch": 256, "every": 10},
         # the same with the reference-free checks inside the run (RecordingSpec(selfcheck=64)): their cost is this
         # kind's step over sketch_every10's in the same rounds
         "sketch_every10_selfcheck": {"sketch": 256, "every": 10, "selfcheck": 64}}


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.heads = max(1, d // 32)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, d: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build_model(*, d: int = 128, layers: int = 2, seq: int = 128, seed: int = 0, **_) -> GPT:
    torch.manual_seed(seed)
    return GPT(d, layers, seq)


def build_optimizer(model, **_):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def timed_rounds(out: Path, kinds: list[str], rounds: int, steps: int, new_run, **about) -> None:
    """The rank side's rounds (see the module docstring): each round runs every kind once, in an order
    rotated round by round, each on a fresh run from `new_run(kind, path) -> (step, rec, model)` (step():
    (wall s, s inside rec.step)), one untimed warm-up step then `steps` timed ones; rank 0 writes
    times.json (with `about`)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    in_rec: dict[str, list[float]] = {k: [] for k in times}
    cpu: dict[str, list[float]] = {k: [] for k in times}  # the fleet's CPU seconds per step (all ranks, all threads)
    for r in range(rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # rotated round by round
            step, rec, model = new_run(kind, out / f"{kind}_r{r}")
            dist.barrier()
            step()  # the untimed warm-up step (recorded)
            dist.barrier()
            c0 = time.process_time()
            per = [step() for _ in range(steps)]
            if rec is not None:
                rec.close()  # the writer thread's work counts: it is flushed here
            c = torch.tensor(time.process_time() - c0, dtype=torch.float64)
            dist.all_reduce(c)
            cpu[kind].append(float(c) / steps)
            dist.barrier()
            times[kind].append(statistics.median(t for t, _ in per))
            in_rec[kind].append(statistics.median(x for _, x in per))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is its whole tensor's
        (out / "times.json").write_text(json.dumps({"times": times, "in_rec": in_rec, "cpu": cpu, "world": world,
                                                    "steps": steps, "recorded_steps": steps + 1,
                                                    "params": params, **about}))
    dist.barrier()


def _rank_main(argv: list[str]) -> int:
    import torch.distributed as dist

    from dormouse.gate import Recorder, RecordingSpec

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    kw = {"d": a.width, "layers": a.layers, "seq": a.seq, "seed": 0}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (a.batch, a.seq), generator=g) for _ in range(a.micro)]

    def new_run(kind: str, path: Path):
        """A fresh model, its DDP loop and (for a recorded kind) its Recorder: (step, rec, model)."""
        model = build_model(**kw)
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = build_optimizer(model)
        rec = None
        if KINDS[kind] is not None:
            rec = Recorder(path, net, RecordingSpec(build_model="dormouse.bench.recorder:build_model",
                                                    build_optimizer="dormouse.bench.recorder:build_optimizer",
                                                    objective="causal_lm", max_grad_norm=1.0, build_kwargs=kw,
                                                    **KINDS[kind]))

        def step() -> tuple[float, float]:
            """One optimizer step: (its wall seconds, those inside rec.step)."""
            t0 = time.perf_counter()
            total, inside = torch.zeros(()), 0.0
            for m, ids in enumerate(batches):  # equal lengths: the mean of micro-batch means is the token mean
                with net.no_sync() if m < a.micro - 1 else contextlib.nullcontext():
                    logits = net(input_ids=ids, labels=ids)
                    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                    (loss / a.micro).backward()
                total += loss.detach()
            dist.all_reduce(total)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if rec is not None:
                t1 = time.perf_counter()
                rec.step(loss=total / (a.micro * world), optimizer=opt, grad_norm=norm)
                inside = time.perf_counter() - t1
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0, inside

        return step, rec, model

    timed_rounds(Path(a.out), a.kinds.split(","), a.rounds, a.steps, new_run,
                 tokens_per_rank_step=a.micro * a.batch * a.seq)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def bench_recorder(quick: bool, tmp: Path, log=print, *, module: str = "dormouse.bench.recorder", world: int = 2,
                   name: str = "recorder", sizes: tuple[tuple[int, int], tuple[int, int]] = ((2, 3), (4, 4)),
                   args: tuple[str, ...] = ()) -> dict:
    """Run the rank side (`module`) in one `world`-rank torchrun launch, then time the gate's
    check of the first round's full and sketched recordings (see the module docstring).
    `sizes`: (rounds, timed steps) quick and full."""
    from dormouse.gate.judge.entry import judge
    from dormouse.gate.record.reference import make_reference

    # timed steps per kind and round, after one warm-up step: 4 x (1 + 4) x 4 kinds = the 80 steps 5 x 4 x 4 were
    rounds, steps = sizes[0] if quick else sizes[1]
    out = Path(tmp) / name
    cmd = torchrun(["-m", module, "--out", str(out), "--rounds", str(rounds), "--steps", str(steps), *args],
                   world=world)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} bench failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    t = json.loads((out / "times.json").read_text())
    times = t["times"]
    res: dict = {"rounds": rounds, "steps": steps, "world": t["world"], "params": t["params"],
                 "tokens_per_rank_step": t["tokens_per_rank_step"], "step_s_median": {}, "overhead": {}}
    for kind, ts in times.items():
        res["step_s_median"][kind] = statistics.median(ts)
        if kind != "none":
            ratios = [x / y for x, y in zip(ts, times["none"])]
            inside = [x / y for x, y in zip(t["in_rec"][kind], times["none"])]
            cpu = [x / y for x, y in zip(t["cpu"][kind], t["cpu"]["none"])]
            res["overhead"][kind] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                     "in_step_fraction": statistics.median(inside),
                                     "cpu_ratio": statistics.median(cpu)}
    res["judge_cost"] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        make_reference(out / "full_r0", log=lambda line: None, force=True)  # warm-up: imports, first kernels
        for kind in ("full", "sketch"):
            d = out / f"{kind}_r0"
            t0, c0 = time.perf_counter(), time.process_time()
            make_reference(d, log=lambda line: None, force=True)
            v = judge(d)
            judge_s, judge_cpu = time.perf_counter() - t0, time.process_time() - c0
            fleet_s = t["world"] * t["recorded_steps"] * times[kind][0]
            fleet_cpu = t["recorded_steps"] * t["cpu"][kind][0]
            res["judge_cost"][kind] = {"judge_s": judge_s, "fleet_rank_s": fleet_s, "wall_ratio": judge_s / fleet_s,
                                       "judge_cpu_s": judge_cpu, "fleet_cpu_s": fleet_cpu,
                                       "ratio": judge_cpu / fleet_cpu, "verdict": "PASS" if v.passed else "FAIL"}
    finally:
        torch.set_num_threads(threads)
    log(f"{name}: overhead {res['overhead']}, judge cost {res['judge_cost']}")
    return res


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
