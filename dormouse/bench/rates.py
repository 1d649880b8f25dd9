"""Matrix-multiply rates, the yardstick of a step's FLOPs: the square matmul
rate in a dtype, and each part of the step held against the rate of the dtype
its matmuls run in."""

from __future__ import annotations

import time

import torch

from dormouse.config import ModelConfig, TrainConfig

MATMUL_SIZES = (512, 768, 1024)
BF16_MATMUL_SIZES = (512,)  # a CPU without native bf16 runs these at ~1 GFLOP/s: one size keeps the bench short


def matmul_rate(sizes=MATMUL_SIZES, min_s: float = 0.12, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> dict[int, float]:
    """GFLOP/s of C = A @ B (square n x n) in `dtype` on `device`, current thread setting."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rates = {}
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
        c = torch.empty(n, n, dtype=dtype, device=device)
        torch.mm(a, b, out=c)
        sync()
        reps, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=c)
            reps += 1
            sync()
            dt = time.perf_counter() - t0
            if dt >= min_s and reps >= 2:
                break
        rates[n] = 2 * n ** 3 * reps / dt / 1e9
    return rates


def ns_matmul_dtype(t: TrainConfig) -> str:
    """The dtype whose matmul kernels Newton-Schulz runs on for this config here:
    "bfloat16" only for bf16 Newton-Schulz on the native kernel (newton_schulz.py)."""
    from dormouse.train.newton_schulz import resolve_kernel

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[t.ns_dtype]
    return "bfloat16" if dtype == torch.bfloat16 and resolve_kernel(t.ns_kernel, dtype) == "native" else "float32"


def parts_at_rates(flops: dict[str, float], m: ModelConfig, t: TrainConfig, rates: dict[str, float]) -> dict:
    """Each part of the step against the matmul rate of the dtype it runs in:
    the model's products in the model's dtype (bfloat16 if model.bf16), Newton-
    Schulz in ns_matmul_dtype. ideal_s = FLOPs / rate, summed over the parts."""
    model_dtype = "bfloat16" if m.bf16 else "float32"
    ns_dtype = ns_matmul_dtype(t)
    model_flops = flops["total"] - flops["newton_schulz"]
    parts = {
        "model": {"dtype": model_dtype, "flops": model_flops, "ideal_s": model_flops / (rates[model_dtype] * 1e9)},
        "newton_schulz": {"dtype": ns_dtype, "flops": flops["newton_schulz"],
                          "ideal_s": flops["newton_schulz"] / (rates[ns_dtype] * 1e9)},
    }
    return {"parts": parts, "ideal_s": sum(p["ideal_s"] for p in parts.values())}
