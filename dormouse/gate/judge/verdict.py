"""The verdict's types: one check's outcome (Check and its kinds) and the
Verdict of a run, JSON-ready (docs/verdict.schema.json). Every check of the
judge returns one of these; show/ reads nothing else."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

VERDICT_SCHEMA = 1


@dataclass
class Check:
    """One check's outcome: its name, pass or fail, and one sentence why."""

    name: str
    passed: bool
    reason: str


@dataclass
class TensorCheck(Check):
    """A per-step, per-tensor comparison: the worst relative difference and where."""

    worst: float = 0.0
    worst_tensor: str | None = None
    worst_step: int | None = None
    bound: float = 0.0
    per_step: list[float] = field(default_factory=list)  # max over tensors, per step
    first_step: int | None = None  # the first step that failed (None when it passed)
    shape: str | None = None  # the failure's shape where a check names one (the gradient's alternative weighting)


@dataclass
class ExactCheck(Check):
    """Bitwise equality per step (True where every compared series was equal)."""

    steps_equal: list[bool] = field(default_factory=list)
    first_step: int | None = None
    first_tensor: str | None = None
    element: int | None = None
    ulps: float | None = None


@dataclass
class CurveCheck(Check):
    """The global-batch curve: losses, their floor and tolerance, the first
    step's gradients, every tensor against its own floor, routing flips."""

    wire: str = "fp32"
    single: list[float] = field(default_factory=list)
    fleet: list[float] = field(default_factory=list)
    per_step: list[float] = field(default_factory=list)
    noise_floor: list[float] = field(default_factory=list)
    tolerance: list[float] = field(default_factory=list)
    tolerance_why: str = ""
    grad_step1: float = 0.0
    param_divergence: dict[str, list[float]] = field(default_factory=dict)
    first_divergent_param: str | None = None
    first_divergent_param_step: int | None = None
    routing_flips: list[list[int]] | None = None
    first_flip_step: int | None = None
    summary: str = ""


@dataclass
class Verdict:
    """The gate's answer for one out dir."""

    out: str
    passed: bool
    checks: list[Check]
    references: list[str]  # the artifacts compared with the fleet
    provenance: dict = field(default_factory=dict)
    schema: int = VERDICT_SCHEMA

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict:
        """JSON-ready: non-finite numbers become null (strict JSON has no NaN)."""
        d = finite(asdict(self))
        d["checks"] = {}
        for c in self.checks:
            row = {"kind": type(c).__name__, **finite(asdict(c))}
            row["pass"] = row.pop("passed")
            d["checks"][c.name] = row
        d["pass"] = d.pop("passed")
        return d


def finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x
