"""The verdict: compare what an out dir holds and say pass or fail, with numbers.

Three checks, each run when its artifacts are present:

ranks   - every rank<r> artifact is bitwise equal to rank0 (same fingerprint,
          every tensor identical). Replicated ranks apply the same reduced
          gradient with the same optimizer, so anything but equality is a bug.
gradref - the fleet's post-step tensors against the hand-computed reference:
          per tensor, max |fleet - ref| / max |ref| ("param_rel"), which must
          stay within GRADREF_RTOL. Also reported: the same difference relative
          to the reference's step, max |fleet - ref| / max |ref - init|
          ("step_rel"), which says how much of one step is in doubt.
curve   - the fleet's loss at every step against the single process's:
          |L_fleet - L_single| / |L_single| within LOSS_RTOL (fp32 reduce) or
          LOSS_RTOL_BF16 (bf16 reduce).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dormouse.errors import DormouseError
from dormouse.gate.artifacts import load_meta, load_tensors

# Fleet vs gradref, measured on the tiny fixture (lr 1e-3, float32
# Newton-Schulz): param_rel <= 5.5e-6 over worlds 2, 3, 4 with uneven
# profiles, the largest on the zero-initialised adapters, whose whole value is
# one Newton-Schulz output (which amplifies float32 round-off of the gradient
# in directions of small singular value). A real fault moves whole steps:
# plain-mean weighting under "4,2" or an unreduced parameter shift parameters
# by ~1e-3 of their scale or more. 1e-4 sits ~18x above the floor and ~10x
# below the faults.
GRADREF_RTOL = 1e-4
LOSS_RTOL = 1e-4
# bf16 on the wire rounds each rank's gradient to 8 bits of mantissa (2^-9
# relative); over 20 Muon steps at lr 1e-3 the loss moves by up to ~1e-3.
LOSS_RTOL_BF16 = 5e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _ranks(out: Path) -> list[str]:
    names = [p.stem for p in out.glob("rank*.json") if p.stem[4:].isdigit()]
    return sorted(names, key=lambda n: int(n[4:]))


def compare_ranks(out: Path) -> dict:
    names = _ranks(out)
    metas = [load_meta(out, n) for n in names]
    world = metas[0].get("world_size", len(names))
    if len(names) != world:
        return {"pass": False, "reason": f"found {len(names)} rank artifacts for a world of {world}"}
    ref = load_tensors(out, names[0])
    per_rank = {}
    for n, m in zip(names[1:], metas[1:]):
        t = load_tensors(out, n)
        unequal = [k for k in ref if not torch.equal(ref[k], t.get(k, torch.empty(0)))]
        per_rank[n] = {"fingerprint_equal": m["fingerprint"] == metas[0]["fingerprint"],
                       "unequal_tensors": unequal,
                       "losses_equal": m["losses"] == metas[0]["losses"]}
    ok = all(r["fingerprint_equal"] and not r["unequal_tensors"] and r["losses_equal"]
             for r in per_rank.values())
    reason = "all ranks bitwise equal" if ok else "ranks differ: " + "; ".join(
        f"{n}: {', '.join(r['unequal_tensors'][:3]) or 'losses'}" for n, r in per_rank.items()
        if r["unequal_tensors"] or not r["losses_equal"] or not r["fingerprint_equal"])
    return {"pass": ok, "reason": reason, "world": world, "per_rank": per_rank}


def compare_gradref(out: Path, rtol: float = GRADREF_RTOL) -> dict:
    ref_meta, fleet_meta = load_meta(out, "gradref"), load_meta(out, "rank0")
    mismatch = _settings_mismatch(ref_meta, fleet_meta, ("seed", "lr", "opt", "capacity", "batch"))
    if fleet_meta["settings"]["steps"] != 1:
        mismatch.append(f"fleet ran {fleet_meta['settings']['steps']} steps, gradref is one step")
    if mismatch:
        return {"pass": False, "reason": "gradref and fleet are not comparable: " + "; ".join(mismatch)}
    ref, fleet, init = load_tensors(out, "gradref"), load_tensors(out, "rank0"), load_tensors(out, "init")
    per_tensor = {k: {"param_rel": _rel(fleet[k], ref[k]),
                      "step_rel": _rel(fleet[k] - init[k], ref[k] - init[k])} for k in ref}
    worst = max(per_tensor, key=lambda k: per_tensor[k]["param_rel"])
    worst_rel = per_tensor[worst]["param_rel"]
    ok = worst_rel <= rtol
    reason = f"max relative parameter difference {worst_rel:.2e} ({worst}) {'<=' if ok else '>'} {rtol:.0e}"
    return {"pass": ok, "reason": reason, "rtol": rtol, "per_tensor": per_tensor,
            "worst": worst, "max_rel": worst_rel}


def compare_curves(out: Path, rtol: float | None = None) -> dict:
    single, fleet = load_meta(out, "single"), load_meta(out, "rank0")
    mismatch = _settings_mismatch(single, fleet, ("seed", "lr", "opt", "steps"))
    global_batch = sum(int(s.split()[0].split("=")[1]) for s in fleet["shapes"])
    if single["global_batch"] != global_batch:
        mismatch.append(f"single's global batch {single['global_batch']} != fleet's {global_batch}")
    if mismatch:
        return {"pass": False, "reason": "single and fleet are not comparable: " + "; ".join(mismatch)}
    if rtol is None:
        rtol = LOSS_RTOL_BF16 if fleet["settings"]["reduce"] == "bf16" else LOSS_RTOL
    ls, lf = single["losses"], fleet["losses"]
    rel = [abs(f - s) / abs(s) if s else abs(f - s) for s, f in zip(ls, lf)]
    bad = [i + 1 for i, r in enumerate(rel) if not (r <= rtol)]
    finite = all(map(math.isfinite, lf))
    ok = not bad and finite and len(ls) == len(lf)
    reason = (f"max per-step relative loss difference {max(rel):.2e} {'<=' if ok else '>'} {rtol:.0e}"
              + (f"; first step over: {bad[0]}" if bad else ""))
    return {"pass": ok, "reason": reason, "rtol": rtol, "per_step": rel, "first_bad_step": bad[0] if bad else None,
            "single": ls, "fleet": lf}


def compare(out) -> dict:
    """Run every check the out dir has artifacts for; pass only if all pass."""
    out = Path(out)
    if not _ranks(out):
        raise DormouseError(f"no fleet artifacts (rank*.json) in {str(out)!r}: run the rank mode first")
    checks = {"ranks": compare_ranks(out)}
    if (out / "gradref.json").exists():
        checks["gradref"] = compare_gradref(out)
    if (out / "single.json").exists():
        checks["curve"] = compare_curves(out)
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
