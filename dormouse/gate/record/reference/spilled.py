"""One step's gradients micro-batch by micro-batch, spilled (spill.py): each
micro-batch's gradient and the sources of the alternatives it joins (the
normalised form, the precision floor's loss / 3, its rank's, its rows alone,
another RNG state), the step's rows in merged forwards, then every output
formed tensor by tensor (_Outputs) and the step's figures (_info: its norm,
the precision floor, its losses). The formulas: the package docstring."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from dormouse.clip import clip_coef
from dormouse.numerics import scalar_relative
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record import routeraux
from dormouse.gate.record.options import OBJECTIVES
from dormouse.train.tensors import copy_module
from dormouse.gate.record.reference.error import ReferenceError
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import objective as O
from dormouse.gate.record.reference.objective import objective_count, objective_of_logits
from dormouse.gate.record.reference import normalised as NZ
from dormouse.gate.record.reference import rngstate as RS
from dormouse.gate.record.reference.sample import ExtrasBudget, example_sample
from dormouse.gate.record.reference.spill import Spill, StepParts

MICRO_MEAN, RANK_MEAN = A.alternative("micro_mean"), A.alternative("rank_mean")
KEYS = [A.GRAD, A.GRAD_NORMALISED, MICRO_MEAN, RANK_MEAN, A.WIRE_ABS, A.LAST_MICRO, A.GRAD_MERGED, A.SAMPLED,
        A.SAMPLED_GRAD]  # every output (its tensor-key prefix), in writing order
# those that only name causes
ALTERNATIVES = (MICRO_MEAN, RANK_MEAN, A.WIRE_ABS, A.LAST_MICRO, A.GRAD_MERGED, A.SAMPLED, A.SAMPLED_GRAD)


@dataclass
class _Tally:
    """A step's micro-batches as they are differentiated: what they count, sum and hold."""
    objective: str
    aw: float | None  # an MoE model's own per-forward term: weighted by the step's count
    measure: bool  # the precision floor, over every micro-batch of a step where any computes in reduced precision
    n_step: float  # the step's count before the forwards (built-in objectives; else 0): the normalised form's N
    w_step: int  # the step's ranks: the normalised form's W
    sample: set  # the micro-batches fact 1 differentiates row by row
    ranks: list = field(default_factory=list)  # in the order first seen (rank then micro order)
    rank_n: dict = field(default_factory=dict)
    rank_loss: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    micro_means: list = field(default_factory=list)
    present: set = field(default_factory=set)  # the parameters some micro-batch's gradient reaches
    n_total: float = 0.0
    loss_total: float = 0.0
    loss_abs: float = 0.0  # sum |a micro-batch's loss sum|: the loss's own scale where its terms cancel (GRPO)
    native: float = 0.0  # the loss from the logits in the dtype the forward gives them (the loss floor)
    partials: float = 0.0  # sum ||grad loss_sum|| over the micro-batches (judge/bounds.py, grad_rtol)
    rng_sensitive: bool | None = None
    eager_gn: bool = True  # gn beside each micro-batch's g (else after the step's g, where asked: normalised.py)
    # draw(i, other=False): the RNG state micro-batch i's forward started from on its rank (rngstate.py)
    draw: object = None
    rng_states: str | None = None  # how the forwards' draws were put back (rngstate.kind)

    def add_micro(self, spill: Spill, mbs, i: int, src: int, have: set, ls: float, c: float, partial: float) -> None:
        """Micro-batch i's gradient (spilled source src; the parameters it reaches; its norm), loss sum and
        count, into every sum it joins (the one-process loop, and reference/sharded.py's)."""
        r, m, _ = mbs[i]
        self.present |= have
        spill.add(A.GRAD, src)
        self.partials += partial
        if m == max(mm for rr, mm, _ in mbs if rr == r) and m > 0:  # each rank's last micro-batch (causes)
            spill.add(A.LAST_MICRO, src)
        if r not in self.ranks:
            self.ranks.append(r)
        spill.add(("rank", r), src)
        self.rank_n[r] = self.rank_n.get(r, 0.0) + c
        self.rank_loss[r] = self.rank_loss.get(r, 0.0) + ls
        self.counts.setdefault(r, []).append(c)
        self.n_total += c
        self.loss_total += ls
        self.loss_abs += abs(ls)
        if c > 0:
            spill.add(MICRO_MEAN, src, 1.0 / c)
            self.micro_means.append(ls / c)
        if i in self.sample:  # fact 1: beside its rows alone
            spill.add(A.SAMPLED_GRAD, src)


