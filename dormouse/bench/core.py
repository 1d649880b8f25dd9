"""`python -m dormouse.bench [--quick]`: how fast dormouse trains on this machine.

Every ratio is taken side by side in ONE run (the machine is shared and noisy:
a figure measured an hour ago says little about now). Prints a table and
writes `artifacts/bench.json` (at the repository root, found from the
package's location) atomically, one key per figure:

tokens_per_s_tiny, tokens_per_s_small
    steps of the tiny and small presets, one thread: THE loop itself,
    dormouse.train.loop.train() (LocalSync, TrainConfig's defaults, the
    built-in corpus), timed between its on_step hooks and split into compute /
    reduce / optimizer by its on_local_grads and on_reduced hooks (StepClock;
    each train() call's first step untimed); tiny 4 x 64, small 8 x 256.
matmul_rate_gflops, matmul_fraction_small
    the one-thread float32 matmul rate (square n = 512, 768, 1024), measured in
    rounds interleaved with the small preset's steps, and the small step's
    achieved FLOP rate (`step_flops`) divided by it.
matmul_rate_bf16_gflops, matmul_fraction_by_dtype
    the bfloat16 matmul rate (square n = 512; on a CPU without native bf16
    about 100x below float32) beside the float32 one, and the small step's
    ideal time with each part at the rate of the dtype its matmuls run in
    (the model's products in the model's dtype; Newton-Schulz in bfloat16 only
    on the native kernel, see train/newton_schulz.py) over its measured time.
ns_cliff_small
    the small step with TrainConfig's defaults (bf16 Newton-Schulz, ns_kernel
    "auto") over the same step with ns_dtype="float32", median of per-round
    ratios with spread (goal <= 1.3); full runs add the native bf16 kernel's
    ratio (the cliff a CPU without native bf16 falls off).
sample_bytes_per_s_small
    bytes/s of dormouse.infer.generate on the small preset, one thread, from a
    4-byte prompt (within the window) and from a prompt of max_seq_len bytes
    (every byte slides the window), side by side with the uncached reference,
    the forward with the KV cache per byte, and a batch of 16 samples
    (generate_many), in alternating rounds: ratios with their spread.
profile_small_top
    the top ops of the small step by self CPU time (torch.profiler) and their
    share; the printed table adds a "where the time goes" breakdown.
fleet_vs_ddp, scaling_efficiency
    from one torchrun launch of 2 ranks (gloo, one thread each) running
    dormouse.bench.fleet, which times THE loop, train(), through its on_step
    hook: our FleetSync fleet (train_dist) against torch's
    DistributedDataParallel driving the same train() through DDPSync, on the
    same model, corpus and optimizer (ours / DDP step time), and the fleet's
    tokens/s over twice one process's (rank 0 alone, same per-process batch, in
    the same launch). The kinds alternate round by round; each headline is the
    median over rounds of the round's ratio, with its spread (min..max over
    rounds) and the ratio of the overall medians beside it.
exact_vs_ring
    from a torchrun launch of 4 ranks: the step time of dist_reduce="exact"
    over the fp32 ring all-reduce, small preset, batch 8 per rank in
    micro-batches of 4 (two slices per rank, where the ring is not exact),
    alternating round by round (goal <= 1.1).
pipeline_verdict_s, pipeline_wall_s, pipeline_parts_s
    the tiny `dormouse pipeline` as a user runs it: seconds until its verdict
    is printed and until it ends (the four notebooks presented), and each part
    alone (dormouse.bench.gate.pipeline_timing): the single run with its
    floors, the fleet's launches, gradref, the recording's reference, the judge, one notebook.
recorder_overhead, recorder_judge_cost
    the Recorder (issue 13) on a plain 2-rank DDP loop of a small GPT-like
    model: its step-time overhead with sketches (goal <= 1.05) and the cost of
    `dormouse gate check` over the fleet's compute for the recorded steps
    (goal <= 3); see dormouse.bench.recorder.
recorder_2d_overhead, recorder_2d_judge_cost
    the same on a 2-D run beside them: a torchtitan-style llama on a (dp 2,
    tp 2) mesh of 4 ranks (FSDP2 on dp, torchtitan's TP plan on tp), full
    tensors and sketches every step; see dormouse.bench.recorder_2d.
gate_smallest_caught_eps
    the gate's sensitivity (dormouse.bench.gate): the smallest eps for which
    rank 1's local gradient times (1 + eps N(0,1)) at one step of a 2-rank
    "4,2" fleet fails the verdict, over a ladder of eps.
fleet_launch_fixed_s
    the fixed costs of a fleet launch: `python -c "import torch"` and a 2-rank
    torchrun --standalone launch that only joins the fleet (init_process_group,
    barrier, destroy).

On a machine with a GPU, `python -m dormouse.bench.device --docs
docs/benchmarks.md` is the accelerator's check (dormouse.bench.device): the
small preset's tokens/s and model FLOP utilisation in float32 and bfloat16,
the gate micro-batched and exact on the device; it writes the page's last
section, which `--docs` here keeps.

The table ends with the run's own wall time and each section's seconds
(meta.wall_s, meta.sections_s): a full run must fit in 10 minutes on a 2-core
machine. Its rounds are sized for that (NATIVE_ROUNDS, FLEET_ROUNDS,
bench_single, sampling_rate's rounds), each noisy ratio keeping 4 rounds or
more and its spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from dormouse import atomic
from dormouse.bench.launches import bench_fleet, bench_launch
from dormouse.bench.paths import artifacts_dir
from dormouse.bench.report import format_table, write_docs
from dormouse.bench.single import bench_single
from dormouse.config import TrainConfig

LAUNCH_FAILED = (RuntimeError, subprocess.TimeoutExpired)  # a launch that failed or hung
ANY_FAILED = (Exception,)  # a measurement that failed is a note, not a crash of the bench


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of the bench: `measure(quick, tmp, log)` drives train() or the
    gate and returns the section's details; `figures(details)` gives its
    headline keys of bench.json. A failure of a kind in `catch` becomes a note
    ("<failed>: <message>"; with `keep_error` also details["<name>_error"]) and
    leaves its figures null; any other failure ends the bench. `detail`: the
    key its details are kept under (None: not kept). Its wall seconds go to
    meta.sections_s under `name`, or, when the details hold their own
    "sections_s", those."""

    name: str
    what: str  # what it measures: the line logged as it starts ({mode}: quick or full)
    measure: Callable[[bool, Path, Callable[[str], None]], dict]
    figures: Callable[[dict], dict]
    detail: str | None = None
    failed: str = ""
    catch: tuple[type[BaseException], ...] = ()
    keep_error: bool = False


