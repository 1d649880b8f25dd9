"""dormouse.bench.device, the accelerator check, run as its CPU dry run: the
same code a GPU machine runs once (throughput in both dtypes, the
micro-batched gate and the exact gate), its page section, and the
deterministic kernels the exact mode asks for on CUDA."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dormouse.bench.page import write_head
from dormouse.bench.device import SECTION, main
from dormouse.config import TrainConfig, preset
from dormouse.gate.record.modes import deterministic_kernels
from dormouse.gate.settings import GateSettings
from dormouse.model.flops import step_flops

GATE_STEPS = 3  # the gates' steps in the dry run (a device's run takes the gate's default): the same code, cheaper


def test_the_device_check_dry_run_measures_both_dtypes_passes_both_gates_and_owns_its_section(
        tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nthe CPU bench's table\n")
    out = tmp_path / "device.json"
    assert main(["--device", "cpu", "--quick", "--preset", "tiny", "--gate-steps", str(GATE_STEPS), "--out", str(out),
                 "--docs", str(page)]) == 0
    res = json.loads(out.read_text())
    assert set(res["throughput"]) == {"float32", "bfloat16"}
    assert all(r["tokens_per_s"] > 0 and r["losses_finite"] and r["mfu_vs_matmul"] > 0
               for r in res["throughput"].values())
    # the model's FLOPs per step are step_flops' total (not the sum of its parts and its subtotals)
    flops = step_flops(preset("tiny"), TrainConfig(), 4, 64)["total"]
    assert all(r["model_tflops"] * 1e12 * r["step_s"] == pytest.approx(flops) for r in res["throughput"].values())
    micro, exact = res["gates"]["gate_micro"], res["gates"]["gate_exact"]
    assert micro["passed"] and exact["passed"] and micro["steps"] == exact["steps"] == GATE_STEPS
    assert {c["name"] for c in micro["checks"]} >= {"gradref", "gradient", "replay", "curve", "independence"}
    assert [c["reason"] for c in exact["checks"] if c["name"] == "exact"][0].endswith(f"bitwise equal at all {GATE_STEPS} steps")
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nthe CPU bench's table\n") and SECTION in text and f"gate_exact: PASS ({GATE_STEPS} steps, " in text
    # the CPU bench's --docs rewrites the page and keeps the accelerator section as it was
    section = SECTION + text.split(SECTION, 1)[1]
    write_head(page, "# Benchmarks\n\na new CPU table\n")  # what `dormouse bench --docs` writes (no full bench here)
    assert page.read_text() == "# Benchmarks\n\na new CPU table\n\n" + section


def test_the_device_check_without_cuda_is_one_line_and_status_2(capsys):
    if torch.cuda.is_available():
        return
    assert main(["--device", "cuda", "--out", os.devnull]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device cuda but CUDA is not available")


def test_the_exact_mode_on_cuda_asks_for_deterministic_kernels_and_nothing_else_does(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not deterministic_kernels(GateSettings(reduce="exact"))  # CPU: every kernel is deterministic already
    assert not deterministic_kernels(GateSettings(device="cuda", reduce="fp32"))
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        assert deterministic_kernels(GateSettings(device="cuda", reduce="exact"))
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
