"""The pytest gate: whole gates (the fleet under torchrun, the single process,
gradref, the replay, the verdict) on real gloo fleets — clean fleets pass for
the reasons stated, and planted faults fail each for its own named reason.

The clean world-2 fleets share ONE torchrun launch (a plan: several runs one
after another in the same process group, the same code path as one run per
launch), and so do the faulty ones (each run with its own fault).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dormouse.gate.record import modes
from dormouse.gate.artifacts import load_meta, load_tensors
from dormouse.gate.judge.bounds import BIAS_FLOOR, BIAS_SIGMAS, GRAD_RTOL, LOSS_RTOL, WINDOW_RTOL
from dormouse.gate.judge.entry import judge, judge_recording
from dormouse.gate.settings import GateSettings
from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import fleet_recording_dir
from dormouse.gate.record.reference import make_reference
from gatekit import QUIET, copy_of, faulty_fleets, fleets, judged, references

CLEAN = {
    # profile "4,2", 20 steps, shuffled data order, clip, wd, warm-up, cosine, eval;
    # the fleet stops at step 10 and resumes in one process (resume_world 1)
    "default": {},
    "resume3": {"resume_world": 3, "steps": 10},  # ... or at three ranks of 2 windows (after step 5)
    "fsdp": {"shard": "fsdp", "steps": 10, "recording": 1},  # recorded: FSDP2's clip norm is its own order
    "adamw": {"opt": "adamw", "steps": 10},
    "bf16": {"reduce": "bf16", "steps": 10, "recording": 1},  # recorded: the Recorder declares the bf16 wire
    "buckets": {"bucket_mb": 0.05},  # ~13 buckets instead of one
    "mixed": {"profile": "4x32,2x64", "resume_world": 0, "steps": 10},  # no single process holds this batch
    # ... and records itself through the Recorder too (judged by `dormouse gate check`)
    "sequential": {"data_order": "sequential", "profile": "", "steps": 10, "recording": 1},
}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, request) -> dict[str, Path]:
    """Every clean gate of this file. The default one is the session's
    pipeline run at the defaults (gate_run: the same settings, so the same
    gate; computed once for the suite), taken after this file's own fleets so
    that a worker rarely waits for the other's pipeline."""
    base = tmp_path_factory.mktemp("clean")
    plan = {name: GateSettings(out=str(base / name), **extra).validate()
            for name, extra in CLEAN.items() if name != "default"}
    fleets(list(plan.values()))
    for s in plan.values():
        references(s)
    _, _, pipeline_out = request.getfixturevalue("gate_run")
    default = copy_of(pipeline_out, base / "default")
    assert load_meta(default, "rank0")["settings"] == GateSettings(out=str(default)).validate().record()
    return {"default": default, **{name: s.out_dir for name, s in plan.items()}}


def passed(out: Path):
    v = judge(out)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    return v


@pytest.mark.parametrize("name", list(CLEAN))
def test_a_clean_fleet_passes_every_check_that_applies(clean, name):
    v = passed(clean[name])
    names = [c.name for c in v.checks]
    assert names[:5] == ["complete", "provenance", "config", "finite", "ranks"]
    assert {"window", "gradref", "replay"} <= set(names)
    assert ("curve" in names) == (name != "mixed")


def test_the_default_gate_exercises_clipping_the_schedule_and_a_data_wrap(clean):
    meta = load_meta(clean["default"], "rank0")
    train = meta["config"]["train"]
    assert train["grad_clip"] > 0 and train["wd"] > 0 and train["warmup"] > 0 and train["schedule"] == "cosine"
    trace = modes.load_trace(clean["default"], "rank0")
    assert (trace["clip"] < 1).any()  # the clip bound at some step
    g = load_meta(clean["default"], "gradref")
    corpus = (clean["default"] / "corpus.bin").stat().st_size
    span = sum(b * (t + 1) for b, t in g["profile"])
    assert corpus % span and g["steps"] > (corpus - int(corpus * train["eval_frac"])) // span  # wraps


def test_the_fleet_stops_midway_and_resumes_at_another_world_size(clean):
    for name, worlds, steps in (("default", [2, 1], 20), ("resume3", [2, 3], 10)):
        meta = load_meta(clean[name], "rank0")
        assert meta["resumed_at"] == steps // 2 and [w for w, _ in meta["legs"]] == worlds
        assert meta["world_size"] == worlds[1] and len(meta["losses"]) == steps
        assert load_meta(clean[name], "leg1_rank1")["world_size"] == 2


