"""The gate's judge: pure functions from artifacts to typed checks and a
Verdict. It reads artifacts only (through `dormouse.gate.artifacts`), trains
nothing and imports neither the running side nor the trainer.

One module per fact a PASS rests on (facts/), the bounds in one table
(bounds.py), the measures of difference in one module (metrics.py), the
typed results in verdict.py; entry.py lists which facts apply to a run."""

from dormouse.gate.judge.entry import judge, judge_recording, judge_references  # noqa: F401
from dormouse.gate.judge.verdict import Check, CurveCheck, ExactCheck, TensorCheck, Verdict  # noqa: F401
