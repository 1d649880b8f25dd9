"""The gate's judge: pure functions from artifacts to typed checks and a
Verdict. It reads artifacts only (through `dormouse.gate.artifacts`), trains
nothing and imports neither the running side nor the trainer."""

from dormouse.gate.judge.checks import check_ranks, judge, judge_references  # noqa: F401
from dormouse.gate.judge.verdict import Check, CurveCheck, ExactCheck, TensorCheck, Verdict  # noqa: F401
