"""What the fleet's update is where the replay's is not: at the first update the replay does not give
bitwise, the user's optimizer is replayed once more up to that step, and from the state it holds
there each of a few alternatives is applied in turn, each compared with the recorded parameters
after the step:

  twice       the optimizer stepped twice on the step's gradients (an optimizer.step() with no
              backward between: the second on the same gradients), the scheduler once
  unclipped   (a declared max_grad_norm the loop did not report clipping by) the step on the
              unclipped gradient: the declared clip never applied

Each alternative's distance from the recorded parameters (0: bitwise) goes into that step's
reference JSON ("replay_alternatives"), with the gradient's global norm there; the judge names the
one that holds (facts/replay_causes.py). Run only where the replay's final parameters differ from
the recorded final ones (a clean run pays one read of them), and never across a resume.

Also the scheduler's lr at every step and beyond the last (schedule): the judge names a loop's lr that
is the scheduler's at another step (stepped twice a step, or once more on one rank)."""

from __future__ import annotations

import copy

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts.tensorfile import LazyTensors
from dormouse.gate.record.reference.rebuild import build_optimizer

SCHEDULE_AFTER = 8  # the scheduler's lrs kept beyond the last step: this many x the steps, plus as many


def schedule(rec: A.RecordingSet, model) -> list[float]:
    """The lr the user's scheduler gives at each step from the recording's first (the list's first), over
    its steps and SCHEDULE_AFTER x as many beyond, on a fresh optimizer of the model's (stepped without an
    optimizer step: its lr alone); shorter where the scheduler refuses to go further (OneCycleLR past its
    total, ReduceLROnPlateau without a metric); empty without a scheduler."""
    import warnings

    opt, sched = build_optimizer(rec, model)
    out = [float(opt.param_groups[0]["lr"])]
    if sched is None:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(min((SCHEDULE_AFTER + 1) * (len(rec.steps) + 1), 4096)):
            try:
                sched.step()
            except Exception:  # noqa: BLE001 - a scheduler that cannot go further ends the table
                break
            out.append(float(opt.param_groups[0]["lr"]))
    return out


def _distance(model, want: dict[str, torch.Tensor]) -> float:
    """0 where every parameter equals the recorded one bitwise, else the largest relative difference."""
    worst = 0.0
    for n, p in model.named_parameters():
        if n not in want:
            continue
        w = want[n]
        if p.shape != w.shape:
            return float("inf")
        a = p.detach().to(w.dtype)
        if torch.equal(a, w):
            continue
        d = float((a.double() - w.double()).norm() / max(float(w.double().norm()), 1e-30))
        worst = max(worst, d if d > 0 else 1e-300)
    return worst


def first_differing(out, rec: A.RecordingSet, model) -> int | None:
    """The first step whose update the replay does not give bitwise (its parameters after the step,
    written by the replay, against the recorded ones); None where the final ones agree."""
    if _distance(model, rec.final(A.PARAM)) == 0:
        return None
    steps = rec.steps
    for i, k in enumerate(steps):
        after = (LazyTensors([A.reference_replay_tensors_path(out, steps[i + 1])], "replay").prefixed(
            A.REPLAY_PARAM) if i + 1 < len(steps) else None)
        if after is None:
            return k
        want = rec.tensors_at(steps[i + 1], A.PARAM)
        if any(n in want and not torch.equal(v.to(want[n].dtype), want[n]) for n, v in after.items()):
            return k
    return None


def _set_grads(model, rec: A.RecordingSet, k: int, mgn: float, clip: bool) -> float:
    """Step k's recorded gradients on the model, clipped by mgn when `clip`; their global norm."""
    grads = rec.tensors_at(k, A.GRAD)
    for n, p in model.named_parameters():
        p.grad = grads[n].to(p.dtype, copy=True) if n in grads else None
    held = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in held])) if held else 0.0
    if clip and mgn > 0:
        torch.nn.utils.clip_grad_norm_(held, mgn)
    return norm


def alternatives(out, rec: A.RecordingSet, model, train_step) -> tuple[int, dict] | None:
    """(k, {"replay_alternatives": {name: distance}, "replay_grad_norm": the recorded gradient's global
    norm}) at the first step k whose update the replay does not give; None where there is none, or it
    lies at or after a resume (the resumed state is not the replay's), or the alternatives cannot be
    tried (a recording without its final parameters, an optimizer whose state cannot be copied in one
    process): they only name a cause, the replay's own verdict stands without them."""
    try:
        return _alternatives(out, rec, model, train_step)
    except Exception:  # noqa: BLE001 - naming is best effort; the replay check fails on its own figures
        return None


def _alternatives(out, rec: A.RecordingSet, model, train_step) -> tuple[int, dict] | None:
    k = first_differing(out, rec, model)
    if k is None:
        return None
    steps = rec.steps
    nxt = steps[steps.index(k) + 1] if k != steps[-1] else k
    if any(s <= nxt for s in rec.resumed_at()):
        return None
    mgn = float(rec.spec.max_grad_norm)
    clipped = bool(rec.step_meta(0, k).get("clipped", False))
    opt, sched = build_optimizer(rec, model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(rec.tensors_at(steps[0], A.PARAM)[n])
    for j in steps[:steps.index(k)]:
        train_step(model, opt, sched, rec.tensors_at(j, A.GRAD), mgn, clipped=rec.step_meta(0, j).get("clipped", False))
    want = rec.tensors_at(nxt, A.PARAM) if k != steps[-1] else rec.final(A.PARAM)
    saved = (copy.deepcopy(opt.state_dict()), {n: p.detach().clone() for n, p in model.named_parameters()})

    def restore():
        opt.load_state_dict(copy.deepcopy(saved[0]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[1][n])

    found, norm = {}, 0.0
    for name in ("twice", "unclipped"):
        if name == "unclipped" and (mgn <= 0 or clipped):
            continue
        restore()
        norm = _set_grads(model, rec, k, mgn, clip=(name != "unclipped" and not clipped))
        opt.step()
        if name == "twice":
            opt.step()
        found[name] = _distance(model, want)
    opt.zero_grad(set_to_none=True)
    del opt, sched, saved
    return k, {"replay_alternatives": found, "replay_grad_norm": norm}