def spilled_gradients(model, rec, step, user, mbs, spill: Spill, *, examples, probe, lowp, names, shapes,
                      alt_dtype, normalised=True):
    """step_gradient_parts over the step's micro-batches one by one, every source spilled."""
    base = model
    budget = examples.stated() if isinstance(examples, ExtrasBudget) else None
    examples = examples.take(mbs) if isinstance(examples, ExtrasBudget) else examples  # None: a step it skips
    t = tally(rec, step, base, mbs, lowp, examples)
    t.eager_gn = normalised is True
    cast_models: dict[str, torch.nn.Module] = {}  # the model at this step's parameters, cast for the forward
    for i, (r, m, batch) in enumerate(mbs):
        ac, cast = rec.autocast(r, step, m), rec.compute_dtype(r, step, m)
        model = _cast(base, cast_models, cast)
        # the model's plain attributes this forward ran with (a flag the loop set), put back after it
        undo = FW.attrs(model, rec, r, step, m)
        _micro_batch(t, spill, model, ac, user, mbs, i, probe)
        model.zero_grad(set_to_none=True)
        undo()
    merged = None
    if examples is not None:  # a judged step: its rows in as few forwards as memory allows (batchscope)
        merged = _global_forward(base, cast_models, rec, step, user, mbs,
                                 lambda mm: spill.add(A.GRAD_MERGED, spill.put(mm)[0]), t.aw)
    for m_ in cast_models.values():
        m_.zero_grad(set_to_none=True)
    cast_models.clear()
    base.zero_grad(set_to_none=True)
    parts = finish(t, spill, rec, step, base, mbs, lowp, merged, names, shapes, alt_dtype)
    judged = callable(normalised) and t.n_step > 0 and not t.measure
    miss = judged and normalised(rec, step, parts.info, NZ.FormedG(spill, t.n_total, t.present))
    if judged and (examples is not None or miss):
        parts.info["norm_normalised"] = NZ.normalised_form(base, rec, step, user, mbs, spill, parts, t.aw,
                                                           t.w_step / t.n_step)
    if judged and not miss:
        drop_fits(parts.outputs, rec, merged)
        parts.info["fits_dropped"] = True
    parts.info["extras_budget"] = budget
    return parts, parts.info


# the outputs that only name the cause of a step that fails (the gradient check's fits)
FITS_ONLY = (MICRO_MEAN, RANK_MEAN, A.LAST_MICRO)


def drop_fits(outputs: "_Outputs", rec, merged) -> None:
    """A step whose fleet gradient is within half its bound of g (forms.needs_normalised said so) passes
    the gradient check whatever else the reference forms: the fits that name a failing step's cause are
    not formed nor written there, nor sum_r |g_r| / T (A.WIRE_ABS), which only a declared bf16 wire
    (a recording forms.needs_normalised never lets through here) and the made-up gradient's mask at a
    step with its rows merged read. At 124M this is 1.5 of the 2.5 GB a passing step's file held. Where
    another step fails, `gate check` makes the reference again with every fit (pipeline.check_recording):
    a fit is named from every step, not from the failing ones alone."""
    outputs.dropped.update(FITS_ONLY)
    if merged is None and rec.spec.wire != "bf16":
        outputs.dropped.add(A.WIRE_ABS)


def finish(t: _Tally, spill: Spill, rec, step, base, mbs, lowp, merged, names, shapes, alt_dtype) -> StepParts:
    """The step's outputs (a StepParts over the spilled sources, its figures in .info) from its tally."""
    if t.n_total <= 0:
        raise ReferenceError(f"step {step}: the declared objective {t.objective!r} counts no tokens/examples in the "
                             "recorded micro-batches (every label -100?)")
    gm_count = merged.get("count") if merged is not None else None
    parts = StepParts(spill, names, shapes, _Outputs(spill, rec, t, len(mbs), gm_count), KEYS, {},
                      {k: alt_dtype for k in ALTERNATIVES})
    parts.info = _info(t, parts, rec, base, mbs, lowp, merged, names)
    return parts


