"""MixOptimizer: Muon for hidden weight matrices, AdamW for everything else.

Muon step for a hidden weight W with gradient G (Jordan et al. 2024,
https://kellerjordan.github.io/posts/muon/; torch.optim.Muon's order of
operations, so that on 2D weights the two step identically):

    M <- lerp(M, G, 1 - mu)                     # momentum buffer
    U = lerp(G, M, mu) if nesterov else M
    O = NewtonSchulz(U)                         # see newton_schulz.py (ns_kernel too)
    O <- NorMuon(O)                             # muon_variant="normuon" only
    W <- W * (1 - lr * wd) - lr * s(rows, cols) * O

The shape rule s (`muon_sf`): "original" = sqrt(max(1, rows / cols)) (Keller
Jordan); "match_rms_adamw" = 0.2 * sqrt(max(rows, cols)) (Liu et al., "Muon is
Scalable for LLM Training", arXiv:2502.16982), which makes Muon's update RMS
match AdamW's so both groups can share one learning rate.

NorMuon (Li et al. 2025, arXiv:2510.05491): a per-row (per output neuron)
second moment v <- lerp(v, mean_cols(O^2), 1 - beta2) rescales O row by row by
1/sqrt(v), then the whole update is scaled back to O's Frobenius norm.

A stacked 3D weight (n, rows, cols), such as the experts or the per-iteration
adapters, is n matrices: with colrow_3d=True each slice is orthogonalised on
its own (the shape rule reads the slice's rows and cols); with False the stack
is flattened to one (n*rows, cols) matrix.

Under FSDP2 a weight is a DTensor sharded by rows. Momentum and weight decay
are elementwise and run on the local shard; Newton-Schulz needs the whole
matrix, so the update is all-gathered, orthogonalised identically on every
rank, and each rank applies its own rows of the result.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dormouse.config import MUON_SHAPE_RULES, MUON_VARIANTS, NS_DTYPES, NS_KERNELS, NS_KINDS, OPTIMIZERS, STATE_DTYPES
from dormouse.errors import ConfigError
from dormouse.train.newton_schulz import orthogonalise, resolve_kernel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shape_factor(rule: str, rows: int, cols: int) -> float:
    """Muon's learning-rate multiplier for a rows x cols matrix."""
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ConfigError(f"muon_sf = {rule!r} is not one of {MUON_SHAPE_RULES}")


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