def test_per_step_references_agree_to_round_off_and_the_replay_is_bitwise(clean):
    v = passed(clean["default"])
    gradref, window, replay = v.check("gradref"), v.check("window"), v.check("replay")
    assert len(gradref.per_step) == 20 and 0 < gradref.worst <= GRAD_RTOL
    assert 0 <= window.worst <= WINDOW_RTOL
    assert replay.steps_equal == [True] * 20


def test_the_curve_tolerance_comes_from_ulp_nudges_alone(clean):
    single = load_meta(clean["default"], "single")
    assert sorted(single["floor"]) == ["ulp0", "ulp1", "ulp2"]  # no micro-batched (split) floor run
    curve = judge(clean["default"]).check("curve")
    assert max(curve.noise_floor) > 0 and max(curve.tolerance) < 1e-4
    assert curve.grad_step1 <= GRAD_RTOL


def test_bf16_reduce_stays_within_its_bound_unbiased_and_within_its_measured_floor(clean):
    v = passed(clean["bf16"])
    assert v.check("gradref").worst > 1e-5  # bf16 really ran: beyond the fp32 bound, within its own
    bias = v.check("bias")
    assert max(map(abs, bias.stats.values())) <= BIAS_SIGMAS and bias.smallest == BIAS_FLOOR["decay"]  # 0.2% of the bound
    floor = load_meta(clean["bf16"], "single")["floor"]
    assert sorted(floor) == ["ulp0", "wire0", "wire1", "wire2"]  # rounded as the wire rounds; none splits the batch
    curve = v.check("curve")
    assert "rounded to bfloat16 as the wire rounds" in curve.tolerance_why and curve.first_divergent_param is None
    fp32 = load_meta(clean["default"], "rank0")["losses"]
    bf16 = load_meta(clean["bf16"], "rank0")["losses"]
    assert 0 < max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16))


def test_the_logged_and_eval_losses_equal_gradrefs_in_every_clean_fleet(clean):
    for name in ("default", "mixed", "fsdp", "bf16"):
        loss = judge(clean[name]).check("loss")
        assert loss.passed and loss.worst <= LOSS_RTOL / 10, (name, loss.reason)
        assert "eval losses at steps [5, 10" in loss.reason


def test_many_buckets_end_bitwise_equal_to_one_and_fsdp_reduces_the_same_first_gradient(clean):
    a, b = load_tensors(clean["default"], "rank0"), load_tensors(clean["buckets"], "rank0")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Two-term sums commute: FSDP's reduce-scatter gives the all-reduce's
    # gradient bitwise. Its clipping norm sums shard norms in another order,
    # so later steps part by round-off (the replay check bounds that norm).
    ta, tf = modes.load_trace(clean["default"], "rank0"), modes.load_trace(clean["fsdp"], "rank0")
    grads = [k for k in ta if k.startswith("g/")]
    assert all(torch.equal(ta[k][0], tf[k][0]) for k in grads)


# --------------------------------------------------------------------------- a PASS needs every reference


def test_rank_artifacts_alone_are_incomplete_never_a_pass(clean, tmp_path):
    for f in clean["default"].glob("rank*"):
        shutil.copy(f, tmp_path / f.name)
    v = judge(tmp_path)
    assert not v.passed
    assert v.checks[0].name == "complete" and "incomplete: no single, no init, no gradref, no replay" in v.checks[0].reason


def test_a_rank_artifact_without_its_profile_still_needs_the_single_process(clean, tmp_path):
    """Which references apply comes from the settings: a rank artifact that
    lost its profile (rank_shapes) does not make single optional."""
    shutil.copytree(clean["default"], tmp_path / "g")
    for f in (tmp_path / "g").glob("*rank*.json"):
        meta = json.loads(f.read_text())
        meta.pop("rank_shapes", None)
        f.write_text(json.dumps(meta))
    (tmp_path / "g" / "single.json").unlink()
    v = judge(tmp_path / "g")
    assert not v.passed and v.check("complete").reason.startswith("incomplete: no single")


def test_artifacts_from_other_code_are_refused_naming_the_source(clean, tmp_path):
    shutil.copytree(clean["default"], tmp_path / "g")
    meta = json.loads((tmp_path / "g" / "gradref.json").read_text())
    meta["provenance"]["source"] = "0" * 64  # gradref made by an older checkout
    (tmp_path / "g" / "gradref.json").write_text(json.dumps(meta))
    v = judge(tmp_path / "g")
    c = v.check("provenance")
    assert not v.passed and not c.passed and "gradref's source" in c.reason and "re-run every mode" in c.reason


