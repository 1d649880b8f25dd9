"""One step's reference gradients: the declared objective's over every rank's micro-batches, its
alternatives (the weightings the famous bugs compute), fact 1's per-example sums, the merged
forward, the precision floor, and the probe's one-process side."""

from __future__ import annotations

import json
import math

import torch

from dormouse.clip import clip_coef
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record import probe
from dormouse.gate.record import routeraux
from dormouse.gate.record.options import OBJECTIVES
from dormouse.train.tensors import copy_module
from dormouse.gate.record.reference.error import ReferenceError
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import objective as O
from dormouse.gate.record.reference.objective import objective_count, objective_of_logits, objective_sum
from dormouse.gate.record.reference.spill import Spill, StepParts
from dormouse.gate.record.reference.stepscope import step_scope_gradients


def step_gradients(model, rec: A.RecordingSet, step: int, user, *, examples: int | None,
                   probe: bool) -> tuple[dict, dict]:
    """The declared objective's gradient over every rank's micro-batches at
    the model's current parameters, with its alternatives and fact 1's
    per-example sum over example_sample(., examples) (None: no per-example
    check; see the module docstring), in memory."""
    parts, info = step_gradient_parts(model, rec, step, user, examples=examples, probe=probe)
    return (parts.tensors() if isinstance(parts, StepParts) else parts), info


def _no_forward_info(names: list[str], rec: A.RecordingSet) -> dict:
    """The info of a step at which the loop called the optimizer with no forward or backward at all (no
    rank recorded a micro-batch or a gradient): one process computes no gradient either (every parameter
    without one); the replay steps the user's optimizer on that, as the loop did (pytorch #115607's
    Adam step counter lives there)."""
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    return {"loss": None, "loss_sum": 0.0, "count": 0.0, "no_forward": True,
            "loss_alt": {"micro_mean": None, "rank_mean": None, "rank_local": []}, "counts": [],
            "no_grad": list(names), "norm": 0.0, "rng_sensitive": None, "precision_floor": None,
            "precision_floor_tensors": None, "low_precision_params": [], "loss_floor": None, "ex_micro": [],
            "merged": None, "labels": None, "router_aux": None, "clip_coef": 1.0 if mgn > 0 else None}


def step_gradient_parts(model, rec: A.RecordingSet, step: int, user, *, examples: int | None,
                        probe: bool, alt_dtype: torch.dtype = torch.float64):
    """step_gradients' (outputs, info), the outputs a StepParts that writes
    them tensor by tensor (or a plain dict for objective_scope="step").
    alt_dtype: the dtype the alternatives that only name causes are written in."""
    objective = rec.meta["objective"]
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    spill = None
    rank_n: dict[int, float] = {}
    rank_loss: dict[int, float] = {}
    n_total, loss_total, micro_means, counts, native = 0.0, 0.0, [], {}, 0.0
    present: set[str] = set()

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
    if rec.meta.get("objective_scope") == "step":  # fn(model, batches) over the whole step, once
        return step_scope_gradients(model, rec, step, user, mbs, probe=probe, lowp=lowp, alts=examples is not None)
    spill = Spill(model, A.reference_scratch_dir(rec.out) / f"step{step}")
    try:
        return _spilled_gradients(model, rec, step, user, mbs, spill, examples=examples, probe=probe, lowp=lowp,
                                  names=names, shapes=shapes, alt_dtype=alt_dtype)
    except BaseException:
        spill.close()
        raise


def example_sample(mbs: list[tuple[int, int, dict]], j: int) -> set[int]:
    """Which of a step's micro-batches (rank, m, batch) fact 1's per-example
    check differentiates row by row at the j-th recorded tensor step (0-based):
    j = 0 every rank's first micro-batch, j > 0 one micro-batch, the
    (j - 1)-th in rank-then-micro order, cyclically."""
    if j == 0:
        return {i for i, (r, m, _) in enumerate(mbs) if m == min(mm for rr, mm, _ in mbs if rr == r)}
    return {(j - 1) % len(mbs)}


