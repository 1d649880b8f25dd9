"""The reference-free checks' one rule, on numbers a recording holds: the
Recorder applies it inside the run (`RecordingSpec(selfcheck=k)`, `stop_on_fail`)
and the judge applies it to the recording (judge/facts/reduction.py,
`gate check --follow`); neither has a copy of its own.

The reduction is linear: every element of the synchronised gradient is the
reduction (mean or sum over the ranks, times the clip coefficient where the
loop clipped first) of that element of the ranks' local gradients. Each step,
every rank reads the same k elements of each tensor (`sample_indices`: drawn
from one shared seed and the step; every element of a tensor of at most k) from its local gradient before the reduce and from the
synchronised one after it. What a wrong reduction does then shows tensor by
tensor at k numbers per tensor per rank: a factor (W: summed, not averaged), a
tensor not reduced (equal to the rank's own gradient: a missing all-reduce, a
dropped bucket), a wire rounding beyond the declared one (bfloat16). It checks
the reduction, not the normalisation (how the loss was divided before the
backward is the reference's business). Reading k elements costs O(k) a tensor,
whatever its size: the check can stay on for a whole run.

The bound, element by element. The local gradient is the float sum of its
micro-batches' contributions (K of them, and what .grad held before); the
Recorder sums the same contributions in float64 and keeps beside them the sum
of their magnitudes A_r. The synchronised element is a float reduction of W
such sums (each summand rounded to the wire's unit u_w where it is bfloat16),
then scaled (1/W, the clip coefficient c). So
|sync - c red(local)| <= g u c red(A), g = W u_w / u + K + 4,
with u the gradient's unit round-off and red the mean (or sum) over ranks:
a rounding at each of at most W + K + 4 operations, each bounded by the
magnitudes it adds.
"""

from __future__ import annotations

import math

import torch

from dormouse.numerics import BF16_UNIT_ROUNDOFF, FP32_UNIT_ROUNDOFF

UNIT = {"float64": 2.0**-53, "float32": FP32_UNIT_ROUNDOFF, "bfloat16": BF16_UNIT_ROUNDOFF, "float16": 2.0**-11}
WIRE_UNIT = {"fp32": FP32_UNIT_ROUNDOFF, "bf16": BF16_UNIT_ROUNDOFF}
REDUCTIONS = ("mean", "sum")