def test_a_nan_in_a_compared_series_fails_by_name(clean, tmp_path):
    shutil.copytree(clean["default"], tmp_path / "g")
    meta = json.loads((tmp_path / "g" / "rank0.json").read_text())
    meta["losses"][4] = float("nan")
    (tmp_path / "g" / "rank0.json").write_text(json.dumps(meta))
    v = judge(tmp_path / "g")
    assert not v.passed and "rank0's loss is not finite at step 5" in v.check("finite").reason


# --------------------------------------------------------------------------- planted faults

# Every faulty fleet here runs in ONE torchrun launch (a plan, each run with its
# own fault: fleet_faults.scoped undoes a fault after its run), without the
# stop-and-resume (resume_world 0: no fault here is about the resume), and a
# clean run last in the same launch shows that no fault leaks into the next run.
FAULTY = {
    "grad_x2": ("grad_x2", {"steps": 6}),
    "window_weights": ("window_weights", {"profile": "4x32,2x64", "steps": 6}),
    # made-up gradient where every window's is exactly zero, under mixed lengths (no curve)
    "zero_fill": ("zero_fill", {"profile": "4x32,1x64", "steps": 6}),
    "plain_mean": ("plain_mean", {"steps": 5, "recording": 1}),  # recorded through the Recorder too
    "loads_reversed": ("loads_reversed", {"steps": 3, "recording": 1}),  # the routing bias by the loads reversed
    "wrong_step": ("wrong_step", {"steps": 6}),
    "batch_stats": ("batch_stats", {"steps": 5}),
    "skip_param": ("skip_param", {"steps": 3}),
    "seeds": ("seeds", {"steps": 3}),
    "capacity_moe": ("capacity_moe", {"steps": 3}),
    "clean_after": (None, {"steps": 3}),
}
EVERYWHERE = {"batch_stats", "capacity_moe"}  # faults in the network itself: the references run it too


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("faulty")
    plan = {name: GateSettings(out=str(base / name), resume_world=0, **extra).validate()
            for name, (_, extra) in FAULTY.items()}
    faulty_fleets([(plan[name], fault) for name, (fault, _) in FAULTY.items()])
    return plan


def faulty_gate(faulty, name):
    return judged(faulty[name], FAULTY[name][0] if name in EVERYWHERE else None)


def test_gradient_times_two_fails_gradref_and_the_curve_at_step_one(faulty):
    v = faulty_gate(faulty, "grad_x2")
    assert not v.passed
    g = v.check("gradref")
    assert not g.passed and "at step 1" in g.reason and g.worst > 0.5
    c = v.check("curve")
    assert not c.passed and "step-1 gradients differ" in c.reason
    assert v.check("replay").passed  # the fleet applied its (wrong) gradient faithfully


def test_window_weighting_under_mixed_window_lengths_fails_gradref(faulty):
    v = faulty_gate(faulty, "window_weights")
    g = v.check("gradref")
    assert not v.passed and not g.passed and "at step 1" in g.reason and g.worst > 1e-2
    assert v.check("window").passed  # the network is fine; the fleet's weights are not


@pytest.mark.parametrize("name", ["sequential", "fsdp"])
def test_the_fleets_recording_passes_the_recording_judge_across_its_resume(clean, name):
    out = fleet_recording_dir(clean[name])
    make_reference(out, log=QUIET)
    v = judge_recording(out)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    assert [seg["world"] for seg in A.RecordingSet(out).meta["segments"]] == [2, 1]  # stopped at 5, resumed alone
    assert "bitwise at all 10 steps, across 1 resume(s)" in v.check("replay").reason
    assert "equal the one-process gradient's at every step" in v.check("clip").reason  # the loop's own norm
    assert "block.moe.router_bias follows the declared update" in v.check("buffers").reason  # across the resume


def test_the_bf16_fleets_recording_declares_its_wire_and_passes_within_the_wires_bound(clean):
    """The gate's own bf16 fleet records through the Recorder with wire='bf16': the recording judge holds
    its gradient to the wire's element bound (beyond the float32 one: the wire really rounded) and finds
    its rounding unbiased, across the stop and resume."""
    out = fleet_recording_dir(clean["bf16"])
    assert A.RecordingSet(out).meta["wire"] == "bf16"
    make_reference(out, log=QUIET)
    v = judge_recording(out)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    assert "the declared bf16 wire's bound" in v.check("gradient").reason and v.check("gradient").worst > 1e-5
    assert v.check("bias").passed


