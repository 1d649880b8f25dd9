"""The probe check: where a parallel run parts from one process, module by
module (the recording side and the reference's: record/probe.py). Reads
artifacts only.

probe   at each probed step, for every DP replica leader's first micro-batch:
        - forward: each module's recorded output (a TP group's local pieces
          concatenated where their shape says they are shards) against one
          process's, in the order the fleet ran the modules; the bound of a
          module is FLOOR_MULTIPLE x its measured floor (the same output from
          parameters one ulp away), at least PROBE_RTOL. The FIRST module
          whose output departs is named, with the count of modules before it
          that agree.
        - backward (every forward agrees): the loop backpropagates its loss at
          a scale of its own (its normalisation), fitted on the model's own
          output gradient, c_r per rank; then each module's output gradient
          against c_r x one process's, in the order the gradients arrived. The
          first module in that order whose output gradient departs is named,
          with the last that agrees: the gradient parts in the backward of the
          modules between them.
        - the ranks' scales: c_r differing between ranks names the loss (one
          rank backpropagates another multiple of its loss); in a context-
          parallel group, each CP rank's scale on its own shard of the model's
          output, said to be 1 / the shard's token count where it is (each
          shard normalised by its own count, then averaged).
        When every module agrees on every rank the check passes and says that
        a gradient fault the other checks find lies after the backward (the
        reduction) or in the loss's normalisation, not in any module.
Tuple outputs are probed by their first tensor; modules whose output has no
counterpart of the same size in one process (a shard that does not assemble)
are listed as not compared."""

from __future__ import annotations

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.judge.verdict import Check
from dormouse.gate.judge.bounds import FLOOR_MULTIPLE, PROBE_RTOL, floor_bound
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.cpshards import cp_join, cp_split
from dormouse.gate.judge.metrics import rel


def _group(rec: A.RecordingSet, r: int) -> list[int]:
    lay = rec.recorded.layout or {}
    return next((g for g in lay.get("groups", []) if r in g), [r])


def _assemble(pieces: list[torch.Tensor], want: torch.Size, order: str = "contiguous") -> torch.Tensor | None:
    """The leader's piece, or the group's pieces concatenated along the one dimension where a piece is smaller
    (a context-parallel group's sequence shards in their declared order: facts/layouts.py's cp_join)."""
    if not pieces:  # the fleet never ran it (or recorded no output of it)
        return None
    a = pieces[0]
    if a.shape == want:
        return a
    if len(pieces) < 2 or a.dim() != len(want):
        return None
    dims = [d for d in range(a.dim()) if a.shape[d] != want[d]]
    if len(dims) != 1:
        return None
    full = torch.cat(pieces, dim=dims[0]) if order == "contiguous" else cp_join(pieces, dims[0], order)
    return full if full is not None and full.shape == want else None


def _scale(a: torch.Tensor, b: torch.Tensor) -> float:
    bb = float((b.double() ** 2).sum())
    return float((a.double() * b.double()).sum()) / bb if bb > 0 else 0.0


def _against(name: str, pieces: list[dict], prefix: str, ref: dict, nudged: dict, scale: float = 1.0,
             order: str = "contiguous"):
    """One module's recorded tensor (its pieces assembled) against one process's times `scale`, and its bound
    (FLOOR_MULTIPLE x the one-ulp copy's distance, at least PROBE_RTOL): (relative, bound), or None when the
    pieces do not assemble."""
    got = _assemble([p.get(f"{prefix}{name}") for p in pieces if f"{prefix}{name}" in p], ref[name].shape, order)
    if got is None:
        return None
    x = rel({name: got}, {name: ref[name].double() * scale}, [name])
    return x, floor_bound(rel({name: nudged[name]}, {name: ref[name]}, [name]), PROBE_RTOL)


