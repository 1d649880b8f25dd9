"""Newton-Schulz orthogonalisation: Muon's map from a momentum matrix G to
(approximately) the orthogonal factor U V^T of its SVD, by an odd polynomial
iteration that uses only matrix products.

    X_0 = G / (s * ||G||_F)                      (transposed first if G is tall)
    A = X X^T;  B = b A + c A A;  X <- a X + B X   (each iteration i, (a, b, c)_i)

"quintic": Keller Jordan's fixed coefficients (3.4445, -4.7750, 2.0315), chosen to
maximise the slope at zero (https://kellerjordan.github.io/posts/muon/); s = 1.
"polar_express": the per-iteration minimax schedule of Amsel, Persson, Musco and
Gower, "The Polar Express" (arXiv:2505.16932), as used in modded-nanogpt, with
its 2% safety factor s = 1.02; iterations past the fifth repeat the last.

The operations and their order are those of `torch.optim.Muon`
(torch/optim/_muon.py): cast to ns_dtype, `div_` by the clamped Frobenius norm,
then `B = addmm(A, A, A, beta=b, alpha=c)` and `X = addmm(X, B, X, beta=a)`.
In bfloat16 another order (b*A + c*(A@A)) differs by bf16 round-off (~5e-3
relative), so matching the order is what makes our step equal torch's.
A stack of matrices (..., rows, cols) is orthogonalised slice by slice with the
batched equivalents (baddbmm).

Two kernels for bfloat16 (`ns_kernel`; float32 Newton-Schulz has one kernel)
-----------------------------------------------------------------------------
"native": the bfloat16 tensors go to torch's bfloat16 matmul. Where torch
does not send bf16 matmuls to oneDNN (an AVX2 CPU such as this AMD EPYC),
that kernel is a plain loop, measured here at about 0.8 GFLOP/s against about
80 for float32 (one thread): Muon then takes most of a step.

"fp32": bfloat16 semantics through float32 kernels. Every tensor the loop
keeps is a bfloat16 value (held in float32), and each operation rounds to
bfloat16 exactly where torch's bfloat16 kernel rounds. What that kernel does
(torch 2.13, CPU without oneDNN bf16; read from aten/src/ATen/native/cpu/
BlasKernel.cpp and ReducedPrecisionFloatGemvFastPathKernel.cpp, and confirmed
bit for bit here against a Python model of those sums on 256 x 256 outputs, k
from 300 to 540: an investigation, too slow to keep as a test):

    products  a_il * b_lj of two bfloat16 values, exact in float32 (8 + 8 bits)
    dot       their float32 sum in a kernel-specific order: 4 interleaved
              partial sums (A @ B, both contiguous), 64 lanes reduced as a tree
              (X @ X^T, the vectorised dot), a plain left fold (A^T @ B)
    epilogue  fma(beta, c_ij, fl(alpha * dot)) in float32 (beta = 0: alpha * dot)
    result    rounded once to bfloat16; nothing before it is rounded to bfloat16

The emulation keeps the products, the epilogue (`torch.add(alpha * dot, c,
alpha=beta)` is that fma, bitwise equal to the kernel on an exactly modelled
dot) and the single rounding; only the dot's summation order is MKL's sgemm's
instead. The norm, the safety factor and the division are the native
bfloat16 operations themselves (O(rows * cols), cheap at any speed).

So, stated precisely (tests/train/test_optim.py checks each; figures from this
AVX2 CPU, one thread):
  bitwise:  the cast, norm and division (the native operations); every
            epilogue and rounding point: where the float32 sums are exact
            (integer operands) the fp32 kernel equals torch's bf16 addmm,
            baddbmm and X @ X^T bit for bit; "native" against torch.optim.Muon
            (unchanged); "fp32" against itself, run to run, on one machine and
            thread count (the gate's bitwise checks compare runs that made the
            same choice: the resolved kernel is in the run's provenance).
  a bound:  "fp32" against "native". One operation, Gaussian operands: 1e-5
            to 1.3e-4 of the elements differ, each by at most one bfloat16 ulp
            plus the float32 summation bound 2 k 2^-24 sum_l |a_il b_lj| (worst
            seen: 0.89 of it). Whole Newton-Schulz (5 quintic steps, the
            `small` preset's shapes): relative Frobenius difference at most
            1e-2 (measured 0 to 6.5e-3), 35% to 100% of the elements bitwise
            equal; float32 Newton-Schulz is 1.1e-2 to 1.9e-2 away, 9% to 15%
            equal. Muon, 6 steps: bitwise torch.optim.Muon on 48 x 16 weights
            (k <= 48: the sums agreed), 8e-3 of the weights' movement away on
            128 x 384 ones (float32 Newton-Schulz: 2.5e-2).
  speed:    the `small` step (one thread, batch 8 x 256) with "fp32" over
            the same step with ns_dtype="float32", side by side on this loaded
            machine: 0.92 and 0.69 (ratios of medians, two runs), 1.03 (median
            of 4 per-round ratios, spread 0.94..1.38, dormouse.bench); the
            "native" kernel 3.8x, 4.6x and 4.15x (3.86..4.75).

`resolve_kernel` picks one: "auto" = "native" wherever torch's own bfloat16
matmul is native (any non-CPU device; a CPU where torch dispatches bf16
matmuls to oneDNN, `torch.ops.mkldnn._is_mkldnn_bf16_supported()`), else
"fp32". A fixed property of the machine and the torch build, never a timing:
two runs on one machine always choose the same.
"""

