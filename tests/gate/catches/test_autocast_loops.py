"""The Recorder under bfloat16 autocast: the plain DDP loop (tests/support/
ddp_loop.py, 2 gloo ranks under torchrun, gradient accumulation 3) runs its
forward and loss under torch.autocast("cpu", torch.bfloat16). The pre-hook
records each micro-batch's autocast and the reference computes each
micro-batch under the same one. The bfloat16 round-off of the backward
depends on the scale the loop backpropagates its loss at (its
normalisation, the thing under test), so the reference measures it (the
same gradient through a loss scaled by 1/3) and the bounds are 10x that
floor: a clean run passes, a wrong weighting fails for its named reason, and
without the recorded autocast the clean run fails at the float32 bound.
FSDP2's mixed precision (parameters cast to bfloat16 for the forward, no
autocast) is recorded and judged the same way."""

from __future__ import annotations

import json
import shutil

import looprec
import pytest
from looprec import failing, launch

from dormouse.gate.judge.bounds import GRAD_RTOL

RUNS = {
    "clean": {"seed": 8, "autocast": True},
    "micro_mean": {"seed": 8, "autocast": True, "fault": "micro_mean"},
    "comp_twice": {"seed": 8, "autocast": True, "fault": "comp_twice"},
    "rank1_fp32": {"seed": 8, "autocast": True, "fault": "rank1_fp32"},
    "bias_x2": {"seed": 8, "autocast": True, "fault": "bias_x2"},  # one small tensor's gradient doubled
    # FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): no autocast, the
    # parameters cast for the forward (the submodules' pre-hooks see them unsharded and cast)
    "fsdp_mp": {"seed": 9, "fsdp": True, "fsdp_mp": True},
    "fsdp_mp_comp_twice": {"seed": 9, "fsdp": True, "fsdp_mp": True, "fault": "comp_twice"},
}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("autocast")
    launch([{"steps": 3, **cfg, "out": str(root / name)} for name, cfg in RUNS.items()], root)
    return {name: root / name for name in RUNS}


def test_each_micro_batch_records_its_autocast(recordings):
    from dormouse.gate import artifacts as A

    rec = A.RecordingSet(recordings["clean"])
    assert rec.autocast_dtypes() == ["bfloat16"]
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            n = rec.step_meta(r, k)["micro_batches"]
            assert n == 3 and [rec.autocast(r, k, m) for m in range(n)] == \
                [{"device_type": "cpu", "dtype": "bfloat16"}] * n


def test_a_clean_autocast_run_passes_within_ten_times_its_measured_floor(recordings):
    v = looprec.verdict(recordings["clean"])
    assert v.passed, failing(v)
    g = v.check("gradient")
    # measured here: the clean fleet 3.5e-3 from the reference, the floor 3.4e-3, the bound 3.4e-2
    assert GRAD_RTOL < g.bound and g.worst <= g.bound, g.reason
    assert "autocast floor" in g.reason and "bfloat16 autocast" in g.reason, g.reason
    assert "autocast floor" in v.check("independence").reason and "autocast floor" in v.check("clip").reason


def test_without_the_recorded_autocast_the_same_run_fails_by_round_off(recordings, tmp_path):
    # The reference in float32 against the loop's bfloat16 forward: the
    # difference is precision alone, and it is far above the float32 bound.
    dst = tmp_path / "forgot"
    shutil.copytree(recordings["clean"], dst, ignore=shutil.ignore_patterns("reference"))
    for path in dst.rglob("*.json"):
        meta = json.loads(path.read_text())
        if "autocast" in meta:
            meta["autocast"] = []
            path.write_text(json.dumps(meta))
    v = looprec.verdict(dst)
    g = v.check("gradient")
    assert not g.passed and g.worst > 10 * GRAD_RTOL, g.reason


@pytest.mark.parametrize("fault, words", [("micro_mean", "mean of per-micro-batch token means"),
                                          ("comp_twice", "= W ")])
def test_a_wrong_weighting_under_autocast_fails_for_its_named_reason(recordings, fault, words):
    v = looprec.verdict(recordings[fault])
    looprec.fails_for(v, "gradient", words)
    assert v.check("gradient").worst > 10 * v.check("gradient").bound  # 0.5 and 1.0 against 3.4e-2


def test_a_cuda_autocast_recording_is_refused_in_one_line():
    from dormouse.gate.record.reference import ReferenceError, _autocast

    with pytest.raises(ReferenceError, match="cuda autocast .*record a CPU run, or the run without autocast"):
        _autocast({"device_type": "cuda", "dtype": "bfloat16"})
    with pytest.raises(ReferenceError, match="a dtype 'bfloat17' torch does not have"):
        _autocast({"device_type": "cpu", "dtype": "bfloat17"})


def test_a_rank_outside_the_fleets_autocast_fails_the_ranks_check(recordings):
    # rank 1 computes in float32 while rank 0 runs under bfloat16 autocast: the
    # reference would mirror the mixture, so the split itself is the finding
    looprec.fails_for(looprec.verdict(recordings["rank1_fp32"]), "ranks",
                      "rank 1 ran micro-batch 0 under no autocast, rank 0 under cpu bfloat16 autocast: the "
                      "fleet's ranks do not compute in one precision")


def test_fsdp2_mixed_precision_is_recorded_and_judged_on_cast_parameters(recordings):
    # Measured: floor 3.7e-3 (bound 3.7e-2), the clean fleet 4.3e-3; its logged loss, computed
    # from bfloat16 logits, 3.1e-3 from the float32 objective against a loss floor of 1.2e-3
    from dormouse.gate import artifacts as A

    rec = A.RecordingSet(recordings["fsdp_mp"])
    assert rec.compute_dtypes() == ["bfloat16"] and rec.autocast_dtypes() == []
    assert all(rec.compute_dtype(r, k, m) == "bfloat16" for k in rec.steps for r in range(2) for m in range(3))
    v = looprec.verdict(recordings["fsdp_mp"])
    assert v.passed, failing(v)
    g, loss = v.check("gradient"), v.check("loss")
    assert GRAD_RTOL < g.bound and "bfloat16 compute floor" in g.reason and "cast to bfloat16" in g.reason
    assert "loss floor" in loss.reason, loss.reason
    fault = looprec.verdict(recordings["fsdp_mp_comp_twice"])
    looprec.fails_for(fault, "gradient", "= W ")


def test_a_small_tensors_fault_under_autocast_states_the_per_tensor_bound_that_failed(recordings):
    """ln1.bias's gradient doubled after the all-reduce: diluted in the global norm, it is caught by that
    tensor's own bound (10 x its own bfloat16 floor). The verdict stated the global bound (a few
    hundredths) beside it; it now names the tensor's bound that failed. This file's arithmetic: the
    recorded ln1.bias gradient is doubled on every rank, its norm a small share
    of the whole gradient's."""
    from dormouse.gate import artifacts as A

    out = recordings["bias_x2"]
    rec = A.RecordingSet(out)
    g = rec.tensors_at(1, "g/")
    share = float(g["ln1.bias"].double().norm() / sum(float((t.double() ** 2).sum()) for t in g.values()) ** 0.5)
    assert share < 0.1  # halved, it moves the whole gradient by less than 5 %: the global bound dilutes it
    v = looprec.verdict(out)
    looprec.fails_for(v, "gradient", "in tensor ln1.bias by 1 at step 1, above that tensor's bound")
    assert "x that tensor's own floor" in v.check("gradient").reason
