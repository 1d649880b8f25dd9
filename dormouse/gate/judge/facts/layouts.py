"""The layout check of a tensor-parallel (or 2-D dp x tp) recording
(record/layouts.py wrote its "layout": the meshes, each parameter's
placements, every rank's model-parallel group). Reads artifacts only.

layout  passes when, at every recorded step,
        - every rank of a model-parallel (TP) group was fed the same rows as
          the group's leader, whose micro-batches the reference reads (a peer
          fed other rows computes a forward of neither batch: named, with the
          rank and micro-batch);
        - every parameter's recorded gradient (full_tensor(); for a parameter
          replicated over the group, each rank's own) is equal on the ranks of
          a group: a replicated parameter whose gradient differs between them
          was not reduced over the group (a sequence-parallel norm's weight,
          Megatron's bug), and when the group's sum is one process's gradient
          the verdict says so;
        - neither class of parameters, the ones split over a model-parallel
          mesh dimension and the replicated ones, is off from one process's
          gradient by a constant factor while the other class agrees (a
          reduction that sums over the TP group where it should average:
          c = the TP size, named; pytorch #160285's doubled expert gradients);
        - no subset of the replicated parameters alone is off by the TP size
          or 1 / it while every other tensor agrees (causes.tensor_factor, as
          the gradient check finds it: a DTensor layout's plain tensors summed
          over the TP group where every rank held the whole gradient, or a
          sequence-parallel norm's parts averaged where they must be summed).
A declared sharding (record/declared.py: plain-tensor shards, Megatron-style
TP or expert parallel) is judged the same way from its "declared" entry: its
"tensor" groups are the model-parallel groups above; an "expert" group's
ranks are data-parallel ranks (each its own rows), and a factor on the expert
parameters alone is named by the expert-parallel size (pytorch #160285); expert
gradients reduced over their group like replicated ones (each rank's piece the
sum, or the mean, of every rank's pieces one process gives) are named so.
A context-parallel recording (its "context_parallel" entry: the sequence
dimension, the declared order, the CP size; its groups the CP groups) is
judged by _check_context_parallel: every CP peer held its shard (in the
declared order) of its leader's global rows and the same per-row tensors; the
global rows' positions neither restart at every shard (rotary offsets not
shifted) nor fall in order only under the other cut (the order declared is not
the one the loop cut); every gradient equal on the ranks of a CP group (else
not all-reduced over it); no factor by the CP or DP size.
The bound is the gradient check's (facts/gradient.py: GRAD_RTOL, or the
reduced-precision bound of the step)."""

from __future__ import annotations

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.verdict import Check
from dormouse.gate.judge.facts.tied import shared_copies
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge import causes as C
from dormouse.gate.judge.bounds import FACTOR_AWAY, FACTOR_RTOL, GRAD_RTOL
from dormouse.gate.judge.cpshards import cp_chunks, cp_join, cp_split
from dormouse.gate.judge.gradtools import fleet_grad, parts_at
from dormouse.gate.judge.precision import arithmetic_bound
from dormouse.gate.judge.metrics import fit, rel


def _peer_inputs(rec: A.RecordingSet, groups: list[list[int]]) -> str | None:
    """The first TP peer fed other rows than its group's leader, as a sentence; None when none was."""
    for k in rec.steps:
        for group in groups:
            lead = group[0]
            lt = rec.step_tensors(lead, k)
            n = rec.step_meta(lead, k).get("micro_batches", 0)
            for r in group[1:]:
                pt = rec.step_tensors(r, k)
                pn = rec.step_meta(r, k).get("tp_micro_batches", 0)
                where = f"at step {k} rank {r}, a model-parallel peer of rank {lead} (TP group {group}),"
                if pn != n:
                    return (f"{where} ran {pn} micro-batches where rank {lead} ran {n}: the ranks of a TP group "
                            "compute one forward together and must run the same micro-batches")
                for m in range(n):
                    a = A.prefixed(A.micro_input(m), lt)
                    b = A.prefixed(A.micro_input(m, A.TP_INPUT), pt)
                    bad = next((key for key in sorted(set(a) | set(b))
                                if key not in a or key not in b or a[key].shape != b[key].shape
                                or not torch.equal(a[key], b[key])), None)
                    if bad is not None:
                        return (f"{where} was fed other rows than rank {lead} (micro-batch {m}, input {bad!r}): the "
                                "ranks of a TP group compute one forward together and must read the same rows; "
                                "its gradient is of neither batch (feed every TP rank of a replica the replica's rows)")
    return None


