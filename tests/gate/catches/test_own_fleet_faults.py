"""The pytest gate: whole gates (the fleet under torchrun, recorded; the single
process, gradref, the recording's one-process reference, the verdict) on real gloo fleets — clean fleets pass for
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

from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import FLOOR, GRADREF, SINGLE, GateReferences, RecordingSet
from dormouse.gate.judge.bounds import BIAS_FLOOR, BIAS_SIGMAS, GRAD_RTOL
from dormouse.gate.judge.entry import judge
from dormouse.gate.settings import GateSettings
from gatekit import copy_of, fleets, references

CLEAN = {
    # profile "4,2", 20 steps, shuffled data order, clip, wd, warm-up, cosine, eval;
    # the fleet stops at step 10 and resumes in one process (resume_world 1)
    "default": {},
    "resume3": {"resume_world": 3, "steps": 6},  # ... or at three ranks of 2 windows (after step 3)
    "fsdp": {"shard": "fsdp", "steps": 6},  # FSDP2's clip norm is its own order
    "adamw": {"opt": "adamw", "steps": 6},
    "bf16": {"reduce": "bf16", "steps": 6},  # the Recorder declares the bf16 wire
    "buckets": {"bucket_mb": 0.05},  # ~13 buckets instead of one (20 steps: its end is the default's, bitwise)
    "mixed": {"profile": "4x32,2x64", "resume_world": 0, "steps": 6},  # no single process holds this batch
    "sequential": {"data_order": "sequential", "profile": "", "steps": 6},
}
# outside CI's time (`pytest -m slow`): AdamW (the HF, Lightning and plain loops train with it) and the
# sequential data order. The fixture trains only the configurations the session's tests ask for.
SLOW = ("adamw", "sequential")


@pytest.fixture(scope="module")
def clean(tmp_path_factory, request) -> dict[str, Path]:
    """Every clean gate of this file. The default one is the session's
    pipeline run at the defaults (gate_run: the same settings, so the same
    gate; computed once for the suite), taken after this file's own fleets so
    that a worker rarely waits for the other's pipeline."""
    base = tmp_path_factory.mktemp("clean")
    asked = {item.callspec.params.get("name") for item in request.session.items
             if item.path == request.path and hasattr(item, "callspec")}
    plan = {name: GateSettings(out=str(base / name), **extra).validate()
            for name, extra in CLEAN.items() if name != "default" and (name not in SLOW or name in asked)}
    fleets(list(plan.values()))
    for s in plan.values():
        references(s)
    _, _, pipeline_out = request.getfixturevalue("gate_run")
    default = copy_of(pipeline_out, base / "default")
    assert RecordingSet(default).extra["settings"] == GateSettings(out=str(default)).validate().record()
    return {"default": default, **{name: s.out_dir for name, s in plan.items()}}


def passed(out: Path):
    v = judge(out)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    return v


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CLEAN])
def test_a_clean_fleet_passes_every_check_that_applies(clean, name):
    v = passed(clean[name])
    names = [c.name for c in v.checks]
    assert names[0] == "complete" and names.index("provenance") > names.index("ranks")
    assert {"independence", "gradient", "replay", "buffers", "data", "gradref", "config"} <= set(names)
    assert ("curve" in names) == (name != "mixed")


def test_the_default_gate_exercises_clipping_the_schedule_and_a_data_wrap(clean):
    rec = RecordingSet(clean["default"])
    train = rec.meta["build_kwargs"]["run"]["train"]
    assert train["grad_clip"] > 0 and train["wd"] > 0 and train["warmup"] > 0 and train["schedule"] == "cosine"
    assert any(rec.step_meta(0, k)["clip_coef"] < 1 for k in rec.steps)  # the clip bound at some step
    g = GateReferences(clean["default"]).meta(GRADREF)
    corpus = (clean["default"] / "corpus.bin").stat().st_size
    span = sum(b * (t + 1) for b, t in g["profile"])
    assert corpus % span and len(g["steps"]) > (corpus - int(corpus * train["eval_frac"])) // span  # wraps


