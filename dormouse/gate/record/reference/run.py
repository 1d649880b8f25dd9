"""Run (sketches, or tensors every k-th step): the recorded gradients are not
all there to replay, so the reference trains the run itself in one process on
the declared objective over the recorded micro-batches, clipping by the global
norm, and writes (sketches of) its parameters and gradients at the recorded
steps; beside it the same run from an initial state one ulp away ("np/",
"ng/", "nudged_loss"): how far float32 round-off alone carries a run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.gate import artifacts as A
from dormouse.gate.record import probe
from dormouse.gate.record.sketch import Sketcher
from dormouse.train.tensors import copy_module
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference.forward import set_modes
from dormouse.gate.record.reference.gradients import probe_tensors, step_gradients
from dormouse.gate.record.reference.rebuild import build_optimizer
from dormouse.gate.record.reference.replay import sketched, train_step
from dormouse.gate.record.reference.sample import ExtrasBudget
from dormouse.gate.record.reference.staleness import REFERENCE_SCHEMA, staleness_key


def make_run(out, rec: A.RecordingSet, model, user, log, normalised=True) -> Path:
    """The reference of a recording in sketches or at every k-th step: the run trained in one process, its
    nudged twin beside it, each step's (sketched) tensors and figures written as the judge reads them."""
    opt, sched = build_optimizer(rec, model)
    mgn = float(rec.spec.max_grad_norm)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    sketcher = Sketcher(rec.sketch)
    scan = FW.scan(model)
    tensor_steps = set(rec.tensor_steps())
    nudged = _nudged(model)  # the run's own floor: the same run from an initial state one ulp away
    nopt, nsched = build_optimizer(rec, nudged)
    log(f"reference for {out}: {len(rec.steps)} steps, mode run")
    budget = ExtrasBudget()  # the tensor steps that get the rows alone and merged (and fact 1's sample)
    for i, k in enumerate(rec.steps):
        tensors: dict[str, torch.Tensor] = {}
        lr = opt.param_groups[0]["lr"]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        want = k in tensor_steps
        for m in (model, nudged):
            set_modes(m, rec.eval_modules(k))
        ref, info = step_gradients(model, rec, k, user, examples=budget if want else None, probe=(i == 0),
                                   normalised=normalised)
        if probe.is_probe_step(rec, k) and i == 0:  # the probe's one-process side, at the recorded parameters
            # (the run's own reference parts from them after its first step): record/probe.py
            tensors.update(probe_tensors(model, rec, k, user))
        nref, nbefore, info["nudged_loss"] = _nudged_step(nudged, nopt, nsched, rec, k, user, mgn)
        if want:
            ref = {**ref, A.NUDGED_GRAD: nref[A.GRAD], A.NUDGED_PARAM: nbefore}
        info.update({"step": k, "replay_lr": lr, "mode": "run", **scan})
        if want:
            tensors.update(_step_tensors(rec, before, ref, numel, sketcher))
        # the step: the declared objective's gradients
        train_step(model, opt, sched, {n: v.float() for n, v in ref[A.GRAD].items()}, mgn, clipped=False)
        atomic.write_bytes(A.reference_step_tensors_path(out, k), st_save({k2: v.contiguous() for k2, v in
                                                                           tensors.items()}))
        atomic.write_text(A.reference_step_meta_path(out, k), json.dumps(info, indent=1))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rec.sketch:
        final = sketched(final, numel, rec.seed, sketcher)
    atomic.write_bytes(A.reference_final_path(out), st_save({A.REPLAY_PARAM + n: v for n, v in final.items()}))
    meta = {"schema": REFERENCE_SCHEMA, "kind": "reference", "key": staleness_key(rec), "run": rec.run,
            "mode": "run", "steps": rec.steps, "scheduler": sched is not None, "buffer_rule": None, **scan}
    return atomic.write_text(A.reference_meta_path(out), json.dumps(meta, indent=1))


def _nudged(model):
    """A copy of the model one ulp away (every floating parameter moved to the next float up)."""
    nudged = copy_module(model)
    with torch.no_grad():
        for p in nudged.parameters():
            if p.is_floating_point():
                p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
    return nudged


def _nudged_step(nudged, nopt, nsched, rec: A.RecordingSet, k: int, user, mgn: float):
    """The nudged run's step k: its gradient (no alternatives), its parameters before, its loss; then trained."""
    nbefore = {n: p.detach().clone() for n, p in nudged.named_parameters()}
    nref, ninfo = step_gradients(nudged, rec, k, user, examples=None, probe=False, normalised=False)  # its g only
    train_step(nudged, nopt, nsched, {n: v.float() for n, v in nref[A.GRAD].items()}, mgn, clipped=False)
    return nref, nbefore, ninfo["loss"]


def _step_tensors(rec: A.RecordingSet, before: dict, ref: dict, numel: dict, sketcher: Sketcher) -> dict:
    """A tensor step's written tensors: the parameters before it ("rp/") and every reference output, sketched
    where the recording is."""
    tensors: dict[str, torch.Tensor] = {}
    if rec.sketch:
        for key, d in ((A.REPLAY_PARAM, before), *ref.items()):
            tensors.update({key + n: v for n, v in sketched(d, numel, rec.seed, sketcher).items()})
    else:
        tensors.update({A.REPLAY_PARAM + n: v for n, v in before.items()})
        for key, d in ref.items():
            tensors.update({key + n: v for n, v in d.items()})
    return tensors
