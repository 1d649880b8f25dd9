"""Presenting a verdict: as text, and as `verdict.json` (schema in
docs/verdict.schema.json), with the time and versions it was taken with."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dormouse import atomic
from dormouse.gate.judge.verdict import Verdict

VERDICT_FILE = "verdict.json"


def format_verdict(v: Verdict | dict) -> str:
    """The verdict as text; `v` a Verdict or its verdict.json."""
    d = v.to_dict() if isinstance(v, Verdict) else v
    lines = [f"gate verdict for {d['out']}: {'PASS' if d['pass'] else 'FAIL'}"]
    if d.get("references"):
        lines.append(f"  references compared: {', '.join(d['references'])}")
    for name, c in d["checks"].items():
        lines.append(f"  [{'ok' if c['pass'] else 'FAIL'}] {name}: {c['reason']}")
    return "\n".join(lines)


def verdict_json(v: Verdict, **extra) -> dict:
    import torch

    import dormouse

    d = v.to_dict()
    d["taken"] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dormouse": dormouse.__version__,
                  "torch": torch.__version__}
    d.update(extra)
    return d


def write_verdict(v: Verdict, out: Path, **extra) -> Path:
    return atomic.write_text(Path(out) / VERDICT_FILE, json.dumps(verdict_json(v, **extra), indent=1, default=str,
                                                                  allow_nan=False))


def write_tensorboard(v: Verdict, log_dir) -> None:
    """The verdict's per-step series as TensorBoard scalars: for each per-step
    check its worst relative difference and bound (gate/<check>/worst,
    gate/<check>/bound), the curve's loss difference, floor and tolerance,
    and 1/0 per step for the bitwise checks (gate/<check>/equal)."""
    from dormouse.optional import require_tensorboard

    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    from dormouse.gate.judge.verdict import CurveCheck, ExactCheck, TensorCheck

    w = SummaryWriter(log_dir=str(log_dir))
    try:
        for c in v.checks:
            if isinstance(c, TensorCheck):
                for k, x in enumerate(c.per_step, 1):
                    w.add_scalar(f"gate/{c.name}/worst", x, k)
                    w.add_scalar(f"gate/{c.name}/bound", c.bound, k)
            elif isinstance(c, ExactCheck):
                for k, eq in enumerate(c.steps_equal, 1):
                    w.add_scalar(f"gate/{c.name}/equal", float(eq), k)
            elif isinstance(c, CurveCheck):
                for k, (x, f, t) in enumerate(zip(c.per_step, c.noise_floor, c.tolerance), 1):
                    w.add_scalar("gate/curve/loss_difference", x, k)
                    w.add_scalar("gate/curve/floor", f, k)
                    w.add_scalar("gate/curve/tolerance", t, k)
    finally:
        w.close()