def sample_indices(names: list[str], numel: dict[str, int], k: int, seed: int, step: int) -> dict[str, torch.Tensor]:
    """The elements of each tensor (flat global index) the checks read at `step`:
    every one of a tensor of at most k elements, else k drawn uniformly, all
    tensors' at once from (seed, step) (every rank draws the same)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919) % (2**63))
    u = torch.rand(len(names), k, generator=g, dtype=torch.float64)
    return {n: (torch.arange(numel[n]) if numel[n] <= k else (u[i] * numel[n]).long().clamp_(max=numel[n] - 1))
            for i, n in enumerate(names)}


def _norm(x: torch.Tensor) -> float:
    return float(x.double().norm())


def _red(xs: list[torch.Tensor], reduction: str) -> torch.Tensor:
    t = sum(x.double() for x in xs)
    return t / len(xs) if reduction == "mean" else t


def reduction_finding(name: str, got: torch.Tensor, locals_: list[torch.Tensor], mags: list[torch.Tensor],
                      own: torch.Tensor | None, *, micro: int, dtype: str, wire: str, reduction: str,
                      clip: float | None) -> str | None:
    """None when `got` (tensor `name`'s sampled elements of the synchronised
    gradient) is the reduction of `locals_` (each rank's same elements of its
    local gradient; `mags` their magnitudes' sums) within the bound; else the
    cause in words. `own`: this rank's own local elements (None: FSDP2's shards)."""
    world = len(locals_)
    c = 1.0 if clip is None else float(clip)
    want = _red(locals_, reduction) * c
    got = got.double()
    u = UNIT.get(dtype, 2.0**-24)
    g = world * max(u, WIRE_UNIT.get(wire, u)) / u + micro + 4
    tol = g * u * (_red(mags, reduction) * c + got.abs()) + 1e-300
    off = (got - want).abs()
    if bool((off <= tol).all()):
        return None
    worst = float((off / tol).max())
    rel = _norm(got - want) / max(_norm(want), 1e-300)
    if own is not None and world > 1:
        mine = own.double() * c
        if bool(((got - mine).abs() <= tol).all()) and not bool(((mine - want).abs() <= tol).all()):
            return f"{name} not reduced: equal to this rank's own gradient (a missing all-reduce, or a dropped bucket)"
    ww = _norm(want) ** 2
    if ww > 0:
        f = float((got * want).sum()) / ww
        if bool(((got - f * want).abs() <= tol + 1e-3 * got.abs()).all()):
            what = (" = the world size: summed, not averaged" if world > 1 and abs(f - world) < 1e-3 * world else
                    " = 1 / the world size: divided by it once more" if world > 1 and abs(f * world - 1) < 1e-3 else "")
            return f"{name} reduced times {f:.6g}{what}"
    if wire == "fp32" and rel < 2.0**-6:
        return (f"{name} off the reduction by {rel:.2g} ({worst:.3g} x the float32 bound at worst): rounded beyond "
                "float32 on the wire (a bfloat16 compress hook? declare wire='bf16')")
    return f"{name} off the reduction by {rel:.3g} ({worst:.3g} x its bound at worst)"


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


def _all_within(local, mags, sync, params, *, names, dtype, micro, clips, wire, reduction, sharded) -> bool:
    """Whether every tensor passes reduction_finding's bound and the replicas agree,
    tested on all tensors' elements at once (the rule's arithmetic, vectorised):
    True lets step_findings skip the tensor-by-tensor pass that names causes."""
    world = len(local)
    names = [n for n in names if any(n in s for s in sync)]
    if not names or any(n not in s for s in sync for n in names) and not sharded:
        return False
    sizes = [next(s[n] for s in sync if n in s).numel() for n in names]

    def cat(d, n_=names):
        return torch.cat([d[n].double() if n in d else torch.zeros(m, dtype=torch.float64) for n, m in zip(n_, sizes)])

    u = torch.repeat_interleave(torch.tensor([UNIT.get(dtype.get(n, "float32"), 2.0**-24) for n in names],
                                             dtype=torch.float64), torch.tensor(sizes))
    ps = [torch.cat([p[n].double() for n in names if n in p]) for p in params] if params and all(params) else None
    return all_within(torch.stack([cat(x) for x in local]), torch.stack([cat(x) for x in mags]),
                      torch.stack([cat(x) for x in sync]), ps, u=u, micro=micro, clips=clips, wire=wire,
                      reduction=reduction, sharded=sharded)


def all_within(loc: torch.Tensor, mag: torch.Tensor, syn: torch.Tensor, params, *, u: torch.Tensor, micro: int,
               clips: list, wire: str, reduction: str, sharded: bool) -> bool:
    """_all_within on every tensor's elements laid end to end: (W, S) float64 rows of
    the ranks' local elements, their magnitudes and their synchronised elements
    (zeros where a rank has none), `params` the ranks' parameter elements (None:
    not compared), `u` each element's unit round-off. The Recorder calls it on the
    rows it gathered as they are, with no pass tensor by tensor."""
    world = loc.shape[0]
    g = world * torch.clamp(WIRE_UNIT.get(wire, 2.0**-24) / u, min=1.0) + micro + 4
    red, redmag = loc.sum(0), mag.sum(0)
    if reduction == "mean":
        red, redmag = red / world, redmag / world
    gots = syn.sum(0, keepdim=True) if sharded else syn
    for r in range(gots.shape[0]):
        c = 1.0 if clips[r] is None else float(clips[r])
        got = gots[r]
        if not bool(((got - red * c).abs() <= g * u * (redmag * c + got.abs()) + 1e-300).all()):
            return False
    if not sharded and any(not torch.equal(gots[0], gots[r]) for r in range(1, world)):
        return False
    if not sharded and params is not None and any(not torch.equal(params[0], x) for x in params[1:]):
        return False
    return True


def step_findings(local: list[dict], mags: list[dict], sync: list[dict], params: list[dict], *, names: list[str],
                  dtype: dict, micro: int, clips: list, wire: str, reduction: str, sharded: bool,
                  losses: list[tuple] | None = None, within: bool | None = None) -> list[str]:
    """Every finding of one step from every rank's sampled elements ({name: k
    numbers}): `local` their local gradients' (`mags`: their contributions'
    magnitudes summed), `sync` their synchronised gradients' (under FSDP2,
    `sharded`, each rank's shard's elements, zero elsewhere: summed over the
    ranks), `params` their parameters' (replicas: the elements and a checksum); `clips`: each rank's clip coefficient (None: not
    clipped before the sketch); `losses`: each rank's (logged loss, loss sum, token
    count), None where a rank passed none. The Recorder (every rank, from the
    gathered sketches) and the judge (from the recording) call this alike."""
    world = len(local)
    if within is None:  # the usual step: one pass over every tensor at once (the caller's, where it ran it)
        within = _all_within(local, mags, sync, params, names=names, dtype=dtype, micro=micro, clips=clips, wire=wire,
                             reduction=reduction, sharded=sharded)
    if within:
        names = []
    findings = []
    for n in names:
        have = [n in s for s in sync]
        if not any(have):
            continue
        z = torch.zeros_like(next(s[n] for s in sync if n in s), dtype=torch.float64)
        locs, ms = [x.get(n, z) for x in local], [x.get(n, z) for x in mags]
        common = dict(micro=micro, dtype=dtype.get(n, "float32"), wire=wire, reduction=reduction)
        if sharded:
            f = reduction_finding(n, sum(s.get(n, z) for s in sync), locs, ms, None, clip=clips[0], **common)
        else:
            f = None
            for r in range(world):
                if have[r]:
                    f = reduction_finding(n, sync[r][n], locs, ms, locs[r], clip=clips[r], **common)
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
