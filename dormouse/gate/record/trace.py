"""Per-step traces of a gate run: every step's expert choices and (optionally)
a snapshot of every tensor, so the verdict can say WHERE two runs part —
which step, which tensor, and whether a token's routing flipped first.

Stored as `<name>_trace.safetensors`:
    "topk"        (steps, B, T, max_iter, k) int16: the experts each of this
                  process's tokens chose at each iteration of each step
    "loads"       (steps, max_iter, E): the step's expert loads, summed over
                  the fleet (what moved the routing bias)
    "clip"        (steps,) float64: the clip coefficient each step applied
    "grad_norm"   (steps,) float32: the global gradient norm clipping computed
    "p/<tensor>"  (steps, *shape): the tensor after each step (snapshots on)
    "g/<tensor>"  (steps, *shape): the step's reduced gradient, before clipping
                  and the optimizer (snapshots on)

Beside it, a fleet asked to (GateSettings.recording) records the same run
through the public Recorder (record/dormouse_loop.py), the one format every
loop's recording has, judged by `dormouse gate check`. What only dormouse's
gate needs stays here: topk and loads (a routing flip explains where two runs
part; gradref's loads drive the replay's routing bias), the clip series, and
the p/ g/ snapshots that gradref and the replay of modes.py still read (not
yet the recording's).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.gate.artifacts import trace_path
from dormouse.train.tensors import named_grads, named_state


class Trace:
    """The loop's on_step callback. Under FSDP every rank must record (the
    snapshot gathers, a collective), even if only rank 0 keeps the tensors."""

    def __init__(self, *, snapshots: bool, gather: bool = False, topk: bool = True):
        self.snapshots, self.gather, self.keep_topk = snapshots, gather, topk
        self.topk: list[torch.Tensor] = []
        self.loads: list[torch.Tensor] = []
        self.params: dict[str, list[torch.Tensor]] = {}
        self.grads: dict[str, list[torch.Tensor]] = {}
        self.clip: list[float] = []
        self.norm: list[float] = []

    def record_grads(self, step: int, model) -> None:
        """The loop's on_grads callback: the reduced gradient before clipping."""
        if self.snapshots or self.gather:
            grads = named_grads(model, gather=self.gather)
            if self.snapshots:
                for name, g in grads.items():
                    self.grads.setdefault(name, []).append(g.clone())

    def __call__(self, step: int, model, info: dict) -> None:
        slices = [torch.stack(per_it, dim=2) for per_it in info["topk"] if per_it]  # each (B, T, I, k)
        if slices:
            if self.keep_topk:
                self.topk.append(torch.cat(slices, dim=0).to(torch.int16))  # this process's tokens in order
            self.loads.append(info["loads"].detach().float().cpu())  # (I, E), summed over the fleet
        self.clip.append(float(info.get("clip_coef", 1.0)))
        if info.get("grad_norm") is not None:
            self.norm.append(info["grad_norm"])
        if self.snapshots or self.gather:
            state = named_state(model, gather=self.gather)
            if self.snapshots:
                for name, t in state.items():
                    self.params.setdefault(name, []).append(t.clone())

    def extend(self, earlier: dict[str, torch.Tensor]) -> None:
        """Start from an earlier leg's saved trace (a run stopped and resumed):
        its per-step series come first."""
        for k, v in earlier.items():
            if k.startswith("p/"):
                self.params.setdefault(k[2:], []).extend(v.unbind(0))
            elif k.startswith("g/"):
                self.grads.setdefault(k[2:], []).extend(v.unbind(0))
        self.loads.extend(earlier["loads"].unbind(0) if "loads" in earlier else [])
        self.clip.extend(earlier["clip"].tolist() if "clip" in earlier else [])
        self.norm.extend(earlier["grad_norm"].tolist() if "grad_norm" in earlier else [])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"p/{n}": torch.stack(ts) for n, ts in self.params.items()}
        out.update({f"g/{n}": torch.stack(ts) for n, ts in self.grads.items()})
        if self.clip:
            out["clip"] = torch.tensor(self.clip, dtype=torch.float64)
        if self.norm:
            out["grad_norm"] = torch.tensor(self.norm, dtype=torch.float32)  # exactly the float32 norms
        if self.topk:
            out["topk"] = torch.stack(self.topk)
        if self.loads:
            out["loads"] = torch.stack(self.loads)
        return out

    def save(self, out: Path, name: str) -> Path:
        return atomic.write_bytes(trace_path(out, name), st_save(self.tensors()))
