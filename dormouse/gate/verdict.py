"""The verdict: compare what an out dir holds and say pass or fail, with
numbers, and explain where two runs part.

Checks, each run when its artifacts are present:

ranks   - every rank<r> artifact is bitwise equal to rank0 (tensors, last-step
          gradients, losses). Replicated ranks apply the same reduced gradient
          with the same optimizer: anything but equality is a bug.
gradref - the fleet's one step against the hand-computed reference.
          grad:   the fleet's reduced gradient g_f against g = sum t_r g_r / T.
                  fp32 wire: max |g_f - g| / max |g| <= GRAD_RTOL.
                  bf16 wire: elementwise |g_f - g| <= W u sum_r |t_r g_r| / T
                  (+ GRAD_RTOL max |g|), u = 2^-8 the unit round-off of
                  bfloat16: each rank's term is rounded once and each of the
                  W - 1 partial sums once (first-order bound of recursive
                  summation, Higham, "Accuracy and Stability of Numerical
                  Algorithms", sec. 4.2).
          replay: the single-process optimizer applied to the fleet's OWN
                  reduced gradient from the common start must reproduce the
                  fleet's tensors bitwise: the fleet's step (FSDP's gathered
                  Newton-Schulz and sharded AdamW included) is the same map.
          params: max |p_f - p_ref| / max |p_ref| per tensor <= GRADREF_RTOL
                  (opt="mix", fp32 wire). Not judged under bf16 (Newton-
                  Schulz amplifies the wire's 2^-8 rounding; the gradient
                  bound judges) nor under opt="adamw" (the first AdamW step
                  g/(|g|+eps) amplifies round-off of near-zero elements by up
                  to lr/eps): there gradient + replay prove the step.
curve   - the fleet's loss at every step against the single process's, judged
          against a tolerance derived from the MEASURED round-off floor of
          the reference (two runs of the same mathematics, see
          modes.measure_floor): tolerance_k = max(FLOOR_MULTIPLE * floor
          envelope_k, MIN_RTOL), in the spirit of Megatron-LM's rule
          (tolerance = 1.5 x run-to-run variance, floored) but per step.
          Under the bf16 wire the fixed LOSS_RTOL_BF16 applies instead.
          Explained alongside: routing flips per step (tokens whose top-k
          experts differ between single and fleet) and the first tensor to
          leave its own floor.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dormouse.errors import DormouseError
from dormouse.gate.artifacts import load_meta, load_tensors
from dormouse.gate.modes import replay_fleet_step
from dormouse.gate.trace import load_trace, rel_per_step, routing_flips

BF16_UNIT_ROUNDOFF = 2.0**-8
# fp32 wire, fleet vs gradref gradient: measured <= 4.7e-7 relative ("4,2",
# worlds 2-4): float32 summation order. 1e-5 is ~20x above and four orders
# of magnitude below any weighting fault.
GRAD_RTOL = 1e-5
# Fleet vs gradref parameters after one step, measured on the tiny fixture
# (lr 1e-3, float32 Newton-Schulz): <= 5.5e-6 over worlds 2, 3, 4 with uneven
# profiles, the largest on the zero-initialised adapters, whose whole value is
# one Newton-Schulz output (which amplifies round-off in directions of small
# singular value). A real fault moves whole steps: plain-mean weighting under
# "4,2" or an unreduced parameter shift parameters by ~1e-3 of their scale or
# more. 1e-4 sits ~18x above the floor and ~10x below the faults.
GRADREF_RTOL = 1e-4
# Loss curves, fp32 wire: tolerance_k = max(FLOOR_MULTIPLE * envelope_k,
# MIN_RTOL). The floor runs measured 1e-8..1.4e-7 relative per step on the
# tiny fixture (20 steps, lr 1e-3); the fleet itself 0..1.4e-7.
FLOOR_MULTIPLE = 10.0
MIN_RTOL = 1e-6  # a few float32 ulps of the loss: the floor of the floor
# Loss curves, bf16 wire: each reduced gradient element is off by up to
# W u = 2^-7 relative (the gradref check proves the bound per element);
# over 20 steps at lr 1e-3 that moved the loss by 4.6e-5 relative (measured,
# 2 ranks). 1e-3 bounds it with ~20x margin; it is ~500x the fp32 floor, so a
# bf16 run judged by the fp32 tolerance fails, as it should.
LOSS_RTOL_BF16 = 1e-3


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (max |a - b| where b is all zero)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def rank_names(out: Path) -> list[str]:
    names = [p.stem for p in out.glob("rank*.json") if p.stem[4:].isdigit()]
    return sorted(names, key=lambda n: int(n[4:]))


def compare_ranks(out: Path) -> dict:
    names = rank_names(out)
    metas = [load_meta(out, n) for n in names]
    world = metas[0].get("world_size", len(names))
    if len(names) != world:
        return {"pass": False, "reason": f"found {len(names)} rank artifacts for a world of {world}"}
    ref = {**load_tensors(out, names[0]), **_grads(out, names[0])}
    per_rank = {}
    for n, m in zip(names[1:], metas[1:]):
        t = {**load_tensors(out, n), **_grads(out, n)}
        unequal = [k for k in ref if k not in t or not torch.equal(ref[k], t[k])]
        per_rank[n] = {"unequal_tensors": unequal, "losses_equal": m["losses"] == metas[0]["losses"]}
    ok = all(not r["unequal_tensors"] and r["losses_equal"] for r in per_rank.values())
    sharded = metas[0].get("settings", {}).get("shard") == "fsdp"
    note = (" (FSDP2: each rank saved the tensors gathered from all shards, equal by construction; "
            "what this check can catch there is a buffer, such as the routing bias, gone apart)") if sharded else ""
    reason = f"all {world} ranks bitwise equal{note}" if ok else "ranks differ: " + "; ".join(
        f"{n} vs rank0: {', '.join(r['unequal_tensors'][:3]) or 'losses'}" for n, r in per_rank.items()
        if r["unequal_tensors"] or not r["losses_equal"])
    return {"pass": ok, "reason": reason, "world": world, "per_rank": per_rank}


def _grads(out: Path, name: str) -> dict[str, torch.Tensor]:
    if not (out / f"{name}_grad.json").exists():
        return {}
    return {f"grad/{k}": v for k, v in load_tensors(out, f"{name}_grad").items()}


def compare_gradref(out: Path, *, judge_reduce: str | None = None) -> dict:
    """judge_reduce: judge as if the wire were "fp32" or "bf16" (default: the
    fleet's own setting). Judging a bf16 fleet by "fp32" must fail."""
    ref_meta, fleet_meta = load_meta(out, "gradref"), load_meta(out, "rank0")
    mismatch = _settings_mismatch(ref_meta, fleet_meta, ("seed", "lr", "opt", "capacity", "batch"))
    if fleet_meta["settings"]["steps"] != 1:
        mismatch.append(f"fleet ran {fleet_meta['settings']['steps']} steps, gradref is one step")
    if ref_meta.get("shapes") != fleet_meta.get("shapes"):
        mismatch.append(f"shapes: gradref {ref_meta.get('shapes')} vs fleet {fleet_meta.get('shapes')}")
    if mismatch:
        return {"pass": False, "reason": "gradref and fleet are not comparable: " + "; ".join(mismatch)}
    wire = judge_reduce or fleet_meta["settings"]["reduce"]
    world = fleet_meta["world_size"]
    ref, fleet, init = load_tensors(out, "gradref"), load_tensors(out, "rank0"), load_tensors(out, "init")
    g_ref, g_abs = load_tensors(out, "gradref_grad"), load_tensors(out, "gradref_gradabs")
    g_fleet = load_tensors(out, "rank0_grad")
    per_tensor = {}
    for k in ref:
        row = {"param_rel": relative_difference(fleet[k], ref[k]), "step_rel": relative_difference(fleet[k] - init[k], ref[k] - init[k])}
        if k in g_ref:
            diff = (g_fleet[k].double() - g_ref[k].double()).abs()
            scale = g_ref[k].abs().max().item()
            row["grad_rel"] = diff.max().item() / scale if scale > 0 else diff.max().item()
            bound = world * BF16_UNIT_ROUNDOFF * g_abs[k].double() + GRAD_RTOL * scale
            row["grad_bound_ratio"] = (diff / bound.clamp_min(1e-300)).max().item()
        per_tensor[k] = row
    grads = [k for k in per_tensor if "grad_rel" in per_tensor[k]]
    worst_param = max(per_tensor, key=lambda k: per_tensor[k]["param_rel"])
    replay = replay_fleet_step(out)
    replay_unequal = [k for k in replay if not torch.equal(replay[k], fleet[k])]
    opt = fleet_meta["settings"]["opt"]
    if wire == "bf16":
        worst_grad = max(grads, key=lambda k: per_tensor[k]["grad_bound_ratio"])
        value, limit = per_tensor[worst_grad]["grad_bound_ratio"], 1.0
        ok = value <= limit
        reason = (f"bf16 wire: gradient error at most {value:.2f} of its rounding bound "
                  f"(W u sum|t_r g_r|/T) ({worst_grad}); parameters not judged "
                  f"(max relative difference {per_tensor[worst_param]['param_rel']:.1e})")
    else:
        worst_grad = max(grads, key=lambda k: per_tensor[k]["grad_rel"])
        g_val, p_val = per_tensor[worst_grad]["grad_rel"], per_tensor[worst_param]["param_rel"]
        judge_params = opt == "mix"
        ok = g_val <= GRAD_RTOL and (p_val <= GRADREF_RTOL or not judge_params)
        reason = (f"gradient max relative difference {g_val:.1e} ({worst_grad}) "
                  f"{'<=' if g_val <= GRAD_RTOL else '>'} {GRAD_RTOL:.0e}; parameters "
                  f"{p_val:.1e} ({worst_param}) " + (
                      f"{'<=' if p_val <= GRADREF_RTOL else '>'} {GRADREF_RTOL:.0e}" if judge_params else
                      "not judged (AdamW's first step g/(|g|+eps) amplifies round-off of near-zero "
                      "gradient elements by up to lr/eps; the gradient and the replay prove the step)"))
    ok = ok and not replay_unequal
    reason += ("; the single-process optimizer applied to the fleet's own gradient reproduces the "
               "fleet's step bitwise" if not replay_unequal else
               f"; the fleet's step is NOT the optimizer's step on its own gradient: {', '.join(replay_unequal[:3])}")
    bad = [k for k in per_tensor if (per_tensor[k].get("grad_rel", 0) > GRAD_RTOL
                                     or per_tensor[k]["param_rel"] > GRADREF_RTOL)]
    return {"pass": ok, "reason": reason, "wire": wire, "grad_rtol": GRAD_RTOL, "rtol": GRADREF_RTOL,
            "replay_unequal": replay_unequal,
            "per_tensor": per_tensor, "worst": worst_param, "worst_grad": worst_grad,
            "max_rel": per_tensor[worst_param]["param_rel"],
            "first_divergent_param": bad[0] if bad else None}


def noise_floor(single: dict) -> list[float]:
    """Per step, the largest relative loss difference of the floor runs from
    the reference: the measured round-off floor (see modes.measure_floor)."""
    ref = single["losses"]
    floor = [0.0] * len(ref)
    for run in single.get("floor", {}).values():
        for k, (a, b) in enumerate(zip(run["losses"], ref)):
            floor[k] = max(floor[k], abs(a - b) / abs(b) if b else abs(a - b))
    return floor


def running_max(xs: list[float]) -> list[float]:
    out, top = [], 0.0
    for x in xs:
        top = max(top, x)
        out.append(top)
    return out


def floor_envelope(single: dict) -> list[float]:
    """The floor's running maximum: round-off only grows along a run."""
    return running_max(noise_floor(single))


def tolerance_from(envelope: list[float], multiple: float = FLOOR_MULTIPLE) -> list[float]:
    """tolerance_k = max(multiple * envelope_k, MIN_RTOL)."""
    return [max(multiple * e, MIN_RTOL) for e in envelope]


def _curve_mismatch(single: dict, fleet: dict) -> list[str]:
    """Why single and fleet cannot be compared step by step (empty if they can)."""
    why = _settings_mismatch(single, fleet, ("seed", "lr", "opt", "steps"))
    shapes = fleet.get("rank_shapes", [])
    seq = single["config"]["train"]["seq_len"]
    if any(t != seq for _, t in shapes):
        why.append(f"the fleet's window lengths {[t for _, t in shapes]} differ from single's {seq}")
    if sum(b for b, _ in shapes) != single["global_batch"]:
        why.append(f"single's global batch {single['global_batch']} != the fleet's "
                   f"{sum(b for b, _ in shapes)}")
    if fleet.get("start_step", 0) != single.get("start_step", 0):
        why.append(f"single started at step {single.get('start_step', 0)}, the fleet at "
                   f"{fleet.get('start_step', 0)} (a resumed run)")
    if not fleet["losses"] or len(fleet["losses"]) != len(single["losses"]):
        why.append(f"single has {len(single['losses'])} losses, the fleet {len(fleet['losses'])}")
    return why


def compare_curves(out: Path, *, judge_reduce: str | None = None, multiple: float = FLOOR_MULTIPLE) -> dict:
    single, fleet = load_meta(out, "single"), load_meta(out, "rank0")
    mismatch = _curve_mismatch(single, fleet)
    if mismatch:
        return {"pass": False, "reason": "single and fleet are not comparable: " + "; ".join(mismatch)}
    wire = judge_reduce or fleet["settings"]["reduce"]
    ls, lf = single["losses"], fleet["losses"]
    rel = [abs(f - s) / abs(s) if s else abs(f - s) for s, f in zip(ls, lf)]
    floor, envelope = noise_floor(single), floor_envelope(single)
    if wire == "bf16":
        tolerance = [LOSS_RTOL_BF16] * len(ls)
        why = (f"bf16 wire: fixed {LOSS_RTOL_BF16:.0e} (each reduced gradient element is off by "
               f"<= W u; measured 4.6e-5 over 20 steps)")
    else:
        tolerance = tolerance_from(envelope, multiple)
        why = (f"{multiple:g} x the running maximum of the measured floor (two runs of the same "
               f"mathematics: micro-batched, and started one ulp away), at least {MIN_RTOL:.0e}")
    bad = [k for k, (r, t) in enumerate(zip(rel, tolerance)) if not r <= t]
    ok = not bad and all(map(math.isfinite, lf))
    explain = explain_divergence(out, single, fleet, rel, envelope, multiple)
    worst = max(range(len(rel)), key=lambda k: rel[k] / tolerance[k])
    reason = (f"max per-step relative loss difference {max(rel):.2e} (step {worst + 1}: tolerance "
              f"{tolerance[worst]:.1e})" + (f"; exceeds tolerance first at step {bad[0] + 1}" if bad else "")
              + (f"; {explain['summary']}" if explain.get("summary") else ""))
    return {"pass": ok, "reason": reason, "wire": wire, "per_step": rel, "noise_floor": floor,
            "floor_envelope": envelope, "tolerance": tolerance, "multiple": multiple,
            "min_rtol": MIN_RTOL, "tolerance_why": why, "first_bad_step": bad[0] + 1 if bad else None,
            "single": ls, "fleet": lf, **explain}


def explain_divergence(out: Path, single: dict, fleet: dict, rel: list[float], envelope: list[float],
                       multiple: float) -> dict:
    """Routing flips per step, the first tensor to leave its own floor, and
    whether the loss left the floor at a flip (benign) or before any (a bug)."""
    s_trace, f_trace = load_trace(out, "single"), load_trace(out, "rank0")
    if s_trace is None or f_trace is None:
        return {}
    result: dict = {}
    names = rank_names(out)
    if "topk" in s_trace:
        fleet_topk = [load_trace(out, n)["topk"] for n in names]
        try:
            flips = routing_flips(s_trace["topk"], torch.cat(fleet_topk, dim=1))  # (steps, I)
            result["routing_flips"] = flips.tolist()
            per_step = flips.sum(dim=1).tolist()
            first = next((k + 1 for k, n in enumerate(per_step) if n), None)
            result["first_flip_step"] = first
        except RuntimeError:  # ranks with different window lengths: not comparable token by token
            result["routing_flips"] = None
            result["first_flip_step"] = None
    # Per tensor, per step: single vs fleet, against the tensor's own floor.
    floors = {}
    for run in single.get("floor", {}).values():
        for name, series in run["param_rel"].items():
            prev = floors.get(name, [0.0] * len(series))
            floors[name] = [max(a, b) for a, b in zip(prev, series)]
    heat, first_param = {}, None
    for key in sorted(k for k in s_trace if k.startswith("p/")):
        name = key[2:]
        if key not in f_trace:
            continue
        series = rel_per_step(f_trace[key], s_trace[key])
        heat[name] = series
        tolerance = tolerance_from(running_max(floors.get(name, [0.0] * len(series))), multiple)
        for k, (v, t) in enumerate(zip(series, tolerance)):
            if v > t and (first_param is None or k + 1 < first_param[0]):
                first_param = (k + 1, name)
    result["param_divergence"] = heat
    result["first_divergent_param"] = first_param[1] if first_param else None
    result["first_divergent_param_step"] = first_param[0] if first_param else None
    above = next((k + 1 for k, (r, e) in enumerate(zip(rel, envelope)) if r > multiple * e and r > MIN_RTOL), None)
    result["first_above_floor_step"] = above
    first_flip = result.get("first_flip_step")
    flips = result.get("routing_flips")
    # A flip explains the loss leaving the floor if it came at an earlier step,
    # or at that very step in the block's FIRST iteration (whose router input
    # the step's own MoE outputs cannot have changed yet). A flip only in later
    # iterations follows from hidden states that had already parted.
    explained = first_flip is not None and above is not None and (
        first_flip < above or (first_flip == above and flips[above - 1][0] > 0))
    if fleet["settings"].get("reduce") == "bf16":
        result["summary"] = ("bf16 wire: every step's gradient is rounded to 8 bits on the wire, so the "
                             "loss is expected to leave the fp32 floor; judged by the bf16 bound")
    elif above is None:
        result["summary"] = "the fleet stays within the measured floor at every step"
    elif explained:
        result["summary"] = (f"the loss leaves the floor at step {above}, after a routing flip (first at "
                             f"step {first_flip}): consistent with round-off amplified by a discrete "
                             "expert choice (benign at small lr)")
    else:
        result["summary"] = (f"the loss leaves the floor at step {above} before any routing flip could "
                             "explain it: suspect the fleet's mathematics")
    return result


def compare(out, *, judge_reduce: str | None = None) -> dict:
    """Run every check the out dir has artifacts for; pass only if all pass."""
    out = Path(out)
    if not rank_names(out):
        raise DormouseError(f"no fleet artifacts (rank*.json) in {str(out)!r}: run the rank mode first")
    checks = {"ranks": compare_ranks(out)}
    if (out / "gradref.json").exists():
        checks["gradref"] = compare_gradref(out, judge_reduce=judge_reduce)
    if (out / "single.json").exists():
        checks["curve"] = compare_curves(out, judge_reduce=judge_reduce)
    ok = all(c["pass"] for c in checks.values())
    return {"pass": ok, "out": str(out), "checks": checks,
            "reasons": [f"{k}: {c['reason']}" for k, c in checks.items()]}


def format_verdict(v: dict) -> str:
    lines = [f"gate verdict for {v['out']}: {'PASS' if v['pass'] else 'FAIL'}"]
    for k, c in v["checks"].items():
        lines.append(f"  [{'ok' if c['pass'] else 'FAIL'}] {k}: {c['reason']}")
    return "\n".join(lines)


def _settings_mismatch(a: dict, b: dict, keys) -> list[str]:
    sa, sb = a.get("settings", {}), b.get("settings", {})
    return [f"{k}: {a['name']} {sa.get(k)!r} vs {b['name']} {sb.get(k)!r}" for k in keys if sa.get(k) != sb.get(k)]
