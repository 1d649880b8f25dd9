"""Fact: every rank holds the same model.

Every recording (dormouse's own fleet's too):

ranks         every rank's parameters equal before every step and after the
              last (sha256); under FSDP2 each shard exists once (said so);
              every micro-batch of a step under one autocast (or none).
"""

from __future__ import annotations

import math

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.metrics import relative
from dormouse.gate.judge.verdict import Check
from dormouse.numerics import same_value


def _autocast_words(state: tuple) -> str:
    a, cast = state
    words = "no autocast" if a is None else f"{a['device_type']} {a['dtype']} autocast"
    return words + (f" on parameters cast to {cast}" if cast else "")



def _precision_split(rec: A.RecordingSet) -> str | None:
    """Where a rank's micro-batches ran in other precisions than rank 0's
    same micro-batches (one rank without the others' autocast, or on
    parameters cast otherwise): the sentence that says so, else None. A
    pattern every rank follows alike (the first micro-batch under autocast
    on each) is the fleet's own, and the reference mirrors it."""
    for k in rec.steps:
        states = [[(rec.autocast(r, k, m), rec.compute_dtype(r, k, m))
                   for m in range(rec.step_meta(r, k).get("micro_batches", 0))] for r in range(rec.world_at(k))]
        for r, st in enumerate(states):
            for m, a in enumerate(st):
                want = states[0][m] if m < len(states[0]) else states[0][-1] if states[0] else a
                if a != want:
                    return (f"at step {k} rank {r} ran micro-batch {m} under {_autocast_words(a)}, rank 0 under "
                            f"{_autocast_words(want)}: the fleet's ranks do not compute in one precision")
    return None



def _mode_split(rec: A.RecordingSet) -> str | None:
    """Where a micro-batch ran other submodules in eval mode than rank 0's
    first micro-batch of the step (whose modes the reference sets): the
    sentence that says so, else None."""
    for k in rec.steps:
        want = set(rec.eval_modules(k))
        for r in range(rec.world_at(k)):
            for m in range(rec.step_meta(r, k).get("micro_batches", 0)):
                got = set(rec.eval_modules(k, r, m))
                if got != want:
                    words = lambda s: ", ".join(n or "the model itself" for n in sorted(s)) or "none"  # noqa: E731
                    return (f"at step {k} rank {r}'s micro-batch {m} ran other submodules in eval mode ({words(got)}) "
                            f"than rank 0's first ({words(want)}): the fleet's ranks do not run one network")
    return None



# forward keywords that describe the micro-batch's own rows, not the network: transformers' flash-attention
# metadata of a packed, padding-free batch (its longest sequence), which TRL's collator passes as ints. They
# differ between ranks as the rows do; the reference passes each micro-batch its own.
BATCH_METADATA = ("max_length_q", "max_length_k")


def _network_call(x):
    """A micro-batch's recorded non-tensor forward arguments without BATCH_METADATA."""
    return {n: v for n, v in x.items() if n not in BATCH_METADATA} or None if isinstance(x, dict) else x


def _call_split(rec: A.RecordingSet) -> str | None:
    """Where a rank's micro-batch got other non-tensor forward arguments or ran
    with other plain attributes than rank 0's same micro-batch (a branch switch
    one rank sets alone): the sentence that says so, else None. As with the
    precision, a pattern every rank follows alike is the fleet's own, and the
    reference reproduces it micro-batch by micro-batch."""
    for k in rec.steps:
        for key, what in (("call", "non-tensor forward arguments"), ("attrs", "plain attributes")):
            states = [[(_network_call(x) if key == "call" else x) or None for x in (rec.step_meta(r, k).get(key) or [])][
                :rec.step_meta(r, k).get("micro_batches", 0)] for r in range(rec.world_at(k))]
            for r, st in enumerate(states):
                for m, a in enumerate(st):
                    want = states[0][m] if m < len(states[0]) else states[0][-1] if states[0] else a
                    if not same_value(a, want):
                        return (f"at step {k} rank {r}'s micro-batch {m} ran with other {what} ({a}) than rank 0's "
                                f"same micro-batch ({want}): the fleet's ranks do not run one network (a branch "
                                "one rank switches alone)")
    return None