def _changed_after_reduce(n: str, group: list[int], grads: list[dict], g_ref: dict, bound: float) -> str | None:
    """Where some ranks of the group hold one process's gradient of `n` and the others not: the reduce
    happened, and the others changed their copy after it (by one factor, where one fits exactly)."""
    if n not in g_ref:
        return None
    want = g_ref[n].double()
    right = [r for r, g in zip(group, grads) if n in g and rel({n: g[n]}, {n: want}, [n]) <= bound]
    wrong = [r for r, g in zip(group, grads) if n in g and r not in right]
    if not right or not wrong:
        return None
    got = grads[group.index(wrong[0])][n].double()
    c = float((got * want).sum() / (want * want).sum()) if float((want * want).sum()) else 0.0
    factor = f", its copy one process's times {c:.6g}" if rel({n: got}, {n: c * want}, [n]) <= bound else ""
    return (f"rank{'s' if len(right) > 1 else ''} {', '.join(map(str, right))} hold{'' if len(right) > 1 else 's'} "
            f"one process's gradient (within the bound {bound:g}) and rank {wrong[0]}'s differs from it{factor}: the "
            f"gradient was reduced over the group, then changed on rank {', '.join(map(str, wrong))} alone (a "
            "scaling, a clip or an edit after the reduce): every rank of the group must step on the same gradient")


def _unreduced(rec: A.RecordingSet, ref: ReferenceSet, groups: list[list[int]], params: dict,
               kind: str = "TP") -> str | None:
    """The first gradient that differs between the ranks of a TP (or CP) group, as a sentence; None when none
    does."""
    for k in rec.tensor_steps():
        bound = arithmetic_bound(rec, ref, GRAD_RTOL, k)
        g_ref = ref.tensors(k, A.GRAD)
        for group in groups:
            grads = [A.prefixed(A.GRAD, rec.step_tensors(r, k)) for r in group]
            for n in sorted(grads[0]):
                others = [(r, g[n]) for r, g in zip(group[1:], grads[1:]) if n in g and not torch.equal(g[n], grads[0][n])]
                if not others:
                    continue
                r, other = others[0]
                x = rel({n: other}, {n: grads[0][n]}, [n])
                pl = params.get(n, {})
                held = ("a plain tensor on every rank" if pl.get("placements") == ["plain"]
                        else f"placements {', '.join(pl.get('placements', []))} on mesh dims {pl.get('mesh')}")
                total = sum(g[n].double() for g in grads if n in g)
                summed = rel({n: total}, {n: g_ref[n]}, [n]) if n in g_ref else float("inf")
                said = (f"; the sum of the group's gradients is one process's gradient (within {summed:.2g}, bound "
                        f"{bound:g}): each rank holds its own part, never reduced over the group"
                        if summed <= bound else f"; neither is their sum one process's gradient (off by {summed:.2g})")
                if kind == "CP":
                    return (f"at step {k} the gradient of {n} differs between ranks {group[0]} and {r} of CP group "
                            f"{group} by {x:.2g}: every parameter is replicated over the CP group and each rank's "
                            "gradient covers only its own shard of the sequence; it was not all-reduced over the CP "
                            f"group (only over the data-parallel ranks, or not at all){said}")
                if summed > bound and any(ref.info(j).get("rng_sensitive") for j in rec.steps):
                    return (f"at step {k} the gradient of {n} ({held}) differs between ranks {group[0]} and {r} of TP "
                            f"group {group} by {x:.2g}, and their sum is not one process's either (off by "
                            f"{summed:.2g}), while the network draws random masks (its gradient changes with the "
                            "RNG state: see independence): the TP ranks drew different masks (dropout) where they "
                            "hold the same activations, so each computed another function. Not a missing "
                            "reduction: draw the masks of a replicated region alike on the ranks of a TP group (one "
                            "RNG state per group there, as Megatron's model-parallel RNG tracker keeps)")
                coef = rec.step_meta(group[0], k).get("clip_coef")
                if coef is not None and C.clipped_apart({n: grads[0][n]}, {n: other}, coef, rel, bound):
                    return (f"at step {k} the gradient of {n} ({held}) differs between ranks {group[0]} and {r} of TP "
                            f"group {group} by {x:.2g}: one is the other over the clip coefficient {coef:.4g}, "
                            "clipped on one rank of the group only, not a missing reduction (see clip)")
                changed = _changed_after_reduce(n, group, grads, g_ref, bound) if summed > bound else None
                if changed:
                    return (f"at step {k} the gradient of {n} ({held}) differs between ranks {group[0]} and {r} of TP "
                            f"group {group} by {x:.2g}: {changed}")
                what = ("a parameter split over the group whose gradient each rank holds whole (Replicate), "
                        "which the group's ranks must hold alike" if any("Shard" in p for p in pl.get("placements", []))
                        else "a parameter replicated over the group")
                return (f"at step {k} the gradient of {n} ({held}) differs between ranks {group[0]} and {r} of TP "
                        f"group {group} by {x:.2g}: {what} whose gradient was not reduced over it (a "
                        f"sequence-parallel norm's weight, for one){said}")
    return None


