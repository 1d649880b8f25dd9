"""objective_scope="step": the declared fn(model, batches) over the whole step, differentiated once,
beside each rank's own and a transformers MoE model's per-forward term."""

from __future__ import annotations

import json
import math

import torch

from dormouse.clip import clip_coef
from dormouse.errors import DormouseError
from dormouse.gate import artifacts as A
from dormouse.gate.record import batchscope as BS
from dormouse.gate.record.reference.error import ReferenceError
from dormouse.gate.record.reference import forward as FW
from dormouse.gate.record.reference import objective as O


def step_scope_gradients(model, rec: A.RecordingSet, step: int, user, mbs, *, probe: bool,
                         lowp: list, alts: bool = True) -> tuple[dict, dict]:
    """objective_scope="step": fn(model, batches) over every rank's
    micro-batches of the step (rank then micro order), differentiated once
    (statistics over the global batch: load balancing over all-reduced
    routing statistics, in-batch negatives gathered from every rank)."""
    objective = rec.spec.objective
    names = [n for n, _ in model.named_parameters()]
    _check_one_call(rec, step, mbs)
    ac = rec.autocast(mbs[0][0], step, mbs[0][1])
    batches = [b for _, _, b in mbs]

    def once(seed: int, scale: float = 1.0, part: list | None = None):
        return _once(model, user, batches if part is None else part, ac, objective, step, seed, scale)

    ls, c, grads = once(0)
    if c <= 0:
        raise ReferenceError(f"step {step}: the declared objective {objective!r} counts no tokens/examples")
    g = {n: grads[n].double() / c for n in names if grads.get(n) is not None}
    rng_sensitive = None
    if probe:
        _, _, again = once(1)
        rng_sensitive = any((a is None) != (b is None) or (a is not None and not torch.equal(a, b))
                            for a, b in zip(grads.values(), again.values()))
    norm = float(torch.sqrt(sum((v * v).sum() for v in g.values())))
    floor, floors = None, None
    if lowp or ac is not None:  # the precision floor: the same gradient through the loss / 3
        _, _, g3 = once(0, 1 / 3)
        sq = {n: float(((g3[n].double() * 3 / c - v) ** 2).sum()) for n, v in g.items() if g3.get(n) is not None}
        floor = math.sqrt(sum(sq.values())) / norm if norm > 0 else 0.0
        floors = {n: math.sqrt(x) / max(float(g[n].norm()), 1e-300) for n, x in sq.items()}
    fwd = _per_forward_moe(model, mbs, ac)
    model.zero_grad(set_to_none=True)
    ranks = sorted({r for r, _, _ in mbs})
    rank_mean = _rank_mean(once, names, mbs, ranks) if len(ranks) > 1 and alts else {}  # at judged steps
    model.zero_grad(set_to_none=True)
    info = {"loss": ls / c, "loss_sum": ls, "count": c,
            "loss_alt": {"micro_mean": None, "rank_mean": None, "rank_local": []},
            "counts": [[None for rr, _, _ in mbs if rr == r] for r in ranks],
            "no_grad": [n for n in names if n not in g], "norm": norm, "rng_sensitive": rng_sensitive,
            "precision_floor": floor, "precision_floor_tensors": floors, "low_precision_params": lowp,
            "loss_floor": None, "ex_micro": [], "merged": None, "labels": None, "scope": "step"}
    mgn = float(rec.spec.max_grad_norm)
    info["clip_coef"] = clip_coef(mgn, norm) if mgn > 0 else None
    return {A.GRAD: g, A.alternative("micro_mean"): {}, A.alternative("rank_mean"): rank_mean,
            **({A.alternative("fwd"): fwd} if fwd else {})}, info


def _check_one_call(rec: A.RecordingSet, step: int, mbs) -> None:
    """One call of the objective over the whole step can reproduce it: one autocast, no cast parameters, the
    model's attributes the same for every micro-batch."""
    acs = {json.dumps(rec.autocast(r, step, m), sort_keys=True) for r, m, _ in mbs}
    if len(acs) > 1 or any(rec.compute_dtype(r, step, m) is not None for r, m, _ in mbs):
        raise ReferenceError(f"objective_scope='step': step {step}'s micro-batches ran under different autocasts or "
                             "on cast parameters, which one call of the objective over the whole step cannot "
                             "reproduce: record the run in one precision")
    changed = [(r, m) for r, m, _ in mbs if BS.attr_changes_at(rec, r, step, m)]
    if changed:
        (r, m), = changed[:1]
        raise ReferenceError(f"objective_scope='step': micro-batch {m} of rank {r} at step {step} ran with other "
                             f"model attributes ({BS.attr_changes_at(rec, step=step, r=r, m=m)}), which one call of "
                             "the objective over the whole step cannot set")


def _once(model, user, batches: list, ac, objective: str, step: int, seed: int, scale: float = 1.0):
    """The declared fn(model, batches) differentiated once: (loss_sum, count, each parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    torch.random.default_generator.manual_seed(seed)
    with FW.autocast(ac):
        try:
            ls, c = user(model, batches)
        except DormouseError:
            raise
        except Exception as e:
            raise ReferenceError(f"objective {objective!r} (objective_scope='step') failed on step {step}'s "
                                 f"micro-batches ({type(e).__name__}: {e})")
    if not isinstance(ls, torch.Tensor) or not ls.requires_grad:
        raise ReferenceError(f"objective {objective!r} gives a loss with no gradient: it must be computed from "
                             "the model's outputs")
    (ls * scale if scale != 1.0 else ls).backward()
    return float(ls.detach()), float(c), {n: (p.grad.detach().clone() if p.grad is not None else None)
                                          for n, p in model.named_parameters()}


def _rank_mean(once, names: list[str], mbs, ranks: list[int]) -> dict[str, torch.Tensor]:
    """Beside the step's gradient, each rank's micro-batches alone, their objectives averaged ("rank_mean":
    statistics over each rank's own rows, e.g. routing counts not reduced over the ranks), so that the judge
    can name that split; {} for an objective that needs the whole step (no alternative to name, the check
    unchanged)."""
    rank_mean: dict[str, torch.Tensor] = {}
    try:
        for r in ranks:
            _, cr, gr = once(0, part=[b for rr, _, b in mbs if rr == r])
            for n in names:
                if gr.get(n) is not None and cr > 0:
                    rank_mean[n] = rank_mean.get(n, 0) + gr[n].double() / (cr * len(ranks))
    except DormouseError:
        return {}
    return rank_mean


def _per_forward_moe(model, mbs, ac) -> dict:
    """Beside a step-scoped objective, for a transformers MoE model that adds its
    own load-balancing term (routeraux): the causal LM loss with that term over
    each forward's own routing statistics, as the fleet split the step (what the
    model and HF's Trainer compute), the judge's name for a fleet that computes
    per forward what the declaration computes over the step. {} otherwise."""
    aw = O.aux_weight("causal_lm", model, mbs)
    if aw is None or not aw:
        return {}
    acc: dict = {}
    try:
        for _, _, b in mbs:
            _, _, grads = FW.grads(model, "causal_lm", b, None, ac, aux_weight=aw)
            for n, v in grads.items():
                if v is not None:
                    acc[n] = acc.get(n, 0) + v.double()
    except ReferenceError:
        return {}
    return {n: v / aw for n, v in acc.items()}