def _start_split(rec: A.RecordingSet) -> tuple[int, str] | None:
    """Where a rank's modules held other plain attributes than rank 0's when
    its Recorder started (each segment's first step keeps them as
    "attrs_start"; a step's "attrs" are only the changes from them): an
    attribute one rank set before recording (a dropout's p, a flag) is a
    network of its own. (the step, the words "rank r's module m has name =
    value, rank 0's value"), else None. A pipeline's stages are other
    modules; elsewhere only the modules both ranks hold are compared."""
    if (rec.recorded.layout or {}).get("pipeline"):
        return None
    for k in rec.steps:
        starts = [rec.step_meta(r, k).get("attrs_start") for r in range(rec.world_at(k))]
        if starts[0] is None:
            continue
        for r, got in enumerate(starts[1:], 1):
            for path in sorted(set(starts[0]) & set(got or {})):
                mine, theirs = starts[0].get(path, {}), (got or {}).get(path, {})
                for name in sorted(set(mine) | set(theirs)):
                    if not same_value(mine.get(name, "absent"), theirs.get(name, "absent")):
                        where = f"module {path!r}" if path else "model"
                        return k, (f"rank {r}'s {where} has {name} = {theirs.get(name, 'absent')!r}, rank 0's "
                                   f"{mine.get(name, 'absent')!r} (set before the Recorder started)")
    return None


def _which(rec: A.RecordingSet, k: int, r: int) -> str:
    """The tensors rank r holds apart from rank 0's before step k, the one that
    differs most first (the tensor that went apart, not those it dragged
    along); "" under sketches (each rank's own projection is not compared)."""
    if rec.sketch:
        return ""
    mine, theirs = rec.step_tensors(0, k), rec.step_tensors(r, k)
    keys = [n for n in mine if n.startswith((A.PARAM, A.BUFFER)) and (n not in theirs or not torch.equal(mine[n], theirs[n]))]
    keys.sort(key=lambda n: -relative(theirs[n], mine[n]) if n in theirs else -math.inf)
    return f": {', '.join(n.split('/', 1)[1] for n in keys[:3])}" + (", ..." if len(keys) > 3 else "") if keys else ""


def _which_final(rec: A.RecordingSet, r: int) -> str:
    """_which for the state after the last step (final.safetensors): "" under sketches."""
    if rec.sketch:
        return ""
    mine = _read(A.final_tensors_path(rec.out, 0), (A.PARAM, A.BUFFER))
    theirs = _read(A.final_tensors_path(rec.out, r), (A.PARAM, A.BUFFER))
    keys = [n for n in mine if n not in theirs or not torch.equal(mine[n], theirs[n])]
    keys.sort(key=lambda n: -relative(theirs[n], mine[n]) if n in theirs else -math.inf)
    return f": {', '.join(n.split('/', 1)[1] for n in keys[:3])}" + (", ..." if len(keys) > 3 else "") if keys else ""


# what every replica of a data-parallel step holds alike, compared rank by rank (never read from rank 0 alone)
SAME_ON_EVERY_RANK = ("clip_coef", "grad_norm", "lr", "no_grad")


def _read(path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys() if n.startswith(prefixes)}