def _class_factor(rec: A.RecordingSet, ref: ReferenceSet, params: dict, tp: int, dp: int,
                  ep: int | None = None, kind: str = "TP") -> str | None:
    """A constant factor on one class of parameters (split over a model-parallel dimension, or replicated)
    while the other class agrees with one process, as a sentence; None otherwise. `ep`: the expert-parallel
    size of a declared sharding (its factor named first)."""
    split = {n for n, v in params.items() if v.get("model_parallel")}
    fits: dict[str, list] = {"split": [], "replicated": []}
    agree = {"split": True, "replicated": True}
    bounds = []
    for k in rec.tensor_steps():
        bound = arithmetic_bound(rec, ref, GRAD_RTOL, k)
        bounds.append(bound)
        g, g_ref = fleet_grad(rec, k), ref.tensors(k, A.GRAD)
        names = sorted(set(g) & set(g_ref))
        for cls, ns in (("split", [n for n in names if n in split]), ("replicated", [n for n in names if n not in split])):
            if not ns:
                continue
            fits[cls].append(fit(g, g_ref, ns))
            agree[cls] = agree[cls] and rel(g, g_ref, ns) <= bound
    bound = max(bounds, default=GRAD_RTOL)
    tol = max(FACTOR_RTOL, bound)
    cands = [(f"the {kind} size {tp}", tp), (f"1 / the {kind} size {tp}", 1 / tp), (f"the DP size {dp}", dp),
             (f"1 / the DP size {dp}", 1 / dp)]
    if tp > 1 and dp > 1:  # with one of them 1 the world size is the other's: named by it
        cands += [(f"the world size {tp * dp}", tp * dp), (f"1 / the world size {tp * dp}", 1 / (tp * dp))]
    if ep:  # a declared expert-parallel sharding: the split parameters are experts, their factor the EP size's
        cands = [(f"the expert-parallel size {ep}", ep), (f"1 / the expert-parallel size {ep}", 1 / ep)] + cands
    whole = [fit(fleet_grad(rec, k), ref.tensors(k, A.GRAD), sorted(set(fleet_grad(rec, k)) & set(ref.tensors(k, A.GRAD))))
             for k in rec.tensor_steps()]
    cs = [c for c, _ in whole]
    if whole and all(res <= bound for _, res in whole) and max(cs) - min(cs) <= tol * abs(cs[0]) \
            and abs(cs[0] - 1) > FACTOR_AWAY * bound:  # every gradient off by one constant: name it by the mesh
        # the data-parallel sizes first: a factor on every tensor alike is the replicas' normalisation
        order = [c for c in cands if "DP" in c[0]] + [c for c in cands if "world" in c[0]] + \
            [c for c in cands if kind in c[0]]
        named = next((w for w, v in order if v != 1 and abs(cs[0] / v - 1) <= tol), None)
        return (f"every gradient is one process's times {cs[0]:.4g}" + (f" = {named}" if named else "")
                + f" at every recorded step ({dp} data-parallel replica(s) of {tp} "
                + ("context-parallel" if kind == "CP" else "model-parallel") + " rank(s)): a "
                "normalisation over the mesh applied the wrong number of times")
    for cls, other in (("split", "replicated"), ("replicated", "split")):
        fs = fits[cls]
        if not fs or agree[cls] or not agree[other] or any(res > bound for _, res in fs):
            continue
        cs = [c for c, _ in fs]
        if max(cs) - min(cs) > tol * abs(cs[0]) or abs(cs[0] - 1) <= FACTOR_AWAY * bound:
            continue
        named = next((w for w, v in cands if v != 1 and abs(cs[0] / v - 1) <= tol), None)
        what = ("parameters split over a model-parallel mesh dimension" if cls == "split"
                else "parameters replicated over the TP group")
        n_cls = len([n for n in params if (n in split) == (cls == "split")])
        why = ("a reduction that sums over the TP group where it should average (or a gradient counted once "
               "per TP rank)" if cls == "split" else "a reduction over the group applied to the replicated "
               "parameters' gradients the wrong number of times")
        if ep and cls == "split":
            what = "expert parameters (declared sharded over the expert-parallel ranks)"
            if named and "expert" in named and cs[0] > 1:
                why = ("each expert's gradient sums every rank's tokens (the all_to_all's backward) while the dense "
                       "gradients are averaged over the same data-parallel ranks: the expert gradients must be "
                       "divided by the expert-parallel size too (pytorch #160285)")
            elif named and "expert" in named:
                why = ("the expert gradients were divided by the expert-parallel size once more than the dense "
                       "ones: the all_to_all's backward already brings each expert every rank's tokens at the "
                       "dense gradients' scale, so remove that division (or divide them as the dense ones are)")
        elif ep:
            what = "dense parameters (replicated: each rank holds all of them)"
            why = "their reduction over the data-parallel ranks applied the wrong number of times"
        elif cls == "replicated" and kind == "TP" and tp > 1:
            why = (_replicated_why(cs[0], tp, tol) or (None, why))[1]
        return (f"the gradients of the {n_cls} {what} are one process's times {cs[0]:.4g}"
                + (f" = {named}" if named else "") + f" at every recorded step, while the {other} ones agree: "
                + why)
    return None


