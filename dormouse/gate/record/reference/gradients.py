"""One step's reference gradients: the declared objective's over every rank's micro-batches, its
alternatives (the weightings the famous bugs compute), fact 1's per-example sums, the merged
forward, the precision floor (spilled.py; objective_scope="step": stepscope.py), and the probe's
one-process side."""

from __future__ import annotations

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record import probe
from dormouse.gate.record.reference.error import ReferenceError
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import objective as O
from dormouse.gate.record.reference.objective import objective_sum
from dormouse.gate.record.reference.sample import ExtrasBudget
from dormouse.gate.record.reference.spill import Spill, StepParts
from dormouse.gate.record.reference.spilled import spilled_gradients
from dormouse.gate.record.reference.stepscope import step_scope_gradients


def step_gradients(model, rec: A.RecordingSet, step: int, user, *, examples: int | ExtrasBudget | None,
                   probe: bool, normalised=True) -> tuple[dict, dict]:
    """The declared objective's gradient over every rank's micro-batches at
    the model's current parameters, with its alternatives and fact 1's
    per-example sum over example_sample(., examples) (None: no per-example
    check; see the package docstring), in memory."""
    parts, info = step_gradient_parts(model, rec, step, user, examples=examples, probe=probe, normalised=normalised)
    return (parts.tensors() if isinstance(parts, StepParts) else parts), info


def _no_forward_info(names: list[str], rec: A.RecordingSet) -> dict:
    """The info of a step at which the loop called the optimizer with no forward or backward at all (no
    rank recorded a micro-batch or a gradient): one process computes no gradient either (every parameter
    without one); the replay steps the user's optimizer on that, as the loop did (pytorch #115607's
    Adam step counter lives there)."""
    mgn = float(rec.spec.max_grad_norm)
    return {"loss": None, "loss_sum": 0.0, "count": 0.0, "no_forward": True,
            "loss_alt": {"micro_mean": None, "rank_mean": None, "rank_local": []}, "counts": [],
            "no_grad": list(names), "norm": 0.0, "rng_sensitive": None, "precision_floor": None,
            "precision_floor_tensors": None, "low_precision_params": [], "loss_floor": None, "ex_micro": [],
            "merged": None, "labels": None, "router_aux": None, "clip_coef": 1.0 if mgn > 0 else None}


def step_gradient_parts(model, rec: A.RecordingSet, step: int, user, *, examples: int | ExtrasBudget | None,
                        probe: bool, alt_dtype: torch.dtype = torch.float64, normalised=True):
    """step_gradients' (outputs, info), the outputs a StepParts that writes
    them tensor by tensor (or a plain dict for objective_scope="step").
    alt_dtype: the dtype the alternatives that only name causes are written in.
    examples: an ExtrasBudget takes or skips the step's rows alone and merged (sample.py).
    normalised: whether to make "gn" (the normalised form): True, False, or
    fn(rec, step, info, g) -> bool, asked once g is made (normalised.py); a
    step the budget takes gets it then too (independence's float32 spread)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # reduced-precision parameters (a bfloat16 model): their gradients round as autocast's do
    lowp = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                   if p.dtype in (torch.bfloat16, torch.float16)})
    mbs = BS.forward_inputs(rec, step)  # each micro-batch with the non-tensor arguments its forward got
    if not mbs:
        if not any(rec.step_meta(r, k).get("micro_batches") for k in rec.steps for r in range(rec.world_at(k))):
            raise ReferenceError(f"step {step} recorded no micro-batch: the model's forward never ran in training "
                                 "mode between two rec.step() calls, at any step (is the Recorder on the model the "
                                 "loop calls?)")
        # an optimizer step with no forward or backward (legal: pytorch #115607's Adam step counter lives there):
        # one process computes no gradient; whatever gradient the fleet holds is judged against that
        return {}, _no_forward_info(names, rec)
    if rec.spec.objective_scope == "step":  # fn(model, batches) over the whole step, once
        return step_scope_gradients(model, rec, step, user, mbs, probe=probe, lowp=lowp, alts=examples is not None)
    spill = Spill(model, A.reference_scratch_step_dir(rec.out, step))
    try:
        return spilled_gradients(model, rec, step, user, mbs, spill, examples=examples, normalised=normalised,
                                 probe=probe, lowp=lowp, names=names, shapes=shapes, alt_dtype=alt_dtype)
    except BaseException:
        spill.close()
        raise


def probe_tensors(model, rec, k: int, user) -> dict[str, torch.Tensor]:
    """reference_probe on every DP replica leader's (every rank with micro-batches) first micro-batch
    of step k, at the model's current parameters: {"probe/RANK/" + the reference_probe names}."""
    objective = rec.spec.objective
    out: dict[str, torch.Tensor] = {}
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
        return out  # reduced precision: the probe's floors are float32's (the judge says it did not probe)
    if rec.spec.objective_scope == "step":
        return out  # an objective over the whole step: no one micro-batch's gradient is the fleet's alone
    mbs = BS.forward_inputs(rec, k)
    aw = O.aux_weight(objective, model, mbs)
    for r, m, batch in mbs:  # with the non-tensor arguments the forward got
        if m != 0 or rec.autocast(r, k, m) is not None or rec.compute_dtype(r, k, m) is not None:
            continue
        undo = FW.attrs(model, rec, r, k, m)  # the plain attributes this forward ran with
        try:
            torch.random.default_generator.manual_seed(0)
            got = probe.reference_probe(model, batch,
                                        lambda mm, b: objective_sum(objective, mm, b, user, aux_weight=aw)[0])
        finally:
            undo()
        out.update({A.probe_prefix(r) + n: v for n, v in got.items()})
    return out