def _exact(quick: bool, tmp: Path, log) -> dict:
    return bench_fleet(quick, tmp, log, world=4, kinds="ring,exact", micro_batch=4, name="exact")


def _recorder(quick: bool, tmp: Path, log) -> dict:
    from dormouse.bench.recorder import bench_recorder

    return bench_recorder(quick, tmp, log)


def _recorder_2d(quick: bool, tmp: Path, log) -> dict:
    from dormouse.bench.recorder_2d import bench_recorder_2d

    return bench_recorder_2d(quick, tmp, log)


def _sensitivity(quick: bool, tmp: Path, log) -> dict:
    from dormouse.bench.gate import sensitivity

    return sensitivity(log, steps=4 if quick else 6)


def _pipeline(quick: bool, tmp: Path, log) -> dict:
    from dormouse.bench.gate import pipeline_timing

    return pipeline_timing(log)


SINGLE_FIGURES = ("tokens_per_s_tiny", "tokens_per_s_small", "matmul_rate_gflops", "matmul_fraction_small",
                  "matmul_rate_bf16_gflops", "matmul_fraction_by_dtype")

SECTIONS = (
    Section("single", "dormouse bench ({mode}): single process, one thread ...",
            lambda quick, tmp, log: bench_single(quick, log),
            lambda s: {**{k: s[k] for k in SINGLE_FIGURES}, "ns_cliff_small": s["ns_cliff_small"]["median"],
                       "sample_bytes_per_s_small": s["sample_bytes_per_s_small"],
                       "profile_small_top": s["profile"]["top"]},
            detail="single"),
    Section("fleet", "fleet: one torchrun launch of 2 ranks (ours / DDP / both / solo, alternating) ...",
            bench_fleet, lambda f: {"fleet_vs_ddp": f["fleet_vs_ddp"], "scaling_efficiency": f["scaling_efficiency"]},
            detail="fleet", failed="fleet bench failed", catch=LAUNCH_FAILED, keep_error=True),
    Section("exact", "exact reduce: one torchrun launch of 4 ranks (ring / exact, alternating) ...",
            _exact, lambda e: {"exact_vs_ring": e["exact_vs_ring"]},
            detail="exact", failed="exact bench failed", catch=LAUNCH_FAILED, keep_error=True),
    Section("recorder", "recorder: a plain 2-rank DDP loop with and without the Recorder, then gate check ...",
            _recorder, lambda r: {"recorder_overhead": r["overhead"]["sketch"]["median"],
                                  "recorder_judge_cost": r["judge_cost"]["sketch"]["ratio"]},
            detail="recorder", failed="recorder bench failed", catch=ANY_FAILED, keep_error=True),
    Section("recorder_2d", "recorder 2-D: a dp 2 x tp 2 loop (FSDP2 + TP, 4 ranks) with and without the Recorder, "
            "then gate check ...", _recorder_2d,
            lambda r: {"recorder_2d_overhead": r["overhead"]["sketch"]["median"],
                       "recorder_2d_judge_cost": r["judge_cost"]["sketch"]["ratio"]},
            detail="recorder_2d", failed="recorder 2-D bench failed", catch=ANY_FAILED, keep_error=True),
    Section("launch", "launch fixed costs ...", lambda quick, tmp, log: bench_launch(quick, tmp),
            lambda lf: {"fleet_launch_fixed_s": lf}, failed="launch timing failed", catch=LAUNCH_FAILED),
    Section("sensitivity", "gate sensitivity: the smallest one-rank, one-step gradient perturbation the verdict "
            "catches ...", _sensitivity, lambda g: {"gate_smallest_caught_eps": g["smallest_caught"]},
            detail="sensitivity", failed="gate sensitivity failed", catch=ANY_FAILED),
    Section("pipeline", "pipeline: the tiny `dormouse pipeline`, whole and by parts ...", _pipeline,
            lambda p: {"pipeline_verdict_s": p["pipeline_verdict_s"], "pipeline_wall_s": p["pipeline_wall_s"],
                       "pipeline_parts_s": p["parts_s"]},
            detail="pipeline", failed="pipeline timing failed", catch=ANY_FAILED),
)
# bench.json's headline keys, in the order it writes them (null until their section gives them)
FIGURES = (*SINGLE_FIGURES, "ns_cliff_small", "sample_bytes_per_s_small", "profile_small_top", "fleet_vs_ddp",
           "scaling_efficiency", "exact_vs_ring", "pipeline_verdict_s", "pipeline_wall_s", "pipeline_parts_s",
           "fleet_launch_fixed_s", "gate_smallest_caught_eps", "recorder_overhead", "recorder_judge_cost",
           "recorder_2d_overhead", "recorder_2d_judge_cost")


