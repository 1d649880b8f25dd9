"""make_reference: <out>/reference/ for a recording, by replay (full tensors at every step) or by
training the run itself in one process (sketches, or tensors every k-th step)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.gate import artifacts as A
from dormouse.gate.record import probe
from dormouse.gate.record.options import OBJECTIVES
from dormouse.gate.record.sketch import Sketcher
from dormouse.gate.record.userfns import import_path
from dormouse.train.tensors import copy_module
from dormouse.gate.record.reference.buffers import buffer_rule, load_params, updated_buffers
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference.forward import set_modes
from dormouse.gate.record.reference.gradients import probe_tensors, step_gradients
from dormouse.gate.record.reference.rebuild import build_optimizer, check_provenance, rebuild
from dormouse.gate.record.reference.replay import make_replayed, sketched, train_step
from dormouse.gate.record.reference.staleness import REFERENCE_SCHEMA, is_current, staleness_key


def make_reference(out, *, log=print, force: bool = False) -> Path:
    """Write <out>/reference/ for the recording in `out` (skipped when current)."""
    rec = A.RecordingSet(out)
    rec.validate()
    if not force and is_current(out):
        return A.reference_meta_path(out)
    check_provenance(rec)
    user = import_path(rec.meta["objective"], "objective") if rec.meta["objective"] not in OBJECTIVES else None
    for stale in A.reference_dir(out).glob("*.replay.safetensors"):  # another reference's replay: never read
        stale.unlink()
    model = rebuild(rec)
    set_modes(model, rec.eval_modules(rec.steps[0]) if rec.steps else [])
    replay = rec.sketch == 0 and rec.every == 1
    if replay:
        return make_replayed(out, rec, model, user, log)
    probe_model = copy_module(model) if replay else model
    opt, sched = build_optimizer(rec, model)
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    numel = {n: p.numel() for n, p in model.named_parameters()}
    sketcher = Sketcher(rec.sketch)
    scan = FW.scan(model)
    tensor_steps = set(rec.tensor_steps())
    mode = "replay" if replay else "run"
    nudged = None
    if not replay:  # the run's own floor: the same run from an initial state one ulp away
        nudged = copy_module(model)
        with torch.no_grad():
            for p in nudged.parameters():
                if p.is_floating_point():
                    p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
        nopt, nsched = build_optimizer(rec, nudged)
    rule, rule_text = buffer_rule(rec)
    rule = rule if replay else None  # the recorded buffers before every step: full tensors at every step
    log(f"reference for {out}: {len(rec.steps)} steps, mode {mode}")
    done: list[int] = []  # the tensor steps so far (their count picks fact 1's sample)
    for i, k in enumerate(rec.steps):
        tensors: dict[str, torch.Tensor] = {}
        lr = opt.param_groups[0]["lr"]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if replay:
            load_params(probe_model, rec.tensors_at(k, "p/"), rec.tensors_at(k, "b/"))
            gmodel = probe_model
        else:
            gmodel = model
        want = k in tensor_steps
        for m in (gmodel, nudged) if nudged is not None else (gmodel,):
            set_modes(m, rec.eval_modules(k))
        ref, info = step_gradients(gmodel, rec, k, user, examples=len(done) if want else None, probe=(i == 0))
        if probe.is_probe_step(rec, k) and (replay or i == 0):  # the probe's one-process side, at the
            # recorded parameters (a run's own reference parts from them after its first step): record/probe.py
            tensors.update(probe_tensors(gmodel, rec, k, user))
        if rule is not None:  # after the gradients: the rule may move the probe's buffers (reloaded each step)
            tensors.update({f"bu/{n}": v for n, v in updated_buffers(rule, rec.meta["buffer_update"], probe_model,
                                                                     rec, k).items()})
        done.extend([k] if want else [])
        if nudged is not None:
            nbefore = {n: p.detach().clone() for n, p in nudged.named_parameters()}
            nref, ninfo = step_gradients(nudged, rec, k, user, examples=None, probe=False)
            info["nudged_loss"] = ninfo["loss"]
            train_step(nudged, nopt, nsched, {n: v.float() for n, v in nref["g"].items()}, mgn, clipped=False)
            if want:
                ref = {**ref, "ng": nref["g"], "np": nbefore}
        info.update({"step": k, "replay_lr": lr, "mode": mode, **scan})
        if want:
            if rec.sketch:
                for key, d in (("rp", before), *ref.items()):
                    tensors.update({f"{key}/{n}": v for n, v in sketched(d, numel, rec.seed, sketcher).items()})
            else:
                tensors.update({f"rp/{n}": v for n, v in before.items()})
                for key, d in ref.items():
                    tensors.update({f"{key}/{n}": v for n, v in d.items()})
        # the step: recorded gradients (replay) or the declared objective's (run)
        if replay:
            grads = rec.tensors_at(k, "g/")
            clipped = rec.step_meta(0, k).get("clipped", False)
        else:
            grads = {n: v.float() for n, v in ref["g"].items()}
            clipped = False
        train_step(model, opt, sched, grads, mgn, clipped=clipped)
        atomic.write_bytes(A.reference_step_tensors_path(out, k), st_save({k2: v.contiguous() for k2, v in
                                                                           tensors.items()}))
        atomic.write_text(A.reference_step_meta_path(out, k), json.dumps(info, indent=1))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rec.sketch:
        final = sketched(final, numel, rec.seed, sketcher)
    atomic.write_bytes(A.reference_final_path(out), st_save({f"rp/{n}": v for n, v in final.items()}))
    meta = {"schema": REFERENCE_SCHEMA, "kind": "reference", "key": staleness_key(rec), "run": rec.run,
            "mode": mode, "steps": rec.steps, "scheduler": sched is not None,
            "buffer_rule": rule_text if rule is not None else None, **scan}
    return atomic.write_text(A.reference_meta_path(out), json.dumps(meta, indent=1))