def tally(rec, step, base, mbs, lowp, examples) -> _Tally:
    objective = rec.spec.objective
    measure = bool(lowp) or any(rec.autocast(r, step, m) is not None or rec.compute_dtype(r, step, m) is not None
                                for r, m, _ in mbs)
    # "gn", the normalised form: each micro-batch's loss sum / N x W backpropagated (N the step's count, W its
    # ranks: HF's Trainer, loss / num_items_in_batch x W, and DDP loops), then / W; the judge holds the fleet to
    # the nearer of g and gn. Built-in objectives (N known before the forwards)
    n_step = sum(objective_count(objective, b) for _, _, b in mbs) if objective in OBJECTIVES else 0.0
    return _Tally(objective, O.aux_weight(objective, base, mbs), measure, n_step, len({r for r, _, _ in mbs}),
                  example_sample(mbs, examples) if examples is not None else set(),
                  draw=lambda i, other=False: RS.restore(rec, mbs[i][0], step, mbs[i][1], other=other),
                  rng_states=RS.kind(rec, step, mbs))


def _cast(base, cast_models: dict, cast: str | None):
    """The model a forward runs on: FSDP2's mixed precision casts the parameters for the forward and backward."""
    if cast is None:
        return base
    if cast not in cast_models:
        cast_models[cast] = copy_module(base).to(FW.dtype(cast))
    return cast_models[cast]


def _micro_batch(t: _Tally, spill: Spill, model, ac, user, mbs, i: int, probe: bool) -> None:
    """Micro-batch i differentiated, its gradient spilled as a source of g and of every output it joins."""
    r, m, batch = mbs[i]
    objective, aw = t.objective, t.aw
    t.draw(i)  # the masks its rank drew
    ls, c = FW.backward(model, objective, batch, user, ac, aux_weight=aw)
    src, have = spill.put(model)
    t.add_micro(spill, mbs, i, src, have, ls, c, math.sqrt(sum(float(p.grad.double().square().sum())
                                                               for p in model.parameters() if p.grad is not None)))
    if t.n_step > 0 and not t.measure and t.eager_gn:  # the normalised form (float32 steps: reduced precision
        # has its floor)
        t.draw(i)
        FW.backward(model, objective, batch, user, ac, scale=t.w_step / t.n_step, aux_weight=aw)
        spill.add(A.GRAD_NORMALISED, spill.put(model)[0], 1.0 / t.w_step)
    if t.measure:
        _floor_sources(t, spill, model, ac, user, batch, i)
    if probe and t.rng_sensitive is None:  # the same micro-batch under another RNG state
        t.draw(i, other=True)
        FW.backward(model, objective, batch, user, ac, aux_weight=aw)
        t.rng_sensitive = not spill.same(src, model)
    if i in t.sample:  # fact 1: the micro-batch's rows alone
        for row in O.rows(batch):
            torch.random.default_generator.manual_seed(0)
            FW.backward(model, objective, row, user, ac, aux_weight=aw)
            spill.add(A.SAMPLED, spill.put(model)[0])


def _floor_sources(t: _Tally, spill: Spill, model, ac, user, batch, i: int) -> None:
    """The precision floor's sources: the same gradient through the loss / 3, and (built-in objectives) the
    loss from the logits as the forward gives them, computed outside autocast (where cross_entropy would run
    in float32). Each from the masks the rank drew."""
    t.draw(i)
    FW.backward(model, t.objective, batch, user, ac, scale=1 / 3, aux_weight=t.aw)
    spill.add("scaled", spill.put(model)[0], 3.0)
    if t.objective not in OBJECTIVES:
        return
    t.draw(i)
    with torch.no_grad():
        with FW.autocast(ac):
            out = O.call(model, batch)
            aux = routeraux.term(out, model, batch)
        t.native += float(objective_of_logits(t.objective, O.logits(out), batch, upcast=False)[0])
        t.native += float(aux) * t.aw if aux is not None and t.aw is not None else 0.0