def _one(rec: A.RecordingSet, ref: ReferenceSet, k: int, r: int) -> tuple[str | None, dict]:
    """Rank r's first micro-batch at step k: (a finding, or None; the figures)."""
    group = _group(rec, r)
    pieces = [rec.step_tensors(q, k) for q in group]
    cp = (rec.recorded.layout or {}).get("context_parallel") or {}
    order = cp.get("order", "contiguous")
    meta = rec.step_meta(r, k)
    ro, rn = ref.tensors(k, A.probe_prefix(r) + A.PROBE_REF_OUTPUT), ref.tensors(k, A.probe_prefix(r) + A.PROBE_NUDGED_OUTPUT)
    rg, rgn = ref.tensors(k, A.probe_prefix(r) + A.PROBE_REF_GRAD), ref.tensors(k, A.probe_prefix(r) + A.PROBE_NUDGED_GRAD)
    figures = {"forward": 0.0, "backward": 0.0, "skipped": [], "scale": None}
    whose = f"rank {r}'s first micro-batch" if len(group) == 1 else \
        f"the first micro-batch of the replica led by rank {r} ({'CP' if cp else 'TP'} group {group}, pieces assembled)"
    agree = 0
    for name in meta.get("probe_order", []):
        if name not in ro:
            continue
        compared = _against(name, pieces, A.PROBE_OUTPUT, ro, rn, order=order)
        if compared is None:
            figures["skipped"].append(name)
            continue
        x, bound = compared
        if x > bound:
            return (f"at step {k} on {whose} the first module whose forward output departs from "
                    f"one process's is {name} (relative {x:.2g}, bound {bound:.2g}); the {agree} module(s) before it "
                    "in execution order agree"), figures
        figures["forward"] = max(figures["forward"], x)
        agree += 1
    root = "(model)"
    if A.PROBE_GRAD + root not in pieces[0] or root not in rg:
        return None, figures
    g_root = _assemble([p[A.PROBE_GRAD + root] for p in pieces if A.PROBE_GRAD + root in p], rg[root].shape, order)
    if g_root is None:
        return None, figures
    c = _scale(g_root, rg[root])
    figures["scale"] = c
    if cp and len(group) > 1:  # each CP rank's own loss scale, on its shard of the model's output
        finding = _cp_scales(rec, k, r, group, pieces, rg[root], cp, whose)
        if finding:
            return finding, figures
    last = None
    for name in meta.get("probe_grad_order", []):
        if name not in rg:
            continue
        compared = _against(name, pieces, A.PROBE_GRAD, rg, rgn, scale=c, order=order)
        if compared is None:
            figures["skipped"].append(name)
            continue
        x, bound = compared
        if x > bound:
            where = (f"in the backward of the modules between {last} (the last whose output gradient agrees) and it"
                     if last else "at the model's own output (its loss)")
            return (f"at step {k} on {whose} every module's forward output agrees with one "
                    f"process's, but the gradient flowing into the output of {name} departs (relative {x:.2g}, bound "
                    f"{bound:.2g}, after the loop's loss scale {c:.6g} fitted on the model's output): the gradient "
                    f"parts {where}"), figures
        figures["backward"] = max(figures["backward"], x)
        last = name
    return None, figures


def _cp_scales(rec: A.RecordingSet, k: int, r: int, group: list[int], pieces: list[dict], ref_root: torch.Tensor,
               cp: dict, whose: str) -> str | None:
    """The loss scale each CP rank backpropagates its shard of the model's output at (fitted on its piece of
    the output gradient against one process's shard), as a sentence where they differ; said to be each
    shard's own token count when scale x count is one constant (a loss normalised per shard, then averaged
    over the ranks); None when they agree or the pieces do not cut."""
    got = [p.get(A.PROBE_GRAD + "(model)") for p in pieces]
    if any(g is None for g in got) or got[0].dim() != ref_root.dim():
        return None
    dims = [d for d in range(ref_root.dim()) if got[0].shape[d] != ref_root.shape[d]]
    if len(dims) != 1:
        return None
    parts = cp_split(ref_root, dims[0], len(group), cp["order"])
    if any(g.shape != q.shape for g, q in zip(got, parts)):
        return None
    scales = [_scale(g, q) for g, q in zip(got, parts)]
    if scales[0] == 0 or all(abs(x / scales[0] - 1) <= PROBE_RTOL for x in scales[1:]):
        return None
    said = ", ".join(f"rank {q}: {x:.6g}" for q, x in zip(group, scales))
    labels = pieces[0].get(A.micro_input(0) + A.LOSS_LABELS)
    labels = pieces[0].get(A.micro_input(0) + "labels") if labels is None else labels
    why = "the ranks of a CP group normalise their shards' losses differently"
    if labels is not None and labels.dim() > cp["seq_dim"]:
        counts = [int((x != -100).sum()) for x in cp_split(labels, cp["seq_dim"], len(group), cp["order"])]
        prods = [x * n for x, n in zip(scales, counts)]
        if all(n > 0 for n in counts) and all(abs(p / prods[0] - 1) <= PROBE_RTOL for p in prods[1:]):
            why = (f"each scale is 1 / its shard's own token count ({', '.join(map(str, counts))} tokens): each rank "
                   "normalised its shard's loss by its own count and the ranks were averaged, the mean of the shards' "
                   "means, not the token mean of the rows")
    return (f"at step {k} on {whose} every module's forward output agrees with one process's, but the CP ranks "
            f"backpropagate the model's output at different scales of one process's loss sum ({said}): {why}")


