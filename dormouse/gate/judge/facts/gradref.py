"""Fact 3 for dormouse's own fleet: the hand-computed token-weighted gradient.

The gate's own fleet (trace format, judged by entry.judge until the fleet's recording replaces it):

gradref    fact 3: at every step the fleet's reduced gradient equals the
           hand-computed token-weighted gradient over bytes gradref read
           itself (GRAD_RTOL; bf16 wire: the elementwise rounding bound), and
           the expert loads the fleet applied equal the ones gradref counted.
"""

from __future__ import annotations

import torch

from dormouse.gate.artifacts import ArtifactSet
from dormouse.gate.judge.bounds import BF16_UNIT_ROUNDOFF, arithmetic_rtol
from dormouse.gate.judge.facts.series import per_step_tensor, series_names, world_at
from dormouse.gate.judge.verdict import Check, TensorCheck


def check_gradref(a: ArtifactSet) -> Check:
    fleet, g = a.trace("rank0"), a.tensors("gradref")
    meta = a.meta("rank0")
    names = series_names(g, "g/")
    if fleet is None or not all(f"g/{n}" in fleet for n in names):
        return TensorCheck("gradref", False, "the fleet recorded no per-step gradients (rank0 trace)")
    steps_f, steps_g = len(fleet[f"g/{names[0]}"]), len(g[f"g/{names[0]}"])
    if steps_f != steps_g:
        return TensorCheck("gradref", False, f"gradref covers {steps_g} steps, the fleet ran {steps_f}: re-run gradref")
    fg = {n: fleet[f"g/{n}"] for n in names}
    gg = {n: g[f"g/{n}"] for n in names}
    wire = meta["settings"].get("reduce", "fp32")
    rtol = arithmetic_rtol(a.meta("gradref").get("config", {}))
    if wire == "bf16":
        def bound(n, k):  # elementwise W u sum|t g|/T, as a ratio of the scale max|g|
            scale = gg[n][k].abs().max().item() or 1.0
            return (world_at(meta, k) * BF16_UNIT_ROUNDOFF * g[f"a/{n}"][k].abs().max().item()) / scale + rtol
    else:
        def bound(n, k):
            return rtol
    c = per_step_tensor("gradref", fg, gg, names, bound,
                         what="the fleet's reduced gradient against the hand-computed token-weighted gradient")
    if c.passed and all(f"a/{n}" in g for n in names):
        if a.meta("gradref").get("config", {}).get("model", {}).get("bf16"):
            c.reason += ("; exact zeros not checked (a bfloat16 model: a window's gradient can round to an "
                         "exact zero where the fleet's batched one does not)")
        else:
            _check_structural_zeros(c, fg, {n: g[f"a/{n}"] for n in names}, names)
    if c.passed and "loads" in g and "loads" in fleet:
        diff = [k + 1 for k in range(min(len(g["loads"]), len(fleet["loads"])))
                if not torch.equal(g["loads"][k], fleet["loads"][k])]
        if diff:
            c.passed, c.first_step = False, diff[0]
            c.reason = (f"the expert loads the fleet applied differ from those counted over every rank's "
                        f"tokens at step {diff[0]} (the routing bias moved by other loads)")
        else:
            c.reason += "; expert loads equal at every step"
    return c



def _check_structural_zeros(c: TensorCheck, fleet: dict, absref: dict, names: list[str]) -> None:
    """Exactly, beside the relative bound: wherever every window's gradient is
    exactly zero (gradref's sum of |t g| over the windows is 0: an embedding
    row of a byte the step never read, LoRA A while B is 0, an expert no
    token chose), the fleet's reduced gradient must be exactly zero too, since
    any reduce of zeros, in any order, at any width, gives zero. In float32
    arithmetic only: in a clean bfloat16-model fleet 2 elements of
    embed.weight were exactly zero in every window's gradient at step 1 and
    not in the fleet's batched one (bfloat16 rounding; the mechanism not
    pinned down), so a bfloat16 model is not held to it. The relative
    bound is scaled by the tensor's largest element and lets a small made-up
    value through there, and Adam turns any nonzero into a step of ~lr (a
    review's fleet that filled zeros with 4e-6 max|g| sign(p) passed under
    mixed window lengths, where no curve applies). Fails `c` at the first
    step and tensor where it does not hold."""
    zeros = 0
    for k in range(len(fleet[names[0]])):
        for n in names:
            mask = absref[n][k] == 0
            stray = int((fleet[n][k][mask] != 0).sum())
            if stray:
                c.passed, c.first_step = False, k + 1
                c.reason = (f"the fleet's reduced gradient is nonzero at {stray} element(s) of {n} at step {k + 1} "
                            f"where every window's gradient is exactly zero (nothing there to reduce: the fleet "
                            f"made gradient up)")
                return
            zeros += int(mask.sum())
    c.reason += f"; exactly zero wherever every window's gradient is ({zeros} element-steps)"
