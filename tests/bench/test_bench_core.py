"""The bench's own arithmetic: the matmul rate in a dtype, each part of the
step against its dtype's rate, the sampling rate; the step's timing through
train()'s hooks; the table of sections."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dormouse.bench.rates import matmul_rate, ns_matmul_dtype, parts_at_rates
from dormouse.bench.sampling import sampling_rate
from dormouse.model.flops import step_flops
from dormouse.config import TrainConfig, preset
from dormouse.train.newton_schulz import native_bf16_matmul


def test_matmul_rate_measures_the_dtype_it_is_given():
    for dtype in (torch.float32, torch.bfloat16):
        rates = matmul_rate((32, 64), min_s=0.01, dtype=dtype)
        assert set(rates) == {32, 64} and all(r > 0 for r in rates.values())


def test_newton_schulz_runs_on_bf16_kernels_only_on_the_native_kernel():
    t = TrainConfig()
    assert ns_matmul_dtype(dataclasses.replace(t, ns_dtype="float32")) == "float32"
    assert ns_matmul_dtype(dataclasses.replace(t, ns_kernel="native")) == "bfloat16"
    assert ns_matmul_dtype(dataclasses.replace(t, ns_kernel="fp32")) == "float32"
    assert ns_matmul_dtype(t) == ("bfloat16" if native_bf16_matmul("cpu") else "float32")


def test_each_part_of_the_step_is_held_against_its_own_dtype_rate():
    m, t = preset("small"), dataclasses.replace(TrainConfig(), ns_kernel="native")
    flops = step_flops(m, t, 8, 256)
    got = parts_at_rates(flops, m, t, {"float32": 80.0, "bfloat16": 0.8})
    ns, model = got["parts"]["newton_schulz"], got["parts"]["model"]
    assert (ns["dtype"], model["dtype"]) == ("bfloat16", "float32")
    assert ns["ideal_s"] == pytest.approx(flops["newton_schulz"] / 0.8e9)
    assert model["ideal_s"] == pytest.approx((flops["total"] - flops["newton_schulz"]) / 80e9)
    assert got["ideal_s"] == pytest.approx(ns["ideal_s"] + model["ideal_s"])
    fp32 = parts_at_rates(flops, m, dataclasses.replace(t, ns_kernel="fp32"), {"float32": 80.0, "bfloat16": 0.8})
    assert fp32["parts"]["newton_schulz"]["ideal_s"] == pytest.approx(flops["newton_schulz"] / 80e9)


def test_sampling_rate_reports_every_kind_side_by_side_with_ratios_per_round():
    rates = sampling_rate("tiny", tokens=4, rounds=2, batch=2)
    kinds = {"within_window", "uncached", "forward_cache", "sliding", "batch"}
    assert all(rates[k] > 0 and len(rates["per_round"][k]) == 2 for k in kinds)
    r = rates["ratios"]["cached_vs_uncached"]
    assert r["n"] == 2 and r["min"] <= r["median"] <= r["max"]


def test_the_benchmark_times_train_itself_part_by_part_through_its_hooks():
    """Stepper's steps are train()'s (no copy of the step): each timed call is
    one train() of a warm-up step and n timed ones, and StepClock splits each
    step at the loop's hooks. A delay planted after the reduce (an installed
    on_reduced hook, run before the clock's) lands in the reduce part only."""
    from dormouse.bench.stepper import Stepper
    from dormouse.train.hooks import Hooks, install

    s = Stepper("tiny", 2, 16)
    assert s.timed(2) and len(s.losses) == 3  # 1 warm-up + 2 timed steps of one train()
    parts = s.clock.parts
    assert [len(v) for v in parts.values()] == [2, 2, 2]
    for i, step in enumerate(s.clock.steps):
        assert sum(p[i] for p in parts.values()) == pytest.approx(step)
    assert max(parts["reduce"]) < 0.1  # LocalSync has nothing to exchange
    import time

    DELAY = 0.4  # s, far above a tiny step's compute even on a loaded machine
    remove = install(Hooks(on_reduced=[lambda state: time.sleep(DELAY)]))
    try:
        timed = s.timed(2)
    finally:
        remove()
    assert all(r >= DELAY for r in parts["reduce"][-2:]) and all(t >= DELAY for t in timed)
    assert all(c < DELAY for c in parts["compute"][-2:])


def test_a_section_that_fails_leaves_its_figures_null_and_says_why_while_the_others_stand(tmp_path):
    """The bench is a table of sections run in turn: a failure of a kind the
    section catches becomes a note (and, kept, details["<name>_error"]); its
    figures stay null; the sections after it still run. A failure of another
    kind ends the bench."""
    from dormouse.bench.core import FIGURES, LAUNCH_FAILED, SECTIONS, Section, run_sections

    def boom(quick, tmp, log):
        raise RuntimeError("launch refused")

    table = (Section("one", "one ...", lambda quick, tmp, log: {"v": 0.97}, lambda d: {"fleet_vs_ddp": d["v"]},
                     detail="one"),
             Section("two", "two ...", boom, lambda d: {"exact_vs_ring": 1.0}, detail="two",
                     failed="two failed", catch=LAUNCH_FAILED, keep_error=True),
             Section("three", "three ...", lambda quick, tmp, log: {"sections_s": {"a": 1.0, "b": 2.0}},
                     lambda d: {}, detail="three"))
    lines = []
    res, details, seconds, notes = run_sections(table, True, tmp_path, lines.append, 0.0)
    assert list(res) == list(FIGURES) and res["fleet_vs_ddp"] == 0.97 and res["exact_vs_ring"] is None
    assert details == {"one": {"v": 0.97}, "two_error": "launch refused", "three": {"sections_s": {"a": 1.0, "b": 2.0}}}
    assert notes == ["two failed: launch refused"]
    assert list(seconds) == ["one", "two", "a", "b"] and lines[0] == "one ..."
    with pytest.raises(RuntimeError, match="launch refused"):
        run_sections((dataclasses.replace(table[1], catch=()),), True, tmp_path, lines.append, 0.0)
    assert [s.name for s in SECTIONS] == ["single", "fleet", "exact", "recorder", "recorder_2d", "launch", "sensitivity",
                                          "pipeline"]