from __future__ import annotations

import torch

from dormouse.config import NS_KERNELS
from dormouse.errors import ConfigError

EPS = 1e-7  # the clamp on ||G||_F, as torch.optim.Muon

QUINTIC = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def coefficient_schedule(kind: str, steps: int) -> tuple[list[tuple[float, float, float]], float]:
    """(a, b, c) for each of `steps` iterations, and the norm's safety factor."""
    if kind == "quintic":
        return [QUINTIC] * steps, 1.0
    if kind == "polar_express":
        return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)], 1.02
    raise ValueError(f"unknown Newton-Schulz kind {kind!r}")


def native_bf16_matmul(device: str | torch.device = "cpu") -> bool:
    """Whether torch's bfloat16 matmul on `device` runs a native kernel (not
    the CPU's plain loop): every non-CPU device; a CPU where torch sends bf16
    matmuls to oneDNN (the test torch itself makes)."""
    if torch.device(device).type != "cpu":
        return True
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is not None:
        return bool(probe())
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")  # older torch: a guess by ISA


def resolve_kernel(kernel: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> str:
    """The kernel Newton-Schulz runs: "native" or "fp32" (see the module
    docstring). float32 Newton-Schulz is always "native"."""
    if kernel not in NS_KERNELS:
        raise ConfigError(f"Newton-Schulz kernel {kernel!r} is not one of {NS_KERNELS}")
    if dtype != torch.bfloat16:
        return "native"
    if kernel == "auto":
        return "native" if native_bf16_matmul(device) else "fp32"
    return kernel


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """Round float32 values to bfloat16 (nearest even) and hold them in float32."""
    return t.to(torch.bfloat16).to(torch.float32)


def bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as torch's bfloat16 kernel computes it, through float32 kernels:
    a, b hold bfloat16 values in float32; returns round_bf16(sum_l a_il b_lj)
    held in float32 (summation order: sgemm's)."""
    return _bf16(a @ b)


def bf16_addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """torch.addmm(c, a, b, beta=beta, alpha=alpha) (baddbmm for stacks) as
    torch's bfloat16 kernel computes it: round_bf16(fma(beta, c, fl(alpha * dot)))
    with dot = the float32 sum of the exact products a_il b_lj. All inputs and
    the output hold bfloat16 values in float32."""
    dot = a @ b
    if alpha != 1.0:
        dot = dot * alpha
    return _bf16(torch.add(dot, c, alpha=beta))  # add's kernel: one fma(beta, c, dot)


def orthogonalise(g: torch.Tensor, kind: str, steps: int, dtype: torch.dtype,
                  kernel: str = "native") -> torch.Tensor:
    """Newton-Schulz on a matrix (rows, cols) or a stack of them (n, rows, cols);
    returns a tensor of `dtype` and g's shape. `kernel` ("native", "fp32" or
    "auto", resolved on g's device) matters for bfloat16 only."""
    schedule, safety = coefficient_schedule(kind, steps)
    kernel = resolve_kernel(kernel, dtype, g.device)
    stacked = g.ndim == 3
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True) if stacked else x.norm()
    if safety != 1.0:
        norm = norm * safety
    x = x / norm.clamp(min=EPS)
    if kernel == "fp32":
        x = x.to(torch.float32)  # bfloat16 values, float32 storage
        for a, b, c in schedule:
            gram = bf16_matmul(x, x.mT)
            update = bf16_addmm(gram, gram, gram, beta=b, alpha=c)
            x = bf16_addmm(x, update, x, beta=a)
        x = x.to(dtype)  # exact: every value is already a bfloat16
    else:
        for a, b, c in schedule:
            if stacked:
                gram = x @ x.mT
                update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
                x = torch.baddbmm(x, update, x, beta=a)
            else:
                gram = x @ x.T
                update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
                x = torch.addmm(x, update, x, beta=a)
    return x.mT if tall else x