def test_gradient_made_up_where_every_window_has_none_fails_gradref_exactly(faulty):
    """Within the relative bound (4e-6 of the tensor's largest element), so
    only the exact zeros check sees it (a review's false pass)."""
    v = faulty_gate(faulty, "zero_fill")
    assert not v.passed
    g = v.check("gradref")
    assert not g.passed and g.first_step == 1 and g.worst <= g.bound  # the relative bound alone passes it
    assert "where every window's gradient is exactly zero" in g.reason and "embed.weight" in g.reason, g.reason


def test_plain_mean_instead_of_token_weighting_fails_gradref(faulty):
    v = faulty_gate(faulty, "plain_mean")
    assert not v.passed and not v.check("gradref").passed and v.check("ranks").passed
    # the same fleet's recording: the gradient check names the weighting (one slice per rank, so each
    # rank's own token mean is its micro-batch's), the replay holds (it applied what it computed)
    out = fleet_recording_dir(faulty["plain_mean"].out_dir)
    make_reference(out, log=QUIET)
    r = judge_recording(out)
    g = r.check("gradient")
    assert not r.passed and not g.passed and "not the global mean the objective declares" in g.reason
    assert "at step 1" in g.reason and r.check("replay").passed and r.check("ranks").passed


def test_a_routing_bias_moved_by_the_loads_reversed_fails_gradref_and_the_recordings_buffers_check(faulty):
    v = faulty_gate(faulty, "loads_reversed")
    g = v.check("gradref")
    assert not v.passed and not g.passed and "expert loads the fleet applied differ" in g.reason
    # the same fleet's recording: its gradients and update are right, the bias alone moved wrongly
    out = fleet_recording_dir(faulty["loads_reversed"].out_dir)
    make_reference(out, log=QUIET)
    r = judge_recording(out)
    b = r.check("buffers")
    assert not r.passed and not b.passed and b.reason.startswith("block.moe.router_bias before step 2 is not")
    assert all(c.passed for c in r.checks if c.name != "buffers"), "\n".join(f"{c.name}: {c.reason}" for c in r.checks)


def test_a_fleet_reading_step_k_plus_8s_bytes_fails_gradref(faulty):
    v = faulty_gate(faulty, "wrong_step")
    g = v.check("gradref")
    assert not v.passed and not g.passed and "at step 1" in g.reason


def test_a_batch_dependent_layer_fails_the_window_check_naming_the_reason(faulty):
    v = faulty_gate(faulty, "batch_stats")
    w = v.check("window")
    assert not v.passed and not w.passed
    assert "depends on which windows share a batch" in w.reason and "at step 1" in w.reason


def test_a_parameter_left_out_of_the_reduce_is_named(faulty):
    v = faulty_gate(faulty, "skip_param")
    assert not v.passed
    assert not v.check("ranks").passed and "rank0: head.weight," in v.check("ranks").reason  # named first


def test_ranks_whose_models_start_apart_after_the_start_check_fail_the_ranks_check(faulty):
    v = faulty_gate(faulty, "seeds")
    c = v.check("ranks")
    assert not v.passed and not c.passed and "rank1 vs rank0" in c.reason, c.reason


def test_capacity_dropping_moe_forced_past_the_refusal_fails(faulty):
    v = faulty_gate(faulty, "capacity_moe")
    assert not v.passed
    assert not v.check("window").passed and "depends on which windows share a batch" in v.check("window").reason


def test_a_clean_run_after_faulty_ones_in_the_same_launch_passes_no_fault_leaks(faulty):
    v = faulty_gate(faulty, "clean_after")
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks if not c.passed)


def test_verdict_json_follows_its_published_schema_and_the_schema_rejects_a_broken_one(clean, tmp_path):
    import jsonschema

    from dormouse.gate.show.text import write_verdict
    from dormouse.gate.settings import REPO_ROOT

    schema = json.loads((REPO_ROOT / "docs" / "verdict.schema.json").read_text())
    path = write_verdict(judge(clean["default"]), tmp_path)
    verdict = json.loads(path.read_text())
    jsonschema.validate(verdict, schema)
    assert verdict["schema"] == 1 and len(verdict["provenance"]["source"]) == 64
    verdict["checks"]["gradref"]["pass"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(verdict, schema)


def test_the_verdict_writes_its_per_step_divergence_and_bounds_to_tensorboard(clean, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dormouse.gate.show.text import write_tensorboard

    write_tensorboard(judge(clean["default"]), tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"gate/gradref/worst", "gate/gradref/bound", "gate/curve/tolerance", "gate/replay/equal"} <= tags
    worst = [e.value for e in events.Scalars("gate/gradref/worst")]
    assert len(worst) == 20 and 0 < max(worst) <= GRAD_RTOL