def _replicated_why(c: float, tp: int, tol: float) -> tuple[str, str] | None:
    """(the factor's name, why) where replicated tensors' gradients are the TP size, or 1 / it, times one
    process's; None for another c."""
    if abs(c / tp - 1) <= tol:
        return (f"the TP size {tp}", "summed over the TP group instead of averaged: every TP rank computes a "
                "replicated tensor's whole gradient from the same rows, so a sum over the group counts it "
                f"{tp} times (drop that all-reduce, or divide by the TP size)")
    if abs(c * tp - 1) <= tol:
        return (f"1 / the TP size {tp}", "averaged over the TP group where each rank held only its part of the "
                "gradient and the parts must be summed (a sequence-parallel norm's weight), or divided by the TP "
                "size with no sum after it")
    return None


def _replicated_factor(rec: A.RecordingSet, ref: ReferenceSet, params: dict, tp: int) -> str | None:
    """The TP size (or its reciprocal) as a factor on some replicated tensors alone, every other tensor
    agreeing (causes.tensor_factor, the gradient check's finder), as a sentence; None otherwise. A DTensor
    layout's Replicate DTensors are reduced by DTensor itself, its plain tensors by the loop: a loop that
    reduces the plain ones wrongly puts the factor on those alone, not on the whole class."""
    steps = rec.tensor_steps()
    if tp < 2 or not steps:
        return None
    bound = max(arithmetic_bound(rec, ref, GRAD_RTOL, k) for k in steps)
    tol = max(FACTOR_RTOL, bound)
    found = C.tensor_factor([parts_at(rec, ref, k) for k in steps], bound, tol)
    if found is None or any(params.get(n, {}).get("model_parallel") for n in found[1]):
        return None
    c, names = found
    said = _replicated_why(c, tp, tol)
    if said is None:
        return None
    which = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"the gradients of the {len(names)} replicated (non-sharded) tensors {which} are one process's times "
            f"{c:.4g} = {said[0]} at every recorded step, while every other tensor agrees (the split ones "
            f"included): {said[1]}")