def test_the_fleet_stops_midway_and_resumes_at_another_world_size(clean):
    for name, worlds, steps in (("default", [2, 1], 20), ("resume3", [2, 3], 6)):
        rec = RecordingSet(clean[name])
        assert rec.resumed_at() == [steps // 2 + 1] and [s["world"] for s in rec.meta["segments"]] == worlds
        assert rec.steps == list(range(1, steps + 1)) and rec.world_at(1) == 2 and rec.world_at(steps) == worlds[1]
        v = passed(clean[name])
        assert f"bitwise at all {steps} steps, across 1 resume(s)" in v.check("replay").reason


def test_per_step_references_agree_to_round_off_and_the_replay_is_bitwise(clean):
    v = passed(clean["default"])
    gradient, independence = v.check("gradient"), v.check("independence")
    assert len(gradient.per_step) == 20 and 0 < gradient.worst <= GRAD_RTOL
    assert "bound 1e-05" in independence.reason and "zero wherever one process's is exactly zero" in gradient.reason
    assert "bitwise at all 20 steps" in v.check("replay").reason and v.check("buffers").passed
    assert "every window of every step" in v.check("gradref").reason


def test_the_curve_tolerance_comes_from_ulp_nudges_alone(clean):
    floor = GateReferences(clean["default"]).meta(FLOOR)
    assert sorted(floor["runs"]) == ["ulp0", "ulp1", "ulp2"]  # no micro-batched (split) floor run
    curve = judge(clean["default"]).check("curve")
    assert max(curve.noise_floor) > 0 and max(curve.tolerance) < 1e-4
    assert curve.grad_step1 <= GRAD_RTOL


def test_bf16_reduce_stays_within_its_bound_unbiased_and_within_its_measured_floor(clean):
    v = passed(clean["bf16"])
    assert RecordingSet(clean["bf16"]).meta["wire"] == "bf16"  # declared by the fleet's own recording
    g = v.check("gradient")  # bf16 really ran: beyond the fp32 bound, within its own
    assert g.worst > 1e-5 and "the declared bf16 wire's bound" in g.reason
    bias = v.check("bias")
    assert max(map(abs, bias.stats.values())) <= BIAS_SIGMAS and bias.smallest == BIAS_FLOOR["decay"]  # 0.2% of the bound
    floor = GateReferences(clean["bf16"]).meta(FLOOR)["runs"]
    assert sorted(floor) == ["ulp0", "wire0", "wire1", "wire2"]  # rounded as the wire rounds; none splits the batch
    curve = v.check("curve")
    assert "rounded to bfloat16 as the wire rounds" in curve.tolerance_why and curve.first_divergent_param is None
    fp32 = RecordingSet(clean["default"]).losses()
    bf16 = RecordingSet(clean["bf16"]).losses()
    assert 0 < max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16))


def test_the_logged_and_eval_losses_equal_gradrefs_in_every_clean_fleet(clean):
    for name in ("default", "mixed", "fsdp", "bf16"):
        v = judge(clean[name])
        assert v.check("loss").passed and "worst" in v.check("loss").reason, (name, v.check("loss").reason)
        evals = "[5, 10" if name == "default" else "[5]"  # an eval every 5 steps; the others run 6
        assert f"eval losses at steps {evals}" in v.check("gradref").reason, (name, v.check("gradref").reason)


def test_many_buckets_end_bitwise_equal_to_one_and_fsdp_reduces_the_same_first_gradient(clean):
    a, b = RecordingSet(clean["default"]).final("p/"), RecordingSet(clean["buckets"]).final("p/")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Two-term sums commute: FSDP's reduce-scatter gives the all-reduce's
    # gradient bitwise (before clipping: each clips by its own norm). Its
    # clipping norm sums shard norms in another order, so later steps part by
    # round-off (the clip check bounds that norm).
    def first(out):
        rec = RecordingSet(out)
        return rec.tensors_at(1, "g/"), rec.step_meta(0, 1)["clip_coef"]

    (ga, ca), (gf, cf) = first(clean["default"]), first(clean["fsdp"])
    if ca == cf == 1.0:  # neither clipped at step 1: the applied gradients are the reduced ones, bitwise
        assert all(torch.equal(ga[k], gf[k]) for k in ga)
    else:  # each scaled by its own coefficient (norms summed in other orders): a few ulps apart
        assert all(torch.allclose(ga[k] / ca, gf[k] / cf, rtol=2 ** -21, atol=0) for k in ga)