def run_sections(sections, quick: bool, tmp: Path, log, t_start: float) -> tuple[dict, dict, dict, list[str]]:
    """Each section in turn: (figures, details, seconds by section, notes)."""
    res: dict = dict.fromkeys(FIGURES)
    details: dict = {}
    seconds: dict[str, float] = {}
    notes: list[str] = []
    for sec in sections:
        log(sec.what.format(mode="quick" if quick else "full"))
        t0 = time.perf_counter()
        try:
            got = sec.measure(quick, tmp, log)
            if sec.detail:
                details[sec.detail] = got
            res.update(sec.figures(got))
        except sec.catch as e:
            if sec.keep_error:
                details[f"{sec.name}_error"] = str(e)
            notes.append(f"{sec.failed}: {str(e)[:300]}")
            got = {}
        if "sections_s" in got:  # a section that times its own parts
            seconds.update(got["sections_s"])
            continue
        seconds[sec.name] = time.perf_counter() - t0
        log(f"  ({sec.name}: {seconds[sec.name]:.0f} s; {time.perf_counter() - t_start:.0f} s since the start)")
    return res, details, seconds, notes


def main(argv: list[str] | None = None) -> int:
    from dormouse.errors import OneLineParser

    p = OneLineParser(prog="python -m dormouse.bench", description=__doc__.splitlines()[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer rounds (about two minutes)")
    p.add_argument("--out", default=None, help="result JSON (default: <repo>/artifacts/bench.json)")
    p.add_argument("--docs", default=None, help="also write this Markdown page from the results (docs/benchmarks.md)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="measure nothing: write --docs (or print) from an existing bench.json")
    p.add_argument("--scale", action="store_true",
                   help="the scale page instead (dormouse/bench/scale.py): GPT-2 under transformers' Trainer at "
                        "--sizes, recorded and checked; --out default artifacts/scale.json, --docs writes its section")
    p.add_argument("--sizes", default="tiny,mid,small", help="with --scale: tiny, mini (6.9M), mid (30M), small (124M), medium (GPT-2 sizes under the "
                        "Trainer); moe (Qwen3-MoE, 133M, the Trainer); llama (an FSDP2 loop, 125M), llama_tiny")
    p.add_argument("--steps", type=int, default=3, help="with --scale: optimizer steps per run")
    p.add_argument("--kill-gb", type=float, default=None,
                   help="with --scale: kill a run whose processes hold more (default 90%% of the memory available)")
    p.add_argument("--check-threads", type=int, default=2, help="with --scale: gate check's --threads")
    p.add_argument("--faults", default="", help="with --scale: planted faults to record and check at each size "
                                                "(scale1.001, scale1.001_pre, no_avg_tokens, local_norm, micro_mean)")
    p.add_argument("--modes", default="full,check,none,sketch",
                   help="with --scale: the clean runs (full: recorded in full tensors, check: and checked; none: "
                        "unrecorded; sketch: sketched); --modes '' with --faults for the faults alone")
    p.add_argument("--sharded", type=int, default=0, metavar="N",
                   help="with --scale: also check the full recording under torchrun over N ranks (the sharded "
                        "reference, docs/sharded.md): its wall, peak per process and whether its verdict is the same")
    args = p.parse_args(argv)
    if args.scale and args.render:  # several scale runs' JSON (comma-separated) merged into one page section
        from dormouse.bench.scale import render_scale

        return render_scale([Path(x) for x in args.render.split(",") if x],
                            docs=Path(args.docs) if args.docs else None)
    if args.scale:
        from dormouse.bench.scale import scale_main

        sizes = [x.strip() for x in args.sizes.split(",") if x.strip()]
        return scale_main(sizes, steps=args.steps, out=Path(args.out) if args.out else artifacts_dir() / "scale.json",
                          docs=Path(args.docs) if args.docs else None, kill_gb=args.kill_gb,
                          threads=args.check_threads, faults=tuple(f for f in args.faults.split(",") if f),
                          modes=tuple(m for m in args.modes.split(",") if m), sharded=args.sharded)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        if args.docs:
            write_docs(Path(args.docs), res)
        print(format_table(res))
        return 0
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else artifacts_dir() / "bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mode = "quick" if args.quick else "full"

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    busy = []
    if load_start[0] >= 0.5:
        busy.append(f"the machine was already busy when the bench started (1-min load average "
                    f"{load_start[0]:.2f} on {os.cpu_count()} CPUs): absolute figures are noisy; "
                    "the ratios were taken side by side")
    with tempfile.TemporaryDirectory(prefix="dormouse-bench-") as tmp:
        figures, details, sections, notes = run_sections(SECTIONS, args.quick, Path(tmp), log, t_start)
    notes = busy + notes
    notes.append("FLOPs count matrix products only (see dormouse.model.flops.step_flops); Newton-Schulz runs in "
                 f"{TrainConfig.ns_dtype} (TrainConfig's default) on the {details['single']['ns_kernel']!r} kernel "
                 f"here (float32 matmuls unless 'native'): matmul_fraction_by_dtype holds each part against "
                 "the rate of the dtype its matmuls run in")
    res: dict = {"mode": mode, **figures, "notes": notes, "details": details}
    res["meta"] = {
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(), "wall_s": time.perf_counter() - t_start, "sections_s": sections,
        "unix_time": time.time(), "json": os.path.relpath(out),  # as the user named it: no machine's path
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
    }
    atomic.write_text(out, json.dumps(res, indent=1, default=str) + "\n")
    if args.docs:
        write_docs(Path(args.docs), res)
    print(format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
