"""`python -m dormouse.bench.device [--device cuda] [--docs docs/benchmarks.md]`:
the accelerator check, one prepared run for a machine with a GPU (minutes of
device time), the same code on the CPU (`--device cpu --quick`, which the
tests run with --preset tiny so that the check stays runnable where no GPU is).

small_tokens_per_s (float32, bfloat16)
    THE loop, dormouse.train.loop.train() (bench.stepper.Stepper, one untimed
    warm-up step, then timed steps between its on_step hooks; the loop's
    float(loss) synchronises the device once a step), on the `small` preset
    at batch 8 x 256, the model in float32 and in bfloat16 (model.bf16).
mfu (float32, bfloat16)
    model FLOP utilisation: step_flops (matrix products only, forward,
    backward and Newton-Schulz) per second over the device's own square
    matmul rate in that dtype, measured beside it (n = 4096, 8192 on CUDA),
    and over a datasheet peak when --peak-tflops gives one.
gate_micro
    the tiny gate on the device: one process at the global batch of 6
    windows against a fleet of one rank (torchrun) in micro-batches of 2, with
    gradref and the replay (dormouse.gate.pipeline.gate): the verdict, each
    check's reason. One GPU cannot hold two NCCL ranks, so the fleet under
    test here is the micro-batched step, not the reduce.
gate_exact
    the same fleet under --reduce exact: on CUDA every process of it runs
    torch's deterministic algorithms (record.modes.deterministic_kernels);
    the exact check says whether the fleet equals its exact reference bitwise.

Writes <repo>/artifacts/bench_device.json (atomically) and, with --docs, the
page's "On an accelerator" section (the rest of the page is left as it is;
`dormouse bench --docs` keeps this section when it rewrites the rest).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dormouse import atomic
from dormouse.bench.page import SECTION, write_section
from dormouse.bench.paths import artifacts_dir
from dormouse.bench.rates import matmul_rate
from dormouse.bench.stepper import SHAPES, Stepper
from dormouse.model.flops import step_flops

DTYPES = ("float32", "bfloat16")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()} CPU (torch {torch.__version__})"


def throughput(device: str, *, steps: int, name: str = "small", log=print) -> dict:
    """small_tokens_per_s and mfu for each dtype, each measured beside the matmul rate of its dtype
    (`name`: another preset, tiny for the CPU's dry run)."""
    sizes = (4096, 8192) if device.startswith("cuda") else (512,)
    out = {}
    for dt in DTYPES:
        dtype = getattr(torch, dt)
        stepper = Stepper(name, *SHAPES[name], device=device, bf16=(dt == "bfloat16"))
        stepper.warm()
        times = stepper.timed(steps)
        rate = statistics.median(matmul_rate(sizes, dtype=dtype, device=device).values())  # GFLOP/s
        step_s = statistics.median(times)
        flops = step_flops(stepper.run.model, stepper.run.train, stepper.batch, stepper.seq_len)["total"]
        out[dt] = {"tokens_per_s": stepper.tokens / step_s, "step_s": step_s, "steps_s": times,
                     "model_tflops": flops / step_s / 1e12, "matmul_tflops": rate / 1e3,
                     "mfu_vs_matmul": flops / step_s / (rate * 1e9),
                     "losses_finite": all(math.isfinite(x) for x in stepper.losses)}
        log(f"  {name} {dt}: {out[dt]['tokens_per_s']:.0f} tokens/s, step {step_s * 1e3:.1f} ms, "
            f"{out[dt]['model_tflops']:.3g} model TFLOP/s = {out[dt]['mfu_vs_matmul']:.3f} of the "
            f"{rate / 1e3:.3g} TFLOP/s square matmul")
    return out


def gates(device: str, tmp: Path, *, steps: int | None = None, log=print) -> dict:
    """The tiny gate's verdicts on the device: micro-batched fleet of one rank, then the same under exact
    (`steps`: the gate's optimizer steps, its own default when None)."""
    from dormouse.gate.pipeline import check, gate

    out = {}
    for key, extra in (("gate_micro", {}), ("gate_exact", {"reduce": "exact"})):
        extra = {**extra, **({"steps": steps} if steps is not None else {})}
        s = check(world=1, profile="6", micro_batch=2, resume_world=0, device=device, out=str(tmp / key), **extra)
        t0 = time.perf_counter()
        v = gate(s, log=lambda line: None)
        out[key] = {"passed": v.passed, "seconds": time.perf_counter() - t0, "steps": s.steps,
                    "checks": [{"name": c.name, "passed": c.passed, "reason": c.reason} for c in v.checks]}
        log(f"  {key}: {'PASS' if v.passed else 'FAIL'} in {out[key]['seconds']:.1f} s")
    return out


def section(res: dict) -> str:
    """The docs page's section, from one bench_device.json."""
    command = f"python -m dormouse.bench.device --device {res['device']} --preset {res['preset']} --docs docs/benchmarks.md"
    lines = [SECTION, "", f"Generated by `{command}` ({res['date']}) on {res['device_name']}.", "", "```"]
    for dt, r in res["throughput"].items():
        peak = res.get("peak_tflops", {}).get(dt)
        vs_peak = f", {r['model_tflops'] / peak:.3f} of the {peak:g} TFLOP/s datasheet peak" if peak else ""
        lines.append(f"{res['preset']} {dt:9s} {r['tokens_per_s']:10.0f} tokens/s  step {r['step_s'] * 1e3:8.1f} ms  "
                     f"MFU {r['mfu_vs_matmul']:.3f} of the measured {r['matmul_tflops']:.3g} TFLOP/s "
                     f"square matmul{vs_peak}")
    for key, g in res["gates"].items():
        steps = f"{g['steps']} steps, " if "steps" in g else ""
        lines.append(f"{key}: {'PASS' if g['passed'] else 'FAIL'} ({steps}{g['seconds']:.1f} s)")
        lines += [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['reason']}" for c in g["checks"]]
    return "\n".join(lines + ["```", ""])


def main(argv: list[str] | None = None) -> int:
    from dormouse.errors import DormouseError, OneLineParser, command_status

    p = OneLineParser(prog="python -m dormouse.bench.device", description=__doc__.splitlines()[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--steps", type=int, default=10, help="timed steps of the small preset per dtype")
    p.add_argument("--quick", action="store_true", help="3 timed steps (with --preset tiny: the CPU's dry run)")
    p.add_argument("--gate-steps", type=int, default=None, metavar="N",
                   help="optimizer steps of each gate (default: the gate's own; the tests' dry run takes fewer)")
    p.add_argument("--preset", default="small", choices=sorted(SHAPES), help="the preset whose steps are timed")
    p.add_argument("--peak-tflops", default="", metavar="F32,BF16",
                   help="the device's datasheet peaks in TFLOP/s, e.g. 67,989 (H100/H200 SXM dense)")
    p.add_argument("--out", default=None, help="result JSON (default: <repo>/artifacts/bench_device.json)")
    p.add_argument("--docs", default=None, help="also write this page's accelerator section")
    args = p.parse_args(argv)

    def run() -> int:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise DormouseError("--device cuda but CUDA is not available here: run on a GPU machine, "
                                "or --device cpu --quick for the dry run")
        peaks = {}
        if args.peak_tflops:
            try:
                peaks = dict(zip(DTYPES, map(float, args.peak_tflops.split(","))))
            except ValueError:
                raise DormouseError(f"--peak-tflops {args.peak_tflops!r}: give two numbers, F32,BF16") from None
        if args.gate_steps is not None:
            from dormouse.gate.settings import check

            check(steps=args.gate_steps)  # the gate's own rule, before anything runs
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        torch.set_num_threads(1)
        res = {"device": args.device, "device_name": device_name(args.device),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "peak_tflops": peaks, "preset": args.preset}
        log(f"dormouse bench.device on {res['device_name']}")
        res["throughput"] = throughput(args.device, steps=3 if args.quick else args.steps, name=args.preset, log=log)
        with tempfile.TemporaryDirectory(prefix="dormouse-device-") as tmp:
            res["gates"] = gates(args.device, Path(tmp), steps=args.gate_steps, log=log)
        out = Path(args.out) if args.out else artifacts_dir() / "bench_device.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(out, json.dumps(res, indent=1))
        if args.docs:
            write_section(Path(args.docs), section(res))
        print(section(res))
        return 0 if all(g["passed"] for g in res["gates"].values()) else 1

    return command_status("bench.device", run)


if __name__ == "__main__":
    sys.exit(main())
