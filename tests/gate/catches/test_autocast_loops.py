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

import casecheck
import catalogue
import looprec
import pytest
from looprec import launch

from dormouse.gate.judge.bounds import GRAD_RTOL

@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("autocast")
    launch([{**cfg, "out": str(root / name)} for name, cfg in catalogue.runs("autocast").items()], root)
    return {name: root / name for name in catalogue.ids("autocast")}


@casecheck.rows("autocast")
def test_the_verdict_is_the_catalogues(recordings, case):
    """A clean run passes within ten times its measured floor (measured: the clean fleet 3.5e-3 from the
    reference, the floor 3.4e-3, the bound 3.4e-2); each fault fails for its named reason (tests/support/
    catalogue.py, the "autocast" rows)."""
    casecheck.holds(recordings[case.id], case)


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
    g = looprec.verdict(recordings["clean"]).check("gradient")  # its row: PASS, the autocast floor named
    assert GRAD_RTOL < g.bound and g.worst <= g.bound, g.reason


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


@pytest.mark.parametrize("fault", ["micro_mean", "comp_twice"])
def test_a_wrong_weighting_under_autocast_fails_far_above_its_bound(recordings, fault):
    v = looprec.verdict(recordings[fault])  # its row: the gradient fails, named
    assert v.check("gradient").worst > 10 * v.check("gradient").bound  # 0.5 and 1.0 against 3.4e-2


def test_a_cuda_autocast_recording_is_refused_in_one_line():
    from dormouse.gate.record.reference import ReferenceError
    from dormouse.gate.record.reference.forward import autocast

    with pytest.raises(ReferenceError, match="cuda autocast .*record a CPU run, or the run without autocast"):
        autocast({"device_type": "cuda", "dtype": "bfloat16"})
    with pytest.raises(ReferenceError, match="a dtype 'bfloat17' torch does not have"):
        autocast({"device_type": "cpu", "dtype": "bfloat17"})


# (rank1_fp32's row: rank 1 computes in float32 while rank 0 runs under bfloat16 autocast; the
# reference would mirror the mixture, so the split itself is the finding, on the ranks line)


def test_fsdp2_mixed_precision_is_recorded_and_judged_on_cast_parameters(recordings):
    # Measured: floor 3.7e-3 (bound 3.7e-2), the clean fleet 4.3e-3; its logged loss, computed
    # from bfloat16 logits, 3.1e-3 from the float32 objective against a loss floor of 1.2e-3
    from dormouse.gate import artifacts as A

    rec = A.RecordingSet(recordings["fsdp_mp"])
    assert rec.compute_dtypes() == ["bfloat16"] and rec.autocast_dtypes() == []
    assert all(rec.compute_dtype(r, k, m) == "bfloat16" for k in rec.steps for r in range(2) for m in range(3))
    g = looprec.verdict(recordings["fsdp_mp"]).check("gradient")  # its row: PASS, the compute floor named
    assert GRAD_RTOL < g.bound, g.reason  # (fsdp_mp_comp_twice's row: the compensation twice fails, named)


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
    # its row: the gradient fails in tensor ln1.bias, above that tensor's bound
