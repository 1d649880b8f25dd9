"""The reference-free checks' one rule, on numbers a recording holds: the
Recorder applies it inside the run (`Recorder(selfcheck=k)`, `stop_on_fail`)
and the judge applies it to the recording (judge/facts/reduction.py,
`gate check --follow`); neither has a copy of its own.

A CountSketch S (record/sketch.py) is linear: the sketch of the synchronised
gradient equals the reduction (mean or sum over ranks, times the clip
coefficient where the loop clipped first) of the ranks' sketches of their
local gradients, each taken with one shared seed before the reduce. What a
wrong reduction does then shows tensor by tensor at k numbers per tensor
per rank: a factor (W: summed, not averaged), a tensor not reduced (equal to
the rank's own gradient: a missing all-reduce, a dropped bucket), a wire
rounding beyond the declared one (bfloat16 on the wire). It checks the
reduction, not the normalisation (how the loss was divided before the
backward is the reference's business).

The bound. Let e be the elementwise difference between the synchronised
gradient and the exact reduction of the ranks' local gradients. Each element
of e is a rounding of at most W summands of the reduce, K micro-batches'
accumulation and a few scalings: |e_i| <= g u a_i with g = W + K + 4 (W the
wire's unit round-off u_w instead of u where declared) and a the elementwise
mean of the ranks' |local gradient|. A bucket of the sketch sums n_j of the
n elements, so |(S e)_j| <= sum_{i in j} |e_i| and by Cauchy-Schwarz
||S e|| <= sqrt(max_j n_j) ||e|| <= sqrt(max_j n_j) g u ||a||, with
||a|| <= mean_r ||local_r||. Buckets are drawn uniformly: max_j n_j <=
2 n / k + 16 except with negligible probability for the sizes sketched, and
||local_r|| <= 2 ||S local_r|| (E||S x||^2 = ||x||^2, Var <= 2 ||x||^4 / k).
The sketches themselves are summed in float64 (record/selfcheck.py) or
float32 chunks of 2^14 elements (the Sketcher): their own round-off, at most
2^14 u of the bucket's absolute sum, is inside the same bound's margin only
for float64; the Recorder's self-check sketches in float64.
"""

from __future__ import annotations

import math

import torch

UNIT = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
WIRE_UNIT = {"fp32": 2.0**-24, "bf16": 2.0**-8}
REDUCTIONS = ("mean", "sum")


def _norm(x: torch.Tensor) -> float:
    return float(x.double().norm())


def bound(numel: int, k: int, world: int, micro: int, dtype: str, wire: str, local_norm: float) -> float:
    """The largest ||S e|| the float round-off of a right reduction allows (module docstring)."""
    u = UNIT.get(dtype, 2.0**-24)
    g = world * max(u, WIRE_UNIT.get(wire, u)) + (micro + 4) * u
    return math.sqrt(2 * numel / k + 16) * g * 2 * local_norm


def reduction_finding(name: str, got: torch.Tensor, locals_: list[torch.Tensor], own: torch.Tensor | None, *,
                      numel: int, k: int, micro: int, dtype: str, wire: str, reduction: str,
                      clip: float | None) -> str | None:
    """None when `got` (the sketch of tensor `name`'s synchronised gradient) is the
    reduction of `locals_` (each rank's local sketch) within the bound; else the
    cause in words. `own`: the rank's own local sketch (None: not one rank's
    copy, FSDP2's assembled shards)."""
    world = len(locals_)
    want = sum(x.double() for x in locals_)
    if reduction == "mean":
        want = want / world
    if clip is not None:
        want = want * clip
    got = got.double()
    local_norm = max(sum(_norm(x) for x in locals_) / world, _norm(want), _norm(got))
    tol = bound(numel, k, world, micro, dtype, wire, local_norm)
    off = _norm(got - want)
    if off <= tol:
        return None
    rel = off / max(_norm(want), 1e-300)
    if own is not None and world > 1 and _norm(got - own.double() * (clip if clip is not None else 1.0)) <= tol \
            and _norm(own.double() - want) > tol:
        return f"{name} not reduced: equal to this rank's own gradient (a missing all-reduce, or a dropped bucket)"
    ww = _norm(want) ** 2
    if ww > 0:
        f = float((got * want).sum()) / ww
        if _norm(got - f * want) <= max(tol, 1e-3 * _norm(got)):
            what = (" = the world size: summed, not averaged" if abs(f - world) < 1e-3 * world and world > 1 else
                    " = 1 / the world size: divided by it once more" if world > 1 and abs(f * world - 1) < 1e-3 else
                    "")
            return f"{name} reduced times {f:.6g}{what}"
    if wire == "fp32" and rel < 2.0**-6:
        return (f"{name} off the reduction by {rel:.2g} (bound {tol / max(_norm(want), 1e-300):.2g}): rounded beyond "
                "float32 on the wire (a bfloat16 compress hook? declare wire='bf16')")
    return f"{name} off the reduction by {rel:.3g} (bound {tol / max(_norm(want), 1e-300):.2g})"


