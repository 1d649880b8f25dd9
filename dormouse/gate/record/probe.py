"""The probe: where a parallel run parts from one process, module by module.

At a probe step (RecordingSpec(probe_steps=[...]); by default the first recorded
step) the Recorder records, for the step's FIRST micro-batch on every rank,
every submodule's forward output (a forward hook, after the module's own and
its parallel style's hooks: what the next module receives) and the gradient
flowing into that output in the backward (a tensor hook on it), in the order
the forward ran them ("probe_order") and the order the gradients arrived
("probe_grad_order"). A DTensor output (or gradient) is assembled with
full_tensor() at rec.step, every rank in one order; a plain tensor is stored
as this rank has it (under sequence parallelism a local sequence shard: the
judge concatenates a TP group's pieces where their shape says so). Tuple
outputs: their first tensor.

The reference (reference_probe) computes the same on the unparallelised model
from build_model at the recorded parameters of the probe step, for each DP
replica leader's first micro-batch, backpropagating that micro-batch's
declared loss_sum (the fleet's loop scales its loss its own way: the judge
fits that scale on the model's own output gradient), and measures each
module's floor: the same forward and backward from parameters one ulp away
(layout's PROBE_NUDGED_OUTPUT, PROBE_NUDGED_GRAD)."""

from __future__ import annotations

import math

import torch

from dormouse.gate import artifacts as A

PREFIXES = (A.PROBE_OUTPUT, A.PROBE_GRAD)


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if hasattr(out, "logits") and isinstance(out.logits, torch.Tensor):
        return out.logits
    return None


class Probe:
    """Forward hooks on every submodule of `module` (and the module itself,
    named "(model)"), active only while `armed`: the first training forward
    after arm() and the backward through it."""

    def __init__(self, module):
        self.armed = False
        self.outs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.grad_order: list[str] = []
        self._hooks = [m.register_forward_hook(self._hook(n or "(model)")) for n, m in module.named_modules()]

    def _hook(self, name: str):
        def hook(module, args, out):
            if not self.armed or not module.training or not torch.is_grad_enabled():
                return None
            t = _first_tensor(out)
            if t is None or not t.is_floating_point() or name in self.outs:
                return None
            self.outs[name] = t.detach().clone()  # a copy: FSDP2 frees storage an output may share
            self.order.append(name)
            if t.requires_grad:
                def on_grad(g, name=name):
                    if g is not None and name not in self.grads:  # None: no gradient reaches this output
                        self.grads[name] = g.detach().clone()
                        self.grad_order.append(name)
                    return None
                try:
                    t.register_hook(on_grad)
                except RuntimeError:  # a tensor that takes no hook: its gradient is not probed (the run goes on)
                    pass
            return None
        return hook

    def arm(self) -> None:
        self.outs, self.grads, self.order, self.grad_order = {}, {}, [], []
        self.armed = True

    def disarm_forward(self) -> None:
        """After the probed micro-batch's forward: later forwards are not recorded (their gradients are
        not either: the tensor hooks sit on the first micro-batch's outputs alone)."""
        self.armed = False

    def take(self, full, gather=None) -> tuple[dict[str, torch.Tensor], dict]:
        """The recorded tensors (A.PROBE_OUTPUT + NAME, A.PROBE_GRAD + NAME), each assembled by `full` in one order on every
        rank (sorted names: full_tensor() is a collective), and the step JSON's probe entry. With
        `gather` (every rank's object: a collective), only the names every rank holds are assembled,
        so that no rank waits in a collective another never enters."""
        tensors = {}
        for prefix, d in ((A.PROBE_OUTPUT, self.outs), (A.PROBE_GRAD, self.grads)):
            names = set(d)
            if gather is not None:
                for other in gather(sorted(names)):
                    names &= set(other)
            for n in sorted(names):
                tensors[prefix + n] = full(d[n])
        meta = {"probe_order": list(self.order), "probe_grad_order": list(self.grad_order)}
        self.outs, self.grads = {}, {}
        return tensors, meta

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def capture(model, fn):
    """Run fn() (a forward and backward of `model`) with every submodule's
    output and output gradient captured: (outputs, gradients, order)."""
    p = Probe(model)
    p.arm()
    try:
        fn()
    finally:
        p.armed = False
        p.remove()
    return dict(p.outs), dict(p.grads), list(p.order)


def reference_probe(model, batch: dict, loss_sum) -> dict[str, torch.Tensor]:
    """The plain model's module outputs and output gradients on one micro-batch
    (loss_sum(model, batch) -> that micro-batch's declared loss sum), and the
    same from parameters one ulp away: A.PROBE_REF_OUTPUT, PROBE_REF_GRAD, PROBE_NUDGED_OUTPUT,
    PROBE_NUDGED_GRAD + NAME."""
    from dormouse.train.tensors import copy_module

    out: dict[str, torch.Tensor] = {}
    for (out_at, grad_at), m in (((A.PROBE_REF_OUTPUT, A.PROBE_REF_GRAD), model),
                                  ((A.PROBE_NUDGED_OUTPUT, A.PROBE_NUDGED_GRAD), None)):
        if m is None:
            m = copy_module(model)  # deepcopy, past a graph tensor the forward left on a module
            with torch.no_grad():
                for p in m.parameters():
                    if p.is_floating_point():
                        p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
        m.zero_grad(set_to_none=True)
        outs, grads, _ = capture(m, lambda m=m: loss_sum(m, batch).backward())
        m.zero_grad(set_to_none=True)
        out.update({out_at + n: v.clone() for n, v in outs.items()})
        out.update({grad_at + n: v.clone() for n, v in grads.items()})
    return out


def is_probe_step(rec, k: int) -> bool:
    """Whether the recording probed step k (rank 0's step JSON says so)."""
    return rec.step_meta(0, k).get("probe_order") is not None
