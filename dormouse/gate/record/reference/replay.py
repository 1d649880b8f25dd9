"""Replay (full tensors at every step): the user's optimizer on the recorded gradients from the
initial state, then each step's gradients at its recorded parameters."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dormouse import atomic
from dormouse.gate import artifacts as A
from dormouse.gate.record import probe
from dormouse.gate.record.sketch import Sketcher, sketch_buckets
from dormouse.gate.record.reference.buffers import buffer_rule, load_params, updated_buffers
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import replay_alternatives as RA
from dormouse.gate.record.reference.forward import set_modes
from dormouse.gate.record.reference.gradients import probe_tensors, step_gradient_parts
from dormouse.gate.record.reference.rebuild import build_optimizer
from dormouse.gate.record.reference.sample import ExtrasBudget
from dormouse.gate.record.reference.spill import StepParts
from dormouse.gate.record.reference.staleness import REFERENCE_SCHEMA, staleness_key


def sketched(tensors: dict[str, torch.Tensor], numel: dict[str, int], seed: int, sketcher: Sketcher):
    for n in tensors:
        if n not in sketcher.buckets:
            sketcher.buckets[n] = sketch_buckets(n, numel[n], sketcher.k, seed)
    return sketcher(tensors)


def train_step(model, opt, sched, grads: dict, mgn: float, *, clipped: bool) -> None:
    """One optimizer step on the given gradients (None where absent), clipped
    by the global norm max_grad_norm unless they already were."""
    for n, p in model.named_parameters():  # each taken out of `grads` as it is copied (read lazily: one at a time)
        p.grad = grads.pop(n).to(p.dtype, copy=True) if n in grads else None
    if mgn > 0 and not clipped:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], mgn)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad()  # (torch's default sets to None; an optimizer of one's own may take no argument)


def _trim() -> None:
    """The heap's freed memory back to the system between steps (glibc's malloc_trim; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _write_params(path: Path, model, prefix: str) -> None:
    """The model's parameters as they stand, "prefix + name", written straight from them (no copy)."""
    from dormouse.gate.artifacts.tensorfile import write_streamed

    held = [(prefix + n, p.detach()) for n, p in model.named_parameters()]
    write_streamed(path, [(k, v.dtype, tuple(v.shape)) for k, v in held], iter(held), sync=False)  # see spill.py


def replay_params(out, rec: A.RecordingSet, model) -> tuple[dict, bool]:
    """The replay: the user's optimizer (and scheduler) on the recorded gradients from the model's
    state, the parameters before each step and after the last written as they stand (their own
    files); the optimizer's state freed after. ({step: its learning rate}, whether it is scheduled)."""
    opt, sched = build_optimizer(rec, model)
    mgn = float(rec.spec.max_grad_norm)
    lrs = {}
    for k in rec.steps:
        lrs[k] = opt.param_groups[0]["lr"]
        _write_params(A.reference_replay_tensors_path(out, k), model, A.REPLAY_PARAM)
        train_step(model, opt, sched, rec.tensors_at(k, A.GRAD), mgn, clipped=rec.step_meta(0, k).get("clipped", False))
    _write_params(A.reference_final_path(out), model, A.REPLAY_PARAM)
    scheduled = sched is not None
    del opt, sched  # the optimizer's state: not held through the gradients' pass
    _trim()
    return lrs, scheduled


def make_replayed(out, rec: A.RecordingSet, model, user, log, normalised=True) -> Path:
    """The reference of a recording in full tensors at every step, in two
    passes over one model, so that its memory is one model, its gradient and
    the optimizer's state (never two models, never a step's alternatives in
    memory): first the replay (the user's optimizer on the recorded
    gradients, from the initial state; the parameters before each step
    written as they stand, "rp/", to their own file), then, the optimizer
    freed, the gradients at each step's recorded parameters
    (step_gradient_parts: spilled micro-batch by micro-batch, combined tensor
    by tensor into the step's file; the alternatives that only name causes in
    float32), the probe and the buffer rule beside them. The rows alone and
    merged at the steps an ExtrasBudget takes (sample.py); "gn" as
    `normalised` says (gradients.step_gradient_parts); a callable `normalised`
    (`gate check`'s first pass) also defers the module probe."""
    from dormouse.gate.artifacts.tensorfile import write_streamed

    scan = FW.scan(model)
    tensor_steps = set(rec.tensor_steps())
    rule, rule_text = buffer_rule(rec)
    log(f"reference for {out}: {len(rec.steps)} steps, mode replay")
    lrs, scheduled = replay_params(out, rec, model)
    differs = RA.alternatives(out, rec, model, train_step)  # (step, what its update is) where the replay's is not
    budget = ExtrasBudget()  # the tensor steps that get the rows alone and merged (and fact 1's sample)
    # the module probe (four forwards and backwards a replica) only localises a failure: `gate check` (a callable
    # `normalised`) defers it, and makes the reference again with it where a check fails (pipeline.check_recording)
    deferred = False
    for i, k in enumerate(rec.steps):  # the gradients, at the recorded parameters
        load_params(model, rec.tensors_at(k, A.PARAM), rec.tensors_at(k, A.BUFFER))
        set_modes(model, rec.eval_modules(k))
        want = k in tensor_steps
        parts, info = step_gradient_parts(model, rec, k, user, examples=budget if want else None,
                                          probe=(i == 0), alt_dtype=torch.float32, normalised=normalised)
        extra: dict[str, torch.Tensor] = {}
        deferred = deferred or (probe.is_probe_step(rec, k) and callable(normalised))
        if probe.is_probe_step(rec, k) and not callable(normalised):  # its one-process side, at the recorded
            extra.update(probe_tensors(model, rec, k, user))  # parameters (deferred by `gate check`: below)
        if rule is not None:  # after the gradients: the rule may move the buffers (reloaded each step)
            extra.update({A.BUFFER_AFTER + n: v for n, v in updated_buffers(rule, rec.spec.buffer_update, model,
                                                                   rec, k).items()})
        info.update({"step": k, "replay_lr": lrs[k], "mode": "replay", **scan, **(differs[1] if differs and
                                                                                 differs[0] == k else {})})
        path = A.reference_step_tensors_path(out, k)
        if not want:
            if isinstance(parts, StepParts):
                parts.spill.close()
            parts = {}
        if isinstance(parts, StepParts):
            parts.write(path, extra)
        else:
            held = [(key + n, v) for key, d in parts.items() for n, v in d.items()] + list(extra.items())
            write_streamed(path, [(key, v.dtype, tuple(v.shape)) for key, v in held], iter(held), sync=False)
        atomic.write_text(A.reference_step_meta_path(out, k), json.dumps(info, indent=1))
        _trim()
    meta = {"schema": REFERENCE_SCHEMA, "kind": "reference", "key": staleness_key(rec), "run": rec.run,
            "mode": "replay", "steps": rec.steps, "scheduler": scheduled,
            "buffer_rule": rule_text if rule is not None else None, "schedule_lr": RA.schedule(rec, model),
            "probe_deferred": deferred, **scan}
    return atomic.write_text(A.reference_meta_path(out), json.dumps(meta, indent=1))