def replica_finding(what: str, sketches: list[torch.Tensor | None], name: str) -> str | None:
    """Where a replica's sketch of `name` differs from rank 0's (bitwise: replicas
    hold equal tensors, and one seed sketches them alike): the words, else None."""
    base = sketches[0]
    for r, s in enumerate(sketches[1:], 1):
        if (s is None) != (base is None) or (s is not None and not torch.equal(s, base)):
            ratio = ""
            if s is not None and base is not None and _norm(base) > 0:
                ratio = f" (x{float((s.double() * base.double()).sum()) / _norm(base) ** 2:.6g})"
            return f"rank {r}'s {what} {name} differs from rank 0's{ratio}"
    return None


def loss_finding(loss: float | None, sums: list[float], counts: list[float], micro: int) -> str | None:
    """The loss the loop logged against sum(loss sums) / sum(token counts) over
    the ranks (the float32 round-off of W + K + 4 operations allowed)."""
    if loss is None or not counts or sum(counts) <= 0:
        return None
    want = sum(sums) / sum(counts)
    tol = (len(sums) + micro + 4) * 2.0**-24 * max(abs(want), abs(loss)) + 1e-30
    if not math.isfinite(loss) or abs(loss - want) > tol:
        return (f"the logged loss {loss:.8g} is not the ranks' loss sum / token count {want:.8g} "
                f"({sum(sums):.8g} / {int(sum(counts))})")
    return None


def step_findings(local: list[dict], sync: list[dict], params: list[dict], *, names: list[str], numel: dict,
                  dtype: dict, k: int, micro: int, clips: list, wire: str, reduction: str, sharded: bool,
                  losses: list[tuple] | None = None) -> list[str]:
    """Every finding of one step from every rank's sketches ({name: k numbers}):
    `local` their local gradients', `sync` their synchronised gradients' (a
    shard's under FSDP2, `sharded`: summed over the ranks), `params` their
    parameters' (replicas); `clips`: each rank's clip coefficient (None: not
    clipped before the sketch); `losses`: each rank's (logged loss, loss sum, token
    count), None where a rank passed none. The Recorder (every rank, from the
    gathered sketches) and the judge (from the recording) call this alike."""
    world = len(local)
    z = torch.zeros(k, dtype=torch.float64)
    findings = []
    for n in names:
        have = [n in s for s in sync]
        if not any(have):
            continue
        locs = [x.get(n, z) for x in local]
        common = dict(numel=numel[n], k=k, micro=micro, dtype=dtype.get(n, "float32"), wire=wire,
                      reduction=reduction)
        if sharded:
            f = reduction_finding(n, sum(s.get(n, z) for s in sync), locs, None, clip=clips[0], **common)
        else:
            f = None
            for r in range(world):
                if have[r]:
                    f = reduction_finding(n, sync[r][n], locs, locs[r], clip=clips[r], **common)
                    if f:
                        f = f"rank {r}: {f}" if world > 1 else f
                        break
            f = f or replica_finding("synchronised gradient of", [s.get(n) for s in sync], n)
        if f:
            findings.append(f)
    if not sharded and params and all(params):
        for n in names:
            f = replica_finding("parameter", [p.get(n) for p in params], n)
            if f:
                findings.append(f)
                break
    if losses and all(x is not None and x[1] is not None and x[2] is not None for x in losses):
        f = loss_finding(losses[0][0], [x[1] for x in losses], [x[2] for x in losses], micro)
        if f:
            findings.append(f)
    return findings


def implied_clip(local: list[dict], sync: list[dict], names: list[str], reduction: str, sharded: bool) -> float | None:
    """The one factor <= 1 taking the reduction of the local sketches to the synchronised
    ones over every tensor (rank 0's copy; the shards' sum under FSDP2): a loop that
    clipped before rec.step without saying by how much (HF's Trainer: its norm comes
    with the log, after the step)."""
    num = den = 0.0
    world = len(local)
    for n in names:
        if not any(n in s for s in sync):
            continue
        want = sum(x[n].double() for x in local if n in x)
        if isinstance(want, int):
            continue
        want = want / world if reduction == "mean" else want
        got = sum(s[n].double() for s in sync if n in s) if sharded else sync[0].get(n)
        if got is None:
            continue
        num += float((got * want).sum())
        den += float((want * want).sum())
    c = num / den if den > 0 else None
    return c if c is not None and 0 < c <= 1 else None