def _experts_mixed(rec: A.RecordingSet, ref: ReferenceSet, params: dict, decl: dict) -> str | None:
    """Expert gradients all-reduced over their expert-parallel group as the dense ones are: at every recorded
    step each rank's piece of every declared expert parameter's gradient is the sum (or the mean) over the
    group of the pieces one process gives, as a sentence; None otherwise (or no expert parameter)."""
    experts = {n: decl[v["pattern"]] for n, v in params.items()
               if v.get("parallel") == "expert" and v.get("pattern") in decl}
    steps = rec.tensor_steps()
    if not experts or not steps:
        return None
    worst = {"summed": 0.0, "averaged": 0.0}  # each against its step's bound (the ratio); inf: off at a step
    bounds = []
    for k in steps:
        bounds.append(arithmetic_bound(rec, ref, GRAD_RTOL, k))
        g, g_ref = fleet_grad(rec, k), ref.tensors(k, A.GRAD)
        summed, averaged = {}, {}
        for n, d in experts.items():
            size = len(next((grp for grp in d["groups"] if 0 in grp), d["groups"][0]))  # rank 0's group's
            if n not in g or n not in g_ref or size < 2 or g_ref[n].shape[d["dim"]] % size:
                return None
            summed[n] = torch.cat([sum(g_ref[n].double().chunk(size, d["dim"]))] * size, d["dim"])
            averaged[n] = summed[n] / size
        names = sorted(summed)
        if rel(g, g_ref, names) <= bounds[-1]:
            return None  # the experts' gradients are right at this step
        worst["summed"] = max(worst["summed"], rel(g, summed, names) / bounds[-1])
        worst["averaged"] = max(worst["averaged"], rel(g, averaged, names) / bounds[-1])
    how = next((h for h in ("summed", "averaged") if worst[h] <= 1), None)
    if how is None:
        return None
    d = next(iter(experts.values()))
    return (f"the expert parameters {', '.join(sorted(experts))} (declared sharded over the expert-parallel ranks "
            f"{d['groups'][0]}) hold on every rank the {'sum' if how == 'summed' else 'mean'} over the group of "
            "every expert's gradient one process gives (at every recorded step, within the gradient's bound: "
            f"worst {worst[how]:.2g} of it): the expert gradients were reduced over the expert-parallel group "
            "like replicated ones, which mixes different experts' gradients into each; an expert's gradient "
            "already holds every rank's tokens (the all_to_all's backward), so leave the expert parameters out "
            "of the dense parameters' all-reduce (reduce them only over ranks that hold the same experts)")


def _check_pipeline(rec: A.RecordingSet, ref: ReferenceSet, lay: dict) -> Check:
    """A pipeline's stages: every parameter of the whole model recorded by a stage (by several where they
    keep copies of one under its name, a tie: tied.py compares the copies)."""
    per = lay.get("stage_params", [])
    seen = {n: r for r in reversed(range(len(per))) for n in per[r]}
    shared = shared_copies(lay)
    k = rec.tensor_steps()[0]
    missing = sorted(set(ref.tensors(k, A.GRAD)) - set(seen))
    if missing:
        return Check("layout", False, f"no stage records {', '.join(missing[:3])}, which the whole model has: "
                                      "pass each stage's module to its rank's Recorder")
    pp = lay["pipeline"]
    copies = "; ".join(f"{n} by the stages of ranks {', '.join(map(str, rs))}" for n, rs in shared.items())
    return Check("layout", True, f"pipeline of {pp['stages']} stages (stage of each rank: {pp['stage_of_rank']}): "
                                 f"the {len(seen)} parameters recorded by their stages and merged by name"
                                 + (f" (held under one name by several stages, each copy compared with the first "
                                    f"holder's: see ranks: {copies})" if shared else "")
                                 + "; stage 0's forwards are the micro-batches (the others' inputs are activations)")