def check_probe(rec: A.RecordingSet, ref: ReferenceSet) -> Check | None:
    """The probe check (module docstring); None when no step was probed."""
    steps = [k for k in rec.steps if rec.step_meta(0, k).get("probe_order") is not None]
    if not steps:
        return None
    if ref.meta.get("probe_deferred"):
        return Check("probe", True, "not run: every other check passed, and the probe localises a failure (the first "
                                    "module whose output departs from one process's, or the loss): `gate check` "
                                    "runs it where a check fails")
    if not any(ref.tensors(k, A.PROBE) for k in steps) and rec.spec.objective_scope == "step":
        return Check("probe", True, "not probed: the objective is declared over the whole step "
                                    "(objective_scope='step'), so no one micro-batch's gradient is the fleet's alone")
    if not any(ref.tensors(k, A.PROBE) for k in steps):
        return Check("probe", True, "not probed: the probed micro-batches ran in reduced precision (autocast, cast or "
                                    "bfloat16/float16 parameters), or the reference ran past the recorded "
                                    "parameters; the probe's floors are float32's")
    dropped = [k for k in steps if any(rec.step_meta(r, k).get("probed_forward_dropped")
                                       for r in range(rec.world_at(k)))]
    if dropped:  # the probe watched the step's first forward, which was no micro-batch
        return Check("probe", True, f"not judged: the forward the probe watched at step {dropped[0]} (the step's "
                                    "first) was no micro-batch (no backward reached its output): its modules' "
                                    "outputs are another forward's than the micro-batch one process computes")
    drawn = [k for k in steps if ref.info(k).get("rng_sensitive")]
    if drawn:  # each rank's masks are its own draws: neither a module's output nor a rank's scale has one value
        return Check("probe", True, (
            f"not judged: one process's gradient of the probed micro-batch at step {drawn[0]} changes with the RNG "
            "state (dropout or another random draw in the forward): each rank drew its own masks, which the probe's "
            "one-process passes (at the recorded parameters and one ulp away) do not draw again, so neither the "
            "modules' outputs nor the ranks' loss scales can be compared with one process's (see independence)"))
    worst_f, worst_b, skipped, n = 0.0, 0.0, set(), 0
    for k in steps:
        scales = {}
        for r in range(rec.world_at(k)):
            if rec.step_meta(r, k).get("micro_batches", 0) == 0 or not ref.tensors(k, A.probe_prefix(r) + A.PROBE_REF_OUTPUT):
                continue
            finding, fig = _one(rec, ref, k, r)
            if finding:
                return Check("probe", False, finding)
            n += 1
            worst_f, worst_b = max(worst_f, fig["forward"]), max(worst_b, fig["backward"])
            skipped |= set(fig["skipped"])
            if fig["scale"] is not None:
                scales[r] = fig["scale"]
        if len(scales) > 1:
            r0 = min(scales)
            off = {r: c for r, c in scales.items() if abs(c / scales[r0] - 1) > PROBE_RTOL}
            if off:
                r1, c1 = next(iter(off.items()))
                return Check("probe", False, (
                    f"at step {k} every module agrees with one process on each rank's first micro-batch, but rank "
                    f"{r1} backpropagates its loss at {c1 / scales[r0]:.6g} times rank {r0}'s scale ({c1:.6g} against "
                    f"{scales[r0]:.6g} x the micro-batch's loss sum): the loss is at fault, not a module"))
    return Check("probe", True, (
        f"every module's forward output and output gradient agree with one process's on the first micro-batch of "
        f"{n} replica(s) at step(s) {', '.join(map(str, steps))} (worst forward {worst_f:.2g}, worst gradient "
        f"{worst_b:.2g} after the loop's loss scale; each module against {FLOOR_MULTIPLE:g} x its one-ulp floor, at "
        f"least {PROBE_RTOL:g}): a gradient fault the other checks find lies in the loss's normalisation or after "
        "the backward (the reduction), not in a module"
        + (f"; not compared (no assembled counterpart): {', '.join(sorted(skipped))}" if skipped else "")))
