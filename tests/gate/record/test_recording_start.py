"""The spec's `start` (the steps done before the recording's first step): 0 records afresh;
K > 0 continues the recording already in out_dir as a new segment after step K (its extra
merged over the earlier one's), or starts a fresh recording at step K + 1 where there is none;
a K past the recording's last step is one line."""

from __future__ import annotations

import pytest
import torch

from dormouse.gate import Recorder, RecordingSpec
from dormouse.gate import artifacts as A
from dormouse.gate.record.options import RecorderError

SPEC = RecordingSpec(build_model="x.y:build", build_optimizer="x.y:opt", objective="token_mean")


def _steps(out, spec: RecordingSpec, n: int) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(out, model, spec)
    for _ in range(n):
        model(torch.ones(2, 3)).sum().backward()
        rec.step(loss=0.0, optimizer=opt)
        opt.step()
        opt.zero_grad()
    rec.close()


def test_start_continues_the_recording_in_out_dir_or_starts_a_fresh_one_after_step_k(tmp_path):
    _steps(tmp_path / "r", SPEC.replace(extra={"a": 1}), 3)
    _steps(tmp_path / "r", SPEC.replace(start=2, extra={"b": 2}), 2)  # a resume from the checkpoint after step 2
    rec = A.RecordingSet(tmp_path / "r")
    assert rec.steps == [1, 2, 3, 4] and rec.spec.start == 0 and rec.spec.extra == {"a": 1, "b": 2}
    assert [(s["start"], s["end"], s["resumed"]) for s in rec.recorded.segments] == [(1, 3, False), (3, 4, True)]
    _steps(tmp_path / "fresh", SPEC.replace(start=5), 1)  # another run's checkpoint: a fresh recording
    fresh = A.RecordingSet(tmp_path / "fresh")
    assert fresh.steps == [6] and fresh.spec.start == 5 and not fresh.recorded.segments[0]["resumed"]
    with pytest.raises(RecorderError) as e:
        _steps(tmp_path / "r", SPEC.replace(start=9), 1)
    assert "start=9 but the recording in" in str(e.value) and "ends at step 4" in str(e.value)
