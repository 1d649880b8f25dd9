"""dormouse.bench.core's own arithmetic: the matmul rate in a dtype, each part
of the step against its dtype's rate, the sampling rate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dormouse.bench.core import matmul_rate, ns_matmul_dtype, parts_at_rates, sampling_rate, step_flops
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