def replica_apart(out, step: int, metas: list[dict]) -> str | None:
    """Where a rank's copy of what every replica must hold alike at `step` (the
    synchronised gradient, full A.GRAD or sketched A.SKETCHED_GRAD, the clip coefficient and
    norm, the lr, the parameters without a gradient) differs from rank 0's: the
    sentence naming the rank, the step and the tensor, else None. The tensors
    themselves are compared, whatever the hashes beside them say."""
    hashes = [m.get("grad_hash") for m in metas]
    if not metas[0].get("tensors", True) and all(h is None for h in hashes):
        return _scalars_apart(step, metas)
    base = _read(A.step_tensors_path(out, 0, step), (A.GRAD, A.SKETCHED_GRAD))
    for r in range(1, len(metas)):
        mine = _read(A.step_tensors_path(out, r, step), (A.GRAD, A.SKETCHED_GRAD))
        apart = [n for n in sorted(set(base) | set(mine))
                 if n not in base or n not in mine or not torch.equal(base[n], mine[n])]
        if apart or hashes[r] != hashes[0]:
            def factor(n):
                a, b = mine.get(n), base.get(n)
                if a is None or b is None or float(b.double().norm()) == 0:
                    return None
                return float((a.double() * b.double()).sum() / b.double().norm() ** 2)

            factors = {n: factor(n) for n in apart}

            def ratio(n):
                return "" if factors[n] is None else f" (x{factors[n]:.6g})"
            # the tensors whose ratio is not the one most share first: a tensor left out of the reduce is named
            # before the others, which the ranks' clip coefficients (each rank clipping by its own norm) move alike
            known = sorted(c for c in factors.values() if c is not None)
            common = known[len(known) // 2] if known else None
            if common is not None:
                apart.sort(key=lambda n: -abs((factors[n] if factors[n] is not None else 0.0) - common))
            alike = sum(1 for c in known if common and abs(c / common - 1) <= 1e-6)
            words = ", ".join(n.split("/", 1)[1] + ratio(n) for n in apart[:3]) + (", ..." if len(apart) > 3 else "")
            if common is not None and alike > len(apart) // 2 and abs(common - 1) > 1e-6 and alike < len(apart):
                words += f"; {alike} other tensor(s) x{common:.6g} alike (a clip coefficient apart: see clip)"
            elif common is not None and alike == len(apart) > 1 and abs(common - 1) > 1e-6:
                c0, cr = metas[0].get("clip_coef"), metas[r].get("clip_coef")
                by_clip = (isinstance(c0, float) and isinstance(cr, float) and c0 > 0 and c0 != cr
                           and abs(cr / c0 / common - 1) <= 1e-4)
                words += (f"; every one of the {alike} x{common:.6g} alike: one scalar apart "
                          + ("(each rank its own clip coefficient: see clip)" if by_clip else
                             f"(rank {r} scaled its whole gradient by {common:.6g} after the reduce, not by a clip "
                             "coefficient)"))
            return (f"at step {step} rank {r}'s synchronised gradient differs from rank 0's"
                    + (f": {words}" if apart else " by its recorded hash") + " (every replica must hold the same "
                    "reduced gradient: a rank that changed its copy after the reduce, or a recording edited since)")
    return _scalars_apart(step, metas)


def _scalars_apart(step: int, metas: list[dict]) -> str | None:
    for key in SAME_ON_EVERY_RANK:
        vals = [m.get(key) for m in metas]
        for r, v in enumerate(vals[1:], 1):
            if not same_value(v, vals[0]):
                why = ("each rank reports a norm of its own (see clip)" if key == "grad_norm" else
                       "the replicas part")
                return f"at step {step} rank {r}'s {key} is {v!r}, rank 0's {vals[0]!r}: {why}"
    return None


def check_ranks(rec: A.RecordingSet, training_ok: bool = False) -> Check:
    """Every rank one network, one state. training_ok: the gradient, loss and replay agree with one process,
    whose reference ran every rank's micro-batches at rank 0's start attributes (rebuild's start_attrs):
    then an attribute only one rank started with is one the computation does not read, said and not
    failed (a flag like is_main); without that agreement it is the cause named."""
    apart = _start_split(rec)
    start = unread = ""
    if apart and training_ok:
        unread = (f"; {apart[1]}: not read by what the fleet computed (gradient, loss and replay, computed one "
                  "process's way at rank 0's value, agree)")
    elif apart:
        start = f"from step {apart[0]} {apart[1]}: the fleet's ranks do not run one network"
    split = _precision_split(rec) or _mode_split(rec) or start or _call_split(rec)
    if split:
        return Check("ranks", False, split)
    c = _ranks_state(rec)
    if unread and c.passed:
        c.reason += unread
    return c


def _ranks_state(rec: A.RecordingSet) -> Check:
    if rec.recorded.fsdp:
        return Check("ranks", True, "FSDP2: each rank holds its own shard (each parameter exists once); the "
                                    "assembled tensors are what the other checks judge")
    if (rec.recorded.layout or {}).get("pipeline"):  # judge/facts/layouts.py: each stage's parameters exist once
        return Check("ranks", True, "pipeline: each rank holds its own stage's parameters (each exists once); "
                                    "merged by name, they are what the other checks judge")
    tensor_steps = set(rec.tensor_steps())
    for k in rec.steps:  # step by step: the first place the replicas part (a gradient changed after the reduce at
        if k in tensor_steps:  # step k is named there, not as the parameters it moves apart before step k + 1)
            hashes = [rec.step_meta(r, k).get("param_hash") for r in range(rec.world_at(k))]
            bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
            if bad:
                return Check("ranks", False, f"rank {bad[0]}'s parameters or persistent buffers differ from rank 0's "
                                             f"before step {k}" + _which(rec, k, bad[0]))
        if not rec.recorded.layout:  # replicas (DDP): every rank's copy, rank by rank
            apart = replica_apart(rec.out, k, [rec.step_meta(r, k) for r in range(rec.world_at(k))])
            if apart:
                return Check("ranks", False, apart)
    w = rec.world_at(rec.steps[-1])
    finals = [A.read_json(A.final_meta_path(rec.out, r), "final").get("param_hash") for r in range(w)]
    bad = [r for r, h in enumerate(finals) if h != finals[0]]
    if bad:
        return Check("ranks", False, f"rank {bad[0]}'s parameters or persistent buffers differ from rank 0's after "
                                     f"the last step (step {rec.steps[-1]})" + _which_final(rec, w and bad[0]))
    if rec.recorded.layout:  # a model-parallel group's ranks hold parts: their gradients are the layout line's
        return Check("ranks", True, "every rank's parameters and persistent buffers are equal before every "
                                    "recorded step and after the last (by hash); the gradients the ranks of a "
                                    "model-parallel group hold are compared in the layout line")
    return Check("ranks", True, "every rank's parameters and persistent buffers are equal before every "
                                "recorded step and after the last, and every rank's synchronised gradient and clip "
                                "at every step")