def check_layout(rec: A.RecordingSet, ref: ReferenceSet) -> Check | None:
    """The layout check (module docstring); None for a recording without a layout."""
    lay = rec.recorded.layout
    if not lay:
        return None
    groups, params = lay["groups"], lay["params"]
    if lay.get("pipeline"):
        return _check_pipeline(rec, ref, lay)
    if lay.get("context_parallel"):
        return _check_context_parallel(rec, ref, lay)
    tp, dp = max(len(g) for g in groups), len(groups)
    decl = lay.get("declared") or {}
    ep = max((len(g) for d in decl.values() if d.get("parallel") == "expert" for g in d.get("groups", [])),
             default=None)
    finding = _peer_inputs(rec, groups) or _unreduced(rec, ref, groups, params) or \
        _experts_mixed(rec, ref, params, decl) or _class_factor(rec, ref, params, tp, dp, ep) or \
        _replicated_factor(rec, ref, params, tp)
    if finding:
        return Check("layout", False, finding)
    n_split = sum(1 for v in params.values() if v.get("model_parallel"))
    if decl:
        said = "; ".join(f"{p!r} along dim {d['dim']} over ranks {' and '.join(map(str, d['groups']))} "
                         f"({d['parallel']} parallel)" for p, d in decl.items() if d.get("groups"))
        return Check("layout", True, f"declared sharding ({said or 'every parameter replicated'}): {n_split} of "
                                     f"{len(params)} parameters assembled from their ranks' pieces, the rest "
                                     f"replicated; {dp} data-parallel replica(s) of {tp} tensor-parallel rank(s); "
                                     "neither class of parameters is off from one process's gradient by a constant "
                                     "factor while the other agrees" + (", and every TP rank of a replica read its "
                                                                        "leader's rows" if tp > 1 else ""))
    ms = list({tuple(zip(m["names"], m["shape"])): 0 for m in lay["meshes"]})  # each mesh once, in order
    ms = [m for m in ms if not any(set(m) < set(o) for o in ms)]  # a sub-mesh (dp of dp x tp) named by its whole
    meshes = "; ".join(" x ".join(f"{nm} {s}" for nm, s in m) for m in ms)
    return Check("layout", True, f"DTensor layout read from the parameters (mesh {meshes}; data dimensions "
                                 f"{', '.join(lay['data_dims']) or 'none'}): {dp} data-parallel replica(s) of {tp} "
                                 f"model-parallel rank(s); {n_split} of {len(params)} parameters split over a "
                                 "model-parallel dimension, assembled with full_tensor(); every TP rank of a replica "
                                 "read its leader's rows, and every gradient is equal on the ranks of each TP group")


# ---------------------------------------------------------------------------------------------- context parallel

POSITION_KEYS = ("position_ids", "positions", "pos")


def _cp_inputs(rec: A.RecordingSet, groups: list[list[int]], cp: dict) -> str | None:
    """The first CP peer whose inputs are not its shard of its leader's global rows (per-row tensors: equal), as
    a sentence; None when every peer's are."""
    dim, order = cp["seq_dim"], cp["order"]
    for k in rec.steps:
        for group in groups:
            lead = group[0]
            lt = rec.step_tensors(lead, k)
            n = rec.step_meta(lead, k).get("micro_batches", 0)
            for i, r in enumerate(group):
                if r == lead:
                    continue
                pt = rec.step_tensors(r, k)
                pn = rec.step_meta(r, k).get("tp_micro_batches", 0)
                where = f"at step {k} rank {r}, CP rank {i} of group {group},"
                if pn != n:
                    return (f"{where} ran {pn} micro-batches where its leader rank {lead} ran {n}: the ranks of a CP "
                            "group compute one forward together and must run the same micro-batches")
                for m in range(n):
                    a = A.prefixed(A.micro_input(m), lt)
                    b = A.prefixed(A.micro_input(m, A.TP_INPUT), pt)
                    for key in sorted(set(a) | set(b)):
                        if key not in a or key not in b:
                            return (f"{where} fed {key!r} where rank {lead} did not (micro-batch {m}), or the other "
                                    "way round: the ranks of a CP group must feed their forwards the same inputs")
                        want = a[key]
                        if want.dim() > dim and b[key].dim() == want.dim() and want.shape[dim] % (len(group) * 2
                                                                                               if order != "contiguous" else len(group)) == 0:
                            want = cp_split(want, dim, len(group), order)[i]
                        if want.shape != b[key].shape or not torch.equal(want, b[key]):
                            return (f"{where} holds an input {key!r} (micro-batch {m}) that is not its {order} shard "
                                    f"of the group's global rows along dim {dim} (shape {tuple(b[key].shape)}): the "
                                    "ranks of a CP group must hold the same rows, each its own part of every row's "
                                    "sequence (and the same per-row tensors)")
    return None


