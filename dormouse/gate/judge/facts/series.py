"""Per-step series of the gate's own traces: their names, the references a run's settings
need, and the per-step comparisons (within a bound; bitwise) several facts use.
"""

from __future__ import annotations

import torch

from dormouse.errors import DormouseError
from dormouse.gate.artifacts import ArtifactSet, references
from dormouse.gate.judge.metrics import first_difference, relative, ulps
from dormouse.gate.judge.verdict import ExactCheck, TensorCheck


def series_names(trace: dict, prefix: str) -> list[str]:
    return sorted(k[len(prefix):] for k in trace if k.startswith(prefix))



# `settings` below: the gate's settings (a dormouse.gate.settings.GateSettings,
# or anything whose .record() gives what its artifacts record); the judge
# reads them only as that record.


def required(settings) -> list[str]:
    """The references a verdict for `settings` needs (artifacts.references of their record)."""
    return references(settings.record())



def settings_of(a: ArtifactSet, settings=None) -> dict:
    """The settings a verdict judges against, as artifacts record them: the
    caller's (the drivers pass the settings the run was asked for), else
    those the fleet's rank 0 was launched with. Every artifact's recorded
    settings must equal them (the provenance check)."""
    if settings is not None:
        return settings.record()
    record = a.meta("rank0").get("settings")
    if not isinstance(record, dict):
        raise DormouseError("rank0.json records no settings: re-run the rank mode")
    return record



def per_step_tensor(name: str, series_a: dict, series_b: dict, names: list[str], bound, *,
                     what: str) -> TensorCheck:
    """Compare two per-step tensor series (name -> (steps, ...)) under a
    per-(tensor, step) bound function; the first violation fails."""
    steps = min(len(series_a[names[0]]), len(series_b[names[0]])) if names else 0
    per_step, worst, where, first_bad = [], -1.0, (None, None), None
    for k in range(steps):
        top = 0.0
        for n in names:
            r = relative(series_a[n][k], series_b[n][k])
            lim = bound(n, k)
            if not r <= lim and first_bad is None:
                first_bad = (k + 1, n, r, lim)
            top = max(top, r)
            if r > worst:
                worst, where = r, (n, k + 1)
        per_step.append(top)
    if first_bad:
        k, n, r, lim = first_bad
        return TensorCheck(name, False, f"{what} at step {k}: {n} off by {r:.2e} > {lim:.1e}",
                           worst, where[0], where[1], lim, per_step, first_step=k)
    lim = bound(where[0], 0) if where[0] else 0.0
    return TensorCheck(name, True, f"{what}: max relative difference {max(worst, 0):.2e} ({where[0]}, step "
                       f"{where[1]}) within {lim:.0e} at every step", max(worst, 0), where[0], where[1], lim, per_step)



def world_at(meta: dict, k: int) -> int:
    """The fleet's world size at step k (0-based): a fleet that stopped and
    resumed ran its first leg at another world size."""
    legs = meta.get("legs") or [[meta.get("world_size", 1), None]]
    return legs[0][0] if meta.get("resumed_at") and k < meta["resumed_at"] else legs[-1][0]



def bitwise_steps(name: str, ours: dict, theirs: dict, keys: list[str], steps: int, what: str,
                   losses: tuple[list[float], list[float]] | None = None) -> ExactCheck:
    equal, first = [], None
    for k in range(steps):
        d = first_difference([(key, ours[key][k], theirs[key][k]) for key in keys])
        if d is None and losses is not None and losses[0][k] != losses[1][k]:
            d = ("loss", 0, ulps(torch.tensor([losses[0][k]], dtype=torch.float64),
                                 torch.tensor([losses[1][k]], dtype=torch.float64)))
        equal.append(d is None)
        if d is not None and first is None:
            first = (k + 1, *d)
    if first:
        k, tensor, el, u = first
        return ExactCheck(name, False, f"{what}: first differs at step {k}, {tensor} element {el} "
                          f"({u:.0f} ulps); {sum(equal)} of {steps} steps bitwise equal", equal, k, tensor, el, u)
    return ExactCheck(name, True, f"{what}: bitwise equal at all {steps} steps", equal)