def _spilled_gradients(model, rec, step, user, mbs, spill: Spill, *, examples, probe, lowp, names, shapes,
                       alt_dtype):
    objective = rec.meta["objective"]
    rank_n: dict[int, float] = {}
    rank_loss: dict[int, float] = {}
    ranks: list[int] = []  # in the order first seen (rank then micro order)
    n_total, loss_total, micro_means, counts, native = 0.0, 0.0, [], {}, 0.0
    present: set[str] = set()
    aw = O.aux_weight(objective, model, mbs)  # an MoE model's own per-forward term: weighted by the step's count
    rng_sensitive = None
    sample = example_sample(mbs, examples) if examples is not None else set()
    cast_models: dict[str, torch.nn.Module] = {}  # the model at this step's parameters, cast for the forward
    base = model
    # the precision floor, over every micro-batch of a step where any computes in reduced precision
    measure = bool(lowp) or any(rec.autocast(r, step, m) is not None or rec.compute_dtype(r, step, m) is not None
                                for r, m, _ in mbs)
    # "gn", the normalised form: each micro-batch's loss sum / N x W backpropagated (N the step's count, W its
    # ranks: HF's Trainer, loss / num_items_in_batch x W, and DDP loops), then / W; the judge holds the fleet to
    # the nearer of g and gn. Built-in objectives (N known before the forwards). "partials": sum ||grad loss_sum||
    # over the micro-batches, "dot_length" the longest dot product of a backward (judge/bounds.py, grad_rtol)
    n_step = sum(objective_count(objective, b) for _, _, b in mbs) if objective in OBJECTIVES else 0.0
    w_step, partials = len({r for r, _, _ in mbs}), 0.0
    dot_length = max([max(p.shape) for p in base.parameters() if p.dim()] +
                     [int(O.labels(b).numel()) for _, _, b in mbs if objective in OBJECTIVES] or [1])
    for i, (r, m, batch) in enumerate(mbs):
        ac, cast = rec.autocast(r, step, m), rec.compute_dtype(r, step, m)
        model = base
        if cast is not None:  # FSDP2's mixed precision: the forward and backward on cast parameters
            if cast not in cast_models:
                cast_models[cast] = copy_module(base).to(FW.dtype(cast))
            model = cast_models[cast]
        # the model's plain attributes this forward ran with (a flag the loop set), put back after it
        undo = FW.attrs(model, rec, r, step, m)
        torch.random.default_generator.manual_seed(0)
        ls, c = FW.backward(model, objective, batch, user, ac, aux_weight=aw)
        src, have = spill.put(model)
        present |= have
        spill.add("g", src)
        partials += math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()
                                  if p.grad is not None))
        if n_step > 0 and not measure:  # the normalised form (float32 steps: reduced precision has its floor)
            torch.random.default_generator.manual_seed(0)
            FW.backward(model, objective, batch, user, ac, scale=w_step / n_step, aux_weight=aw)
            spill.add("gn", spill.put(model)[0], 1.0 / w_step)
        if measure:  # the precision floor: the same gradient through the loss / 3
            FW.backward(model, objective, batch, user, ac, scale=1 / 3, aux_weight=aw)
            spill.add("scaled", spill.put(model)[0], 3.0)
            if objective in OBJECTIVES:  # and the loss from the logits as the forward gives them, computed
                with torch.no_grad():  # outside autocast (where cross_entropy would run in float32)
                    with FW.autocast(ac):
                        out = O.call(model, batch)
                        aux = routeraux.term(out, model, batch)
                    native += float(objective_of_logits(objective, O.logits(out), batch, upcast=False)[0])
                    native += float(aux) * aw if aux is not None and aw is not None else 0.0
        if m == max(mm for rr, mm, _ in mbs if rr == r) and m > 0:  # each rank's last micro-batch (causes)
            spill.add("last", src)
        if r not in ranks:
            ranks.append(r)
        spill.add(("rank", r), src)
        rank_n[r] = rank_n.get(r, 0.0) + c
        rank_loss[r] = rank_loss.get(r, 0.0) + ls
        counts.setdefault(r, []).append(c)
        n_total += c
        loss_total += ls
        if c > 0:
            spill.add("micro_mean", src, 1.0 / c)
            micro_means.append(ls / c)
        if probe and rng_sensitive is None:  # the same micro-batch under another RNG state
            torch.random.default_generator.manual_seed(1)
            FW.backward(model, objective, batch, user, ac, aux_weight=aw)
            rng_sensitive = not spill.same(src, model)
        if i in sample:
            spill.add("exb", src)
            for row in O.rows(batch):
                torch.random.default_generator.manual_seed(0)
                FW.backward(model, objective, row, user, ac, aux_weight=aw)
                spill.add("ex", spill.put(model)[0])
        model.zero_grad(set_to_none=True)
        undo()
    model = base
    merged = None
    if examples is not None:  # a judged step: its rows in as few forwards as memory allows (batchscope)
        merged = _global_forward(base, cast_models, rec, step, user, mbs,
                                 lambda mm: spill.add("gm", spill.put(mm)[0]), aw)
    for m_ in cast_models.values():
        m_.zero_grad(set_to_none=True)
    cast_models.clear()
    model.zero_grad(set_to_none=True)
    if n_total <= 0:
        raise ReferenceError(f"step {step}: the declared objective {objective!r} counts no tokens/examples in the "
                             "recorded micro-batches (every label -100?)")
    world = len(ranks)
    # exb is g itself where the sample is every micro-batch (the judge reads g then)
    exb = bool(sample) and len(sample) < len(mbs)
    gm_count = merged.get("count") if merged is not None else None

    class Outputs:
        """Every output of one tensor (rows a:b of it), the formulas of the module docstring."""

        def has(self, key: str, n: str) -> bool:
            def held(k):
                return any(n in spill.files[s] for s, _ in spill.terms.get(k, []))
            if key == "wa":
                return not rec.sketch and held("g")
            if key == "rank_mean":
                return any(rank_n[r] > 0 and held(("rank", r)) for r in ranks)
            if key == "gm":
                return bool(gm_count) and held("gm")
            if key in ("ex", "exb"):
                return bool(sample) and (key == "ex" or exb) and held(key)
            return held(key)

        def __call__(self, n: str, rows, only: str | None = None) -> dict[str, torch.Tensor]:
            """Every output of tensor n (rows a:b), or only the one named `only`: each source read once."""
            o: dict[str, torch.Tensor] = {}
            if n not in present and not (gm_count and spill.has("gm")):
                return o
            held: dict[int, torch.Tensor] = {}

            def val(key, n_, rows_):  # spill.value over this tensor's sources, each read (made float64) once
                if only is not None and key != only and not (only in ("wa", "rank_mean") and isinstance(key, tuple)):
                    return None
                acc = None
                for src, w in spill.terms.get(key, []):
                    f = spill.files[src]
                    if n_ in f:
                        if src not in held:
                            held[src] = (f[n_] if rows_ is None else f.rows(n_, *rows_)).double()
                        acc = (0 if acc is None else acc) + held[src] * w
                return acc

            g = val("g", n, rows)
            if g is not None:
                o["g"] = g / n_total
            gn = val("gn", n, rows) if spill.has("gn") else None
            if gn is not None:
                o["gn"] = gn
            mm = val("micro_mean", n, rows)
            if mm is not None:
                o["micro_mean"] = mm / max(len(micro_means), 1)
            wa, rm = None, None
            for r in ranks:  # sum_r |g_r| / T: what the bf16 wire rounds, element by element; where it is zero
                v = val(("rank", r), n, rows)  # no rank has gradient to reduce (the made-up gradient)
                if v is None:
                    continue
                if not rec.sketch:
                    wa = (0 if wa is None else wa) + v.abs() / n_total
                if rank_n[r] > 0:
                    rm = (0 if rm is None else rm) + v / rank_n[r] / world
            if wa is not None:
                o["wa"] = wa
            if rm is not None:
                o["rank_mean"] = rm
            # the sums normalised by their counts: the last micro-batches', the merged forward's, the rows'
            for key, count, wanted in (("last", n_total, True), ("gm", gm_count, bool(gm_count)),
                                       ("ex", n_total, bool(sample)), ("exb", n_total, bool(sample and exb))):
                v = val(key, n, rows) if wanted else None
                if v is not None:
                    o[key] = v / count
            return o

    outputs = Outputs()
    parts = StepParts(spill, names, shapes, outputs,
                      ["g", "gn", "micro_mean", "rank_mean", "wa", "last", "gm", "ex", "exb"], {},
                      {k: alt_dtype for k in ("micro_mean", "rank_mean", "wa", "last", "gm", "ex", "exb")})
    # the norm and the precision floor: sums tensor by tensor, read back from the spilled sources
    total, sq, gnorm, total_n = 0, {}, {}, 0.0
    for n in names:
        if n not in present:
            continue
        acc_n, sq_n = 0, 0
        for rows in parts._ranges(n):
            g = spill.value("g", n, rows) / n_total
            acc_n = acc_n + (g * g).sum()
            gn = spill.value("gn", n, rows) if spill.has("gn") else None
            total_n += float(gn.square().sum()) if gn is not None else 0.0
            if spill.has("scaled"):
                s = spill.value("scaled", n, rows)
                if s is not None:
                    sq_n = sq_n + ((s / n_total - g) ** 2).sum()
        total = total + acc_n
        if spill.has("scaled"):
            gnorm[n] = float(acc_n.sqrt()) if len(list(parts._ranges(n))) > 1 else \
                float((spill.value("g", n) / n_total).norm())
        if spill.has("scaled") and any(n in spill.files[s] for s, _ in spill.terms["scaled"]):
            sq[n] = float(sq_n)
    norm = float(torch.sqrt(total)) if isinstance(total, torch.Tensor) else 0.0
    floor, floors = None, None
    if spill.has("scaled"):  # ||g(loss / 3) * 3 - g|| / ||g||: reduced-precision round-off alone, and per tensor
        floor = math.sqrt(sum(sq.values())) / norm if norm > 0 else 0.0
        floors = {n: math.sqrt(x) / max(gnorm[n], 1e-300) for n, x in sq.items()}
    info = {"loss": loss_total / n_total, "loss_sum": loss_total, "count": n_total,
            "loss_alt": {"micro_mean": sum(micro_means) / max(len(micro_means), 1),
                         "rank_mean": sum(rank_loss[r] / rank_n[r] for r in rank_loss if rank_n[r] > 0) / world,
                         "rank_local": [rank_loss[r] / rank_n[r] if rank_n[r] else None for r in sorted(rank_loss)]},
            "counts": [counts[r] for r in sorted(counts)], "no_grad": [n for n in names if n not in present],
            "norm": norm, "rng_sensitive": rng_sensitive, "precision_floor": floor, "precision_floor_tensors": floors,
            "low_precision_params": lowp,
            "loss_floor": (abs(native - loss_total) / max(abs(loss_total), 1e-30)
                           if floor is not None and objective in OBJECTIVES else None),
            "ex_micro": [[mbs[i][0], mbs[i][1]] for i in sorted(sample)], "merged": merged,
            "labels": O.labels_source(mbs[0][2]) if objective in OBJECTIVES else None,
            "router_aux": routeraux.coef(base, mbs[0][2]) if aw is not None else None}
    mgn = float(rec.meta.get("max_grad_norm", 0.0))
    info["clip_coef"] = clip_coef(mgn, norm) if mgn > 0 else None
    info.update(norm_normalised=math.sqrt(total_n) if spill.has("gn") else None, sum_terms=len(mbs),
                partials=partials / n_total / norm if norm > 0 else 1.0, dot_length=dot_length,
                elements=sum(p.numel() for p in base.parameters() if p.requires_grad),
                split_products=bool(rec.meta.get("layout")))
    parts.info = info
    return parts, info


