"""Experiment tracking beside the metrics JSONL: TensorBoard event files.

    tracker = TensorBoardTracker("runs/a", tokens_per_step=256, run=run)
    train(model, run, log=tracker.wrap_log(print), on_step=tracker.on_step)
    tracker.close()

Per step it writes `train/loss`, `train/lr` and `train/tokens_per_s`; at every
evaluation `eval/loss`. The loop logs an evaluation as one line
"eval step=N loss=X"; the tracker reads that line as it passes through the
log function, so the loop needs no tracker-specific code. Optional: needs the
`tracking` extra (`pip install dormouse[tracking]`, i.e. tensorboard).
"""

from __future__ import annotations

import re
import time
from typing import Callable

from dormouse.config import RunConfig
from dormouse.optional import require_tensorboard  # noqa: F401  (the trainer and its tests call it here)

_EVAL_LINE = re.compile(r"^eval step=(\d+) loss=(\S+)$")


class TensorBoardTracker:
    """Writes one run's scalars into a TensorBoard log directory."""

    def __init__(self, log_dir: str, *, tokens_per_step: int, run: RunConfig):
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        from dormouse.train.loop import lr_at

        self._lr_at = lambda step: lr_at(step, run)
        self.writer = SummaryWriter(log_dir=log_dir)
        self.tokens_per_step = tokens_per_step
        self._last = time.perf_counter()

    def on_step(self, step: int, _model, info: dict) -> None:
        """The loop's on_step hook: step is the number of steps done."""
        now = time.perf_counter()
        self.writer.add_scalar("train/loss", info["loss"], step)
        self.writer.add_scalar("train/lr", self._lr_at(step - 1), step)
        self.writer.add_scalar("train/tokens_per_s", self.tokens_per_step / max(now - self._last, 1e-9), step)
        self._last = now

    def wrap_log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, also recording the loop's evaluation lines as eval/loss."""
        def tracked(line: str) -> None:
            m = _EVAL_LINE.match(line)
            if m:
                self.writer.add_scalar("eval/loss", float(m.group(2)), int(m.group(1)))
            log(line)
        return tracked

    def close(self) -> None:
        self.writer.close()
