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
"""

from __future__ import annotations

import torch

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


def orthogonalise(g: torch.Tensor, kind: str, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz on a matrix (rows, cols) or a stack of them (n, rows, cols);
    returns a tensor of `dtype` and g's shape."""
    schedule, safety = coefficient_schedule(kind, steps)
    stacked = g.ndim == 3
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True) if stacked else x.norm()
    if safety != 1.0:
        norm = norm * safety
    x = x / norm.clamp(min=EPS)
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