# --------------------------------------------------------------------------- a PASS needs every reference


def test_a_fleet_recording_alone_is_incomplete_never_a_pass(clean, tmp_path):
    shutil.copytree(clean["default"], tmp_path / "g", ignore=shutil.ignore_patterns("ckpts"))
    for name in (SINGLE,):
        shutil.rmtree(A.gate_reference_dir(tmp_path / "g", name))
    for name in (FLOOR, GRADREF):
        A.gate_reference_path(tmp_path / "g", name).unlink()
    v = judge(tmp_path / "g")
    assert not v.passed
    assert v.checks[0].name == "complete" and "incomplete: no single, no floor, no gradref" in v.checks[0].reason


def test_a_recording_whose_settings_lost_the_profile_still_needs_the_single_process(clean, tmp_path):
    """Which references apply comes from the settings: a recording whose
    settings lost their profile does not make single optional."""
    shutil.copytree(clean["default"], tmp_path / "g", ignore=shutil.ignore_patterns("ckpts"))
    rec = json.loads(A.recording_path(tmp_path / "g").read_text())
    rec["extra"]["settings"]["profile"] = ""
    A.recording_path(tmp_path / "g").write_text(json.dumps(rec))
    shutil.rmtree(A.gate_reference_dir(tmp_path / "g", SINGLE))
    v = judge(tmp_path / "g")
    assert not v.passed and "incomplete: no single" in v.check("complete").reason


def test_artifacts_from_other_code_are_refused_naming_the_source(clean, tmp_path):
    shutil.copytree(clean["default"], tmp_path / "g", ignore=shutil.ignore_patterns("ckpts"))
    path = A.gate_reference_path(tmp_path / "g", GRADREF)
    meta = json.loads(path.read_text())
    meta["provenance"]["source"] = "0" * 64  # gradref made by an older checkout
    path.write_text(json.dumps(meta))
    v = judge(tmp_path / "g")
    c = v.check("provenance")
    assert not v.passed and not c.passed and "gradref's source" in c.reason and "re-run every mode" in c.reason


def test_a_nan_in_a_logged_loss_fails_by_name(clean, tmp_path):
    shutil.copytree(clean["default"], tmp_path / "g", ignore=shutil.ignore_patterns("ckpts"))
    path = A.step_meta_path(tmp_path / "g", 0, 5)
    meta = json.loads(path.read_text())
    meta["loss"] = float("nan")
    path.write_text(json.dumps(meta))
    v = judge(tmp_path / "g")
    assert not v.passed and not v.check("finite").passed and "step 5" in v.check("finite").reason


def test_verdict_json_follows_its_published_schema_and_the_schema_rejects_a_broken_one(clean, tmp_path):
    import jsonschema

    from dormouse.gate.show.text import write_verdict
    from dormouse.gate.settings import REPO_ROOT

    schema = json.loads((REPO_ROOT / "docs" / "verdict.schema.json").read_text())
    path = write_verdict(judge(clean["default"]), tmp_path)
    verdict = json.loads(path.read_text())
    jsonschema.validate(verdict, schema)
    assert verdict["schema"] == 1 and len(verdict["provenance"]["source"]) == 64
    verdict["checks"]["gradient"]["pass"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(verdict, schema)


def test_the_verdict_writes_its_per_step_divergence_and_bounds_to_tensorboard(clean, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dormouse.gate.show.text import write_tensorboard

    write_tensorboard(judge(clean["default"]), tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"gate/gradient/worst", "gate/gradient/bound", "gate/curve/tolerance"} <= tags
    worst = [e.value for e in events.Scalars("gate/gradient/worst")]
    assert len(worst) == 20 and 0 < max(worst) <= GRAD_RTOL
