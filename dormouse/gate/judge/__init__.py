"""The gate's judge: pure functions from artifacts to typed checks and a
Verdict. It reads artifacts only (through `dormouse.gate.artifacts`), trains
nothing and imports neither the running side nor the trainer.

One module per fact a PASS rests on (facts/), the bounds in one table
(bounds.py), the measures of difference in one module (metrics.py), the
typed results in verdict.py; entry.py lists which facts apply to a run."""

from dormouse.gate.judge.verdict import Check, CurveCheck, ExactCheck, TensorCheck, Verdict  # noqa: F401


def __getattr__(name: str):
    """judge, judge_recording, judge_references: entry.py (and the artifacts' readers, and torch), imported on
    first use (PEP 562), so the typed results (verdict.py) cost no `import torch`."""
    if name in ("judge", "judge_recording", "judge_references"):
        from dormouse.gate.judge import entry

        return getattr(entry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
