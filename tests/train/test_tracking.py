"""dormouse.train.tracking: `dormouse train --tensorboard DIR` writes loss, lr,
tokens/s per step and the eval loss, read back with TensorBoard's own reader;
without tensorboard installed the flag is one clear error."""

from __future__ import annotations

import importlib.util

import pytest

from dormouse.__main__ import main
from dormouse.errors import ConfigError
from dormouse.train import tracking


def test_tensorboard_gets_loss_lr_tokens_per_s_and_eval_loss_per_step(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    assert main(["train", "--steps", "4", "--batch", "2", "--seq-len", "16", "--out", str(tmp_path / "o"),
                 "--tensorboard", str(tb), "--set", "eval_frac=0.1", "--set", "eval_every=2",
                 "--set", "warmup=2", "--log-every", "1"]) == 0
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step=")]
    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert set(scalars) == {"train/loss", "train/lr", "train/tokens_per_s", "eval/loss"}
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    # the same numbers the log lines show
    for (step, loss), line in zip(scalars["train/loss"], logged):
        assert line.startswith(f"step={step}/4 ")
        assert float(line.split("loss=")[1].split()[0]) == pytest.approx(loss, abs=1e-6)  # events hold float32
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-3])
    assert all(v > 0 for _, v in scalars["train/tokens_per_s"])
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4]


def test_without_tensorboard_the_flag_is_one_error_and_nothing_runs(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install"):
        tracking.require_tensorboard()
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "o"), "--tensorboard", str(tmp_path / "tb")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "tensorboard" in lines[0] and "dormouse[tracking]" in lines[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / "tb").exists()
