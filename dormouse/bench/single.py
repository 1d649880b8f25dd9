"""The single-process section: tiny and small steps of train(), interleaved
round by round with the matmul rates, the Newton-Schulz cliff, the profile
and the sampling speed."""

from __future__ import annotations

import math
import statistics
import time

import torch

from dormouse.bench.profiling import profile_steps
from dormouse.bench.rates import BF16_MATMUL_SIZES, matmul_rate, parts_at_rates
from dormouse.bench.sampling import sampling_rate
from dormouse.bench.stats import ratio_summary
from dormouse.bench.stepper import SHAPES, Stepper
from dormouse.model.flops import step_flops

# What the full run costs here (2 cores; each figure's time in its section,
# printed with the run's wall time, goal <= 10 minutes): a small step ~1.7 s,
# the native bf16 kernel's ~7 s, a 2-rank fleet step ~1.9 s, a 4-rank one ~4 s.
NATIVE_ROUNDS = 3  # rounds of bench_single (of 4) that time the native bf16 kernel's step


def bench_single(quick: bool, log) -> dict:
    """tiny and small steps, interleaved round by round with the fp32 and bf16
    matmul rates and with the small step at ns_dtype=float32 (the cliff ratio:
    TrainConfig's default over it, per round); full runs also time the small
    step on the native bf16 Newton-Schulz kernel, one step in each of the
    first NATIVE_ROUNDS rounds (a step there costs ~4 small steps; its own
    train() call's untimed first step warms it, so it has no separate warm-up).
    `sections` (name -> seconds) receives the wall time of the steps' rounds,
    the profile and the sampling."""
    t0 = time.perf_counter()
    rounds, n_small, n_tiny = (2, 2, 8) if quick else (4, 2, 12)
    tiny = Stepper("tiny", *SHAPES["tiny"])
    small = Stepper("small", *SHAPES["small"])
    small_f32 = Stepper("small", *SHAPES["small"], ns_dtype="float32")
    small_native = None if quick else Stepper("small", *SHAPES["small"], ns_kernel="native")
    for stepper in (tiny, small, small_f32):
        stepper.warm()
    rates, bf16_rates, small_t, tiny_t, f32_t, native_t, per_round = [], [], [], [], [], [], []
    cliff, native_cliff = [], []
    for r in range(rounds):
        rr = matmul_rate()
        rb = matmul_rate(BF16_MATMUL_SIZES, dtype=torch.bfloat16)
        st = small.timed(n_small)
        sf = small_f32.timed(n_small)
        sn = small_native.timed(1) if small_native is not None and r < NATIVE_ROUNDS else []
        tt = tiny.timed(n_tiny)
        rates.append(statistics.median(rr.values()))
        bf16_rates.append(statistics.median(rb.values()))
        small_t += st
        f32_t += sf
        native_t += sn
        tiny_t += tt
        cliff.append(statistics.median(st) / statistics.median(sf))
        if sn:
            native_cliff.append(statistics.median(sn) / statistics.median(sf))
        per_round.append({"matmul_gflops": rr, "matmul_bf16_gflops": rb, "small_step_s": st,
                          "small_ns_float32_step_s": sf, "small_ns_native_step_s": sn})
        log(f"  round {r + 1}/{rounds}: matmul {rates[-1]:.1f} GFLOP/s (bf16 {bf16_rates[-1]:.2f}), small step "
            f"{statistics.median(st) * 1e3:.0f} ms (ns float32 {statistics.median(sf) * 1e3:.0f} ms"
            + (f", native bf16 {sn[0] * 1e3:.0f} ms" if sn else "") + f"), tiny step {statistics.median(tt) * 1e3:.1f} ms")
    flops = step_flops(small.run.model, small.run.train, small.batch, small.seq_len)
    rate, bf16_rate = statistics.median(rates), statistics.median(bf16_rates)
    small_s, tiny_s = statistics.median(small_t), statistics.median(tiny_t)
    achieved = flops["total"] / small_s / 1e9
    at_rates = parts_at_rates(flops, small.run.model, small.run.train, {"float32": rate, "bfloat16": bf16_rate})
    at_rates["parts"]["newton_schulz"]["optimizer_step_s"] = statistics.median(small.opt_s[-len(small_t):])
    at_rates["matmul_fraction"] = at_rates["ideal_s"] / small_s
    sections = {"single_steps": time.perf_counter() - t0}
    log("  profiling the small step ...")
    t0 = time.perf_counter()
    prof = profile_steps(small, 1 if quick else 3, flops["total"], rate)
    mm_flops = flops["total"] - flops["train_attention"]
    prof["matmul_kernel_gflops"] = mm_flops / prof["matmul_kernel_s_per_step"] / 1e9 if prof["matmul_kernel_s_per_step"] else None
    sections["profile"] = time.perf_counter() - t0
    log("  sampling (dormouse.infer.generate, small) ...")
    t0 = time.perf_counter()
    sampling = sampling_rate("small", tokens=40 if quick else 100, rounds=3 if quick else 4)
    sections["sampling"] = time.perf_counter() - t0
    return {
        "tokens_per_s_tiny": tiny.tokens / tiny_s,
        "tokens_per_s_small": small.tokens / small_s,
        "matmul_rate_gflops": rate,
        "matmul_rate_bf16_gflops": bf16_rate,
        "matmul_fraction_small": achieved / rate,
        "matmul_fraction_by_dtype": at_rates["matmul_fraction"],
        "step_parts_at_rates": at_rates,
        "ns_kernel": small.ns_kernel,
        "ns_cliff_small": ratio_summary(cliff),
        "ns_native_cliff_small": ratio_summary(native_cliff) if native_cliff else None,
        "small_ns_float32_step_s": statistics.median(f32_t),
        "small_ns_native_step_s": statistics.median(native_t) if native_t else None,
        "sample_bytes_per_s_small": sampling,
        "profile": prof,
        "small_flops": flops,
        "small_achieved_gflops": achieved,
        "small_step_s": small_s,
        "tiny_step_s": tiny_s,
        "timed": "train() steps, between on_step calls (StepClock)",
        "step_parts_s": {k.name: {part: statistics.median(v) for part, v in k.clock.parts.items()}
                         for k in (tiny, small)},
        "tiny_flops": step_flops(tiny.run.model, tiny.run.train, tiny.batch, tiny.seq_len)["total"],
        "rounds": per_round,
        "shapes": {"tiny": SHAPES["tiny"], "small": SHAPES["small"]},
        "losses_finite": all(math.isfinite(v) for v in small.losses + tiny.losses + small_f32.losses),
        "sections_s": sections,
    }