def _global_forward(base, cast_models, rec: A.RecordingSet, step: int, user, mbs, add,
                    aux_weight: float | None = None) -> dict:
    """The declared objective's gradient over the step's rows merged into as
    few forwards as memory allows (batchscope.merge_plan), `add` called with
    the model holding each forward's gradient in p.grad: {"forwards", "rows", "words", "count"}, or
    {"error"} when a merged forward cannot be computed."""
    objective = rec.meta["objective"]
    extras = [json.dumps([rec.autocast(r, step, m), rec.compute_dtype(r, step, m),
                          BS.attr_changes_at(rec, r, step, m)], sort_keys=True, default=str) for r, m, _ in mbs]
    chunks, words = BS.merge_plan([b for _, _, b in mbs], extras)
    count = 0.0
    for c in chunks:
        r, m, _ = mbs[c[0]]
        ac, cast = rec.autocast(r, step, m), rec.compute_dtype(r, step, m)
        model = cast_models[cast] if cast is not None else base
        undo = FW.attrs(model, rec, r, step, m)
        torch.random.default_generator.manual_seed(0)
        try:
            _, n = FW.backward(model, objective, BS.merged([mbs[i][2] for i in c]), user, ac, aux_weight=aux_weight)
        except ReferenceError as e:
            model.zero_grad(set_to_none=True)
            return {"error": str(e), "words": words, "forwards": len(chunks)}
        finally:
            undo()
        add(model)  # the forward's gradient, in p.grad
        count += n
    model.zero_grad(set_to_none=True)
    return {"forwards": len(chunks), "words": words, "count": count,
            "rows": sum(next((v.shape[0] for v in b.values() if isinstance(v, torch.Tensor) and v.dim()), 0)
                        for _, _, b in mbs)}


def probe_tensors(model, rec, k: int, user) -> dict[str, torch.Tensor]:
    """reference_probe on every DP replica leader's (every rank with micro-batches) first micro-batch
    of step k, at the model's current parameters: {"probe/RANK/" + the reference_probe names}."""
    objective = rec.meta["objective"]
    out: dict[str, torch.Tensor] = {}
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
        return out  # reduced precision: the probe's floors are float32's (the judge says it did not probe)
    if rec.meta.get("objective_scope") == "step":
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
        out.update({f"probe/{r}/{n}": v for n, v in got.items()})
    return out