def _cp_positions(rec: A.RecordingSet, groups: list[list[int]], cp: dict) -> str | None:
    """The global rows' positions against the declared order, as a sentence where they say the shards were not
    shifted to their place in the sequence or were cut in another order; None otherwise (positions not
    recorded, or increasing by one along each row, or packed sequences that restart inside a shard)."""
    dim, order, n = cp["seq_dim"], cp["order"], cp["size"]
    for k in rec.steps:
        for lead in (g[0] for g in groups):
            t = rec.step_tensors(lead, k)
            for m in range(rec.step_meta(lead, k).get("micro_batches", 0)):
                key = next((key for key in POSITION_KEYS if A.micro_input(m) + key in t), None)
                if key is None:
                    continue
                pos = t[A.micro_input(m) + key]
                if pos.dim() <= dim or pos.is_floating_point():
                    continue
                pos = pos.movedim(dim, -1).reshape(-1, pos.shape[dim]).long()
                if bool((pos[:, 1:] - pos[:, :-1] == 1).all()):
                    continue
                where = f"at step {k} the global rows of the CP group led by rank {lead} (micro-batch {m})"
                shards = cp_split(pos, 1, n, order)
                if n > 1 and all(torch.equal(s, shards[0]) for s in shards[1:]):
                    return (f"{where} hold {key} that restart at every rank's shard ({key} of each shard "
                            f"{shards[0][0, :6].tolist()}...): the positions (and the rotary offsets) were not "
                            "shifted to each shard's place in the sequence, so every rank's tokens are encoded as the "
                            "sequence's first ones; shift each shard's positions by its offset (load balanced: each "
                            "chunk by its own). Documents packed so that each starts exactly at a shard's start "
                            "restart there too: such a run needs a document-masked attention, which one process "
                            "computes only from the same positions and mask (record them, or cut the shards apart)")
                pieces = cp_split(pos, 1, n, order)  # each rank's shard, as recorded
                for other in ("contiguous", "load_balanced"):
                    j = cp_join(pieces, 1, other) if other != order else None
                    if j is not None and bool((j[:, 1:] - j[:, :-1] == 1).all()):
                        return (f"{where} hold {key} out of order: assembled as declared ({order}: rank i holding "
                                f"chunk(s) {cp_chunks(n, order)} of the sequence) they are not each token's place, "
                                f"but they are in the {other} cut (rank i holding chunk(s) {cp_chunks(n, other)}): the "
                                f"loop cut the sequence {other} and declared {order}, so one process reads the "
                                "sequence in another order than the fleet computed on (declare the order the loop cuts)")
                parts = pos.chunk(2 * n, 1)
                starts = [int(x[0, 0]) for x in parts]
                by_start = sorted(range(len(parts)), key=lambda i: starts[i])
                fixed = torch.cat([parts[i] for i in by_start], 1)
                if bool((fixed[:, 1:] - fixed[:, :-1] == 1).all()):
                    return (f"{where} hold {key} out of order when their shards are assembled as declared ({order}): "
                            f"the global row's {2 * n} chunks start at positions {starts}: the shards were cut (or "
                            "reassembled) in another order than the declared one, so one process reads the sequence "
                            "in another order than the fleet computed on")
    return None


def _check_context_parallel(rec: A.RecordingSet, ref: ReferenceSet, lay: dict) -> Check:
    """A context-parallel recording (record/layouts.py's ContextParallelLayout): the CP peers held their
    shards of the leader's global rows; the global rows' positions agree with the declared order; every
    rank's gradient is the group's (all-reduced over the CP group); no constant factor."""
    cp, groups, params = lay["context_parallel"], lay["groups"], lay["params"]
    size, dp = cp["size"], len(groups)
    finding = _cp_inputs(rec, groups, cp) or _cp_positions(rec, groups, cp) or \
        _unreduced(rec, ref, groups, params, kind="CP") or _class_factor(rec, ref, params, size, dp, kind="CP")
    if finding:
        return Check("layout", False, finding)
    return Check("layout", True, f"context parallel ({cp['order']} order along dim {cp['seq_dim']}): {dp} data-parallel "
                                 f"replica(s) of {size} CP rank(s); every CP rank held its shard of its leader's "
                                 "global rows, which one process reads whole; every gradient is equal on the ranks "
                                 "of each CP group (all-reduced over it), and none is off from one process's by a "
                                 "constant factor")