class _Outputs:
    """Every output of one tensor (rows a:b of it), the formulas of the package docstring."""

    def __init__(self, spill: Spill, rec, t: _Tally, n_micro: int, gm_count):
        self.spill, self.sketch, self.t, self.gm_count = spill, rec.sketch, t, gm_count
        # exb is g itself where the sample is every micro-batch (the judge reads g then)
        self.exb = bool(t.sample) and len(t.sample) < n_micro
        self.dropped: set = set()  # outputs this step does not need (drop_fits)

    def has(self, key: str, n: str) -> bool:
        spill, t = self.spill, self.t
        if key in self.dropped:
            return False

        def held(k):
            return any(n in spill.files[s] for s, _ in spill.terms.get(k, []))
        if key == A.WIRE_ABS:
            return not self.sketch and held(A.GRAD)
        if key == RANK_MEAN:
            return any(t.rank_n[r] > 0 and held(("rank", r)) for r in t.ranks)
        if key == A.GRAD_MERGED:
            return bool(self.gm_count) and held(A.GRAD_MERGED)
        if key in (A.SAMPLED, A.SAMPLED_GRAD):
            return bool(t.sample) and (key == A.SAMPLED or self.exb) and held(key)
        return held(key)

    def __call__(self, n: str, rows, only: str | None = None) -> dict[str, torch.Tensor]:
        """Every output of tensor n (rows a:b), or only the one named `only`: each source read once."""
        spill, t, gm_count = self.spill, self.t, self.gm_count
        o: dict[str, torch.Tensor] = {}
        if n not in t.present and not (gm_count and spill.has(A.GRAD_MERGED)):
            return o
        held: dict[int, torch.Tensor] = {}

        def val(key):  # spill.value over this tensor's sources, each read (made float64) once
            if only is not None and key != only and not (only in (A.WIRE_ABS, RANK_MEAN) and isinstance(key, tuple)):
                return None
            if key in self.dropped or (isinstance(key, tuple) and {A.WIRE_ABS, RANK_MEAN} <= self.dropped):
                return None
            acc = None
            for src, w in spill.terms.get(key, []):
                f = spill.files[src]
                if n in f:
                    if src not in held:
                        held[src] = (f[n] if rows is None else f.rows(n, *rows)).double()
                    acc = (0 if acc is None else acc) + held[src] * w
            return acc

        g = val(A.GRAD)
        if g is not None:
            o[A.GRAD] = g / t.n_total
        gn = val(A.GRAD_NORMALISED) if spill.has(A.GRAD_NORMALISED) else None
        if gn is not None:
            o[A.GRAD_NORMALISED] = gn
        mm = val(MICRO_MEAN)
        if mm is not None:
            o[MICRO_MEAN] = mm / max(len(t.micro_means), 1)
        o.update(self._per_rank(val))
        # the sums normalised by their counts: the last micro-batches', the merged forward's, the rows'
        for key, count, wanted in ((A.LAST_MICRO, t.n_total, True), (A.GRAD_MERGED, gm_count, bool(gm_count)),
                                   (A.SAMPLED, t.n_total, bool(t.sample)),
                                   (A.SAMPLED_GRAD, t.n_total, bool(t.sample and self.exb))):
            v = val(key) if wanted else None
            if v is not None:
                o[key] = v / count
        return o

    def _per_rank(self, val) -> dict[str, torch.Tensor]:
        """"wa" (sum_r |g_r| / T: what the bf16 wire rounds, element by element; where it is zero no rank has
        gradient to reduce, the made-up gradient) and "rank_mean" from each rank's sum."""
        t, wa, rm = self.t, None, None
        for r in t.ranks:
            v = val(("rank", r))
            if v is None:
                continue
            if not self.sketch:
                wa = (0 if wa is None else wa) + v.abs() / t.n_total
            if t.rank_n[r] > 0:
                rm = (0 if rm is None else rm) + v / t.rank_n[r] / len(t.ranks)
        return {k: v for k, v in ((A.WIRE_ABS, wa), (RANK_MEAN, rm)) if v is not None}