class MixOptimizer:
    """Muon + AdamW behind one step(), zero_grad(), state_dict() and
    load_state_dict(). Keyword arguments mirror TrainConfig's fields.

    All state is created up front and keyed by parameter name, so a checkpoint
    is a plain {name: {buffer: tensor}} dict: the same keys in every process,
    loadable by a fleet of another size (and sharded in place by
    torch.distributed.checkpoint under FSDP2).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 3e-3,
        wd: float = 0.0,
        opt: str = "mix",
        ns_steps: int = 5,
        ns_kind: str = "quintic",
        colrow_3d: bool = True,
        muon_state_dtype: str = "float32",
        ns_dtype: str = "bfloat16",
        ns_kernel: str = "auto",
        muon_variant: str = "muon",
        muon_sf: str = "match_rms_adamw",
        momentum: float = 0.95,
        nesterov: bool = True,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        normuon_beta2: float = 0.95,
    ):
        for name, value, allowed in (
            ("opt", opt, OPTIMIZERS), ("ns_kind", ns_kind, NS_KINDS),
            ("muon_variant", muon_variant, MUON_VARIANTS), ("muon_sf", muon_sf, MUON_SHAPE_RULES),
            ("muon_state_dtype", muon_state_dtype, STATE_DTYPES), ("ns_dtype", ns_dtype, NS_DTYPES),
            ("ns_kernel", ns_kernel, NS_KERNELS),
        ):
            if value not in allowed:
                raise ConfigError(f"MixOptimizer {name} = {value!r} is not one of {allowed}")
        self.lr, self.wd = lr, wd
        self.ns_steps, self.ns_kind, self.colrow_3d = ns_steps, ns_kind, colrow_3d
        self.state_dtype, self.ns_dtype = _DTYPES[muon_state_dtype], _DTYPES[ns_dtype]
        self.variant, self.shape_rule = muon_variant, muon_sf
        named = list(model.named_parameters())
        # The Newton-Schulz kernel, resolved once for the device the weights live on.
        self.ns_kernel = resolve_kernel(ns_kernel, self.ns_dtype, named[0][1].device if named else "cpu")
        self.momentum, self.nesterov, self.normuon_beta2 = momentum, nesterov, normuon_beta2
        self.betas, self.eps = betas, eps

        if opt == "mix":
            hidden = getattr(model, "hidden_matrices", None)
            # A model that names its hidden matrices knows best; otherwise
            # every parameter of two or more dimensions is one.
            muon_names = set(hidden()) if hidden else {n for n, p in named if p.ndim >= 2}
        else:
            muon_names = set()
        self.muon_params = [(n, p) for n, p in named if n in muon_names]
        self.adamw_params = [(n, p) for n, p in named if n not in muon_names]
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for n, p in self.muon_params:
            self.state[n] = {"momentum": torch.zeros_like(p, dtype=self.state_dtype)}
            if muon_variant == "normuon":
                self.state[n]["row_v"] = torch.zeros(*self._matrix_stack_shape(p.shape)[:-1], 1, device=p.device)
        for n, p in self.adamw_params:
            self.state[n] = {
                "step": torch.zeros((), dtype=torch.int64),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }

    # ---- the optimizer interface -------------------------------------------------

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def decay_lr(self) -> float:
        """The lr decoupled weight decay is scaled by, W <- W (1 - decay_lr * wd):
        the scheduled lr of this step (set_lr), as torch.optim.AdamW and Muon
        do. One place for both groups, so a test can plant a fault here (a
        subclass) and see the parity tests fail."""
        return self.lr

    def zero_grad(self) -> None:
        for _, p in self.muon_params + self.adamw_params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for name, p in self.muon_params:
            if p.grad is not None:  # a parameter with no gradient is skipped
                self._muon_step(self.state[name], p)
        for name, p in self.adamw_params:
            if p.grad is not None:
                self._adamw_step(self.state[name], p)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {n: dict(s) for n, s in self.state.items()}

    def load_state_dict(self, sd: dict[str, dict[str, torch.Tensor]]) -> None:
        """Copy a state_dict's tensors into this optimizer's (same names, shapes)."""
        if set(sd) != set(self.state):
            missing, extra = sorted(set(self.state) - set(sd)), sorted(set(sd) - set(self.state))
            raise ConfigError(
                f"optimizer state does not match this model: missing {missing[:3]}, "
                f"unexpected {extra[:3]} (was it saved with another model or opt?)"
            )
        for n, s in self.state.items():
            for k, t in s.items():
                src = sd[n].get(k)
                if src is None or tuple(src.shape) != tuple(t.shape):
                    raise ConfigError(f"optimizer state {n}.{k} has shape "
                                      f"{None if src is None else tuple(src.shape)}, expected {tuple(t.shape)}")
                if src is not t:
                    t.copy_(src)

    # ---- AdamW ---------------------------------------------------------------------

    def _adamw_step(self, state: dict, p: torch.Tensor) -> None:
        """torch.optim.AdamW's single-tensor step (Loshchilov & Hutter,
        arXiv:1711.05101), same operations in the same order. Norm gains and
        other vectors are not decayed: decay would pull gains towards 0."""
        beta1, beta2 = self.betas
        grad = p.grad
        if p.ndim >= 2:
            p.mul_(1 - self.decay_lr() * self.wd)
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["step"] += 1
        step = int(state["step"])
        step_size = self.lr / (1 - beta1**step)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(self.eps)
        p.addcdiv_(state["exp_avg"], denom, value=-step_size)

    # ---- Muon ----------------------------------------------------------------------

    def _muon_step(self, state: dict, p: torch.Tensor) -> None:
        grad = p.grad.to(self.state_dtype)
        buf = state["momentum"]
        buf.lerp_(grad, 1 - self.momentum)
        update = grad.lerp(buf, self.momentum) if self.nesterov else buf

        full = update.full_tensor() if _is_dtensor(update) else update  # FSDP: whole matrix
        stack_shape = self._matrix_stack_shape(full.shape)
        ortho = orthogonalise(full.reshape(stack_shape), self.ns_kind, self.ns_steps, self.ns_dtype,
                               self.ns_kernel)
        if self.variant == "normuon":
            ortho = self._normuon(state, ortho)
        ortho = ortho.view(full.shape)
        if _is_dtensor(p):
            from torch.distributed.tensor import DTensor, Replicate

            # Replicate -> Shard is a local slice: each rank keeps its own rows.
            ortho = DTensor.from_local(ortho, p.device_mesh, [Replicate()], run_check=False)
            ortho = ortho.redistribute(p.device_mesh, p.placements)
        rows, cols = stack_shape[-2:]
        p.mul_(1 - self.decay_lr() * self.wd)
        p.add_(ortho, alpha=-self.lr * shape_factor(self.shape_rule, rows, cols))

    def _matrix_stack_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """The matrix (rows, cols) or stack of matrices (n, rows, cols) that
        Newton-Schulz sees for a parameter of this shape."""
        if len(shape) == 2:
            return tuple(shape)
        if self.colrow_3d:
            return (math.prod(shape[:-2]), shape[-2], shape[-1])
        return (math.prod(shape[:-1]), shape[-1])

    def _normuon(self, state: dict, o: torch.Tensor) -> torch.Tensor:
        """Per-row second-moment normalisation, Frobenius norm preserved."""
        of = o.float()
        row_ms = of.square().mean(dim=-1, keepdim=True)  # (..., rows, 1)
        state["row_v"].lerp_(row_ms, 1 - self.normuon_beta2)
        scaled = of * state["row_v"].clamp_min(1e-10).rsqrt()
        dims = (-2, -1)
        ratio = of.norm(dim=dims, keepdim=True) / scaled.norm(dim=dims, keepdim=True).clamp_min(1e-10)
        return (scaled * ratio).to(o.dtype)