def _norms(t: _Tally, parts: StepParts, names: list[str]):
    """The step's norm, the precision floor (||g(loss / 3) * 3 - g|| / ||g||: reduced-precision round-off
    alone) and each tensor's, and the normalised form's squared norm: sums tensor by tensor, read back from
    the spilled sources."""
    spill, n_total = parts.spill, t.n_total
    total, sq, gnorm, total_n = 0, {}, {}, 0.0
    for n in names:
        if n not in t.present:
            continue
        acc_n, sq_n = 0, 0
        for rows in parts._ranges(n):
            g = spill.value(A.GRAD, n, rows) / n_total
            acc_n = acc_n + (g * g).sum()
            gn = spill.value(A.GRAD_NORMALISED, n, rows) if spill.has(A.GRAD_NORMALISED) else None
            total_n += float(gn.square().sum()) if gn is not None else 0.0
            if spill.has("scaled"):
                s = spill.value("scaled", n, rows)
                if s is not None:
                    sq_n = sq_n + ((s / n_total - g) ** 2).sum()
        total = total + acc_n
        if spill.has("scaled"):
            gnorm[n] = float(acc_n.sqrt()) if len(list(parts._ranges(n))) > 1 else \
                float((spill.value(A.GRAD, n) / n_total).norm())
        if spill.has("scaled") and any(n in spill.files[s] for s, _ in spill.terms["scaled"]):
            sq[n] = float(sq_n)
    norm = float(torch.sqrt(total)) if isinstance(total, torch.Tensor) else 0.0
    floor, floors = None, None
    if spill.has("scaled"):
        floor = math.sqrt(sum(sq.values())) / norm if norm > 0 else 0.0
        floors = {n: math.sqrt(x) / max(gnorm[n], 1e-300) for n, x in sq.items()}
    return norm, floor, floors, total_n


def _info(t: _Tally, parts: StepParts, rec, base, mbs, lowp, merged, names) -> dict:
    """The step's figures beside its tensors (the reference's step JSON)."""
    norm, floor, floors, total_n = _norms(t, parts, names)
    builtin = t.objective in OBJECTIVES
    world = len(t.ranks)
    info = {"loss": t.loss_total / t.n_total, "loss_sum": t.loss_total, "count": t.n_total,
            "loss_scale": t.loss_abs / t.n_total,
            "loss_alt": {"micro_mean": sum(t.micro_means) / max(len(t.micro_means), 1),
                         "rank_mean": sum(t.rank_loss[r] / t.rank_n[r] for r in t.rank_loss if t.rank_n[r] > 0) / world,
                         "rank_local": [t.rank_loss[r] / t.rank_n[r] if t.rank_n[r] else None
                                        for r in sorted(t.rank_loss)]},
            "counts": [t.counts[r] for r in sorted(t.counts)], "no_grad": [n for n in names if n not in t.present],
            "norm": norm, "rng_sensitive": t.rng_sensitive, "rng_states": t.rng_states, "precision_floor": floor,
            "precision_floor_tensors": floors, "low_precision_params": lowp,
            "loss_floor": (scalar_relative(t.native, t.loss_total)
                           if floor is not None and builtin else None),
            "ex_micro": [[mbs[i][0], mbs[i][1]] for i in sorted(t.sample)], "merged": merged,
            "labels": O.labels_source(mbs[0][2]) if builtin else None,
            "router_aux": routeraux.coef(base, mbs[0][2]) if t.aw is not None else None}
    mgn = float(rec.spec.max_grad_norm)
    info["clip_coef"] = clip_coef(mgn, norm) if mgn > 0 else None
    # "dot_length": the longest dot product of a backward (judge/bounds.py, grad_rtol)
    dot_length = max([max(p.shape) for p in base.parameters() if p.dim()] +
                     [int(O.labels(b).numel()) for _, _, b in mbs if builtin] or [1])
    has_gn = parts.spill.has(A.GRAD_NORMALISED)
    info.update(norm_normalised=math.sqrt(total_n) if has_gn else None, sum_terms=len(mbs),
                partials=t.partials / t.n_total / norm if norm > 0 else 1.0, dot_length=dot_length,
                elements=sum(p.numel() for p in base.parameters() if p.requires_grad),
                split_products=bool(rec.recorded.layout))
    return info


def _global_forward(base, cast_models, rec: A.RecordingSet, step: int, user, mbs, add,
                    aux_weight: float | None = None) -> dict:
    """The declared objective's gradient over the step's rows merged into as
    few forwards as memory allows (batchscope.merge_plan), `add` called with
    the model holding each forward's gradient in p.grad: {"forwards", "rows", "words", "count"}, or
    {"error"} when a merged forward cannot be computed."""
    objective = rec.spec.objective
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
