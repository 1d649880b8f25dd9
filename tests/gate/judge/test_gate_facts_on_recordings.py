"""The facts of dormouse's own gate on a real recording: one small gate run
(a 2-rank fleet stopped and resumed at one rank, reduce "exact", its single
process, floor, exact reference, gradref and the recording's own reference),
made once; each test copies it and plants one thing in the files, then shows
the fact it concerns failing for its stated reason (and the clean copy
passing). The recording's own facts (independence, gradient, replay, ...)
are shown by real loops in tests/gate/catches/."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from gatekit import edit_json, edit_tensors


from dormouse.gate import artifacts as A
from dormouse.gate.artifacts import EXACT, FLOOR, GRADREF, PROVENANCE, SINGLE, GateReferences, references
from dormouse.gate.judge.bounds import CURVE_MIN_RTOL, FLOOR_MULTIPLE
from dormouse.gate.judge.entry import judge
from dormouse.gate.judge.facts.curve import check_curve
from dormouse.gate.judge.facts.exact import check_exact
from dormouse.gate.judge.metrics import first_difference, relative, ulps
from dormouse.gate.judge.verdict import VERDICT_SCHEMA, Check, Verdict

GATE_CHECKS = ["provenance", "config", "gradref", "curve", "exact"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    from dormouse.gate.record import produce
    from dormouse.gate.settings import check

    s = check(out=str(tmp_path_factory.mktemp("gate") / "g"), steps=3, reduce="exact", seed=3)
    produce.ensure_all(s, log=lambda line: None)
    return s.out_dir


@pytest.fixture
def gate(made, tmp_path) -> Path:
    """A copy of the made gate, hard-linked: the edits below replace files atomically (a new inode),
    so the run copied is never touched."""
    out = tmp_path / "g"
    shutil.copytree(made, out, ignore=shutil.ignore_patterns("ckpts"), copy_function=os.link)
    return out


def single_dir(out: Path) -> Path:
    return A.gate_reference_dir(out, SINGLE)


# --------------------------------------------------------------------------- clean


def test_the_clean_gate_passes_every_fact_of_a_recording_and_of_its_own_references(gate):
    v = judge(gate)
    assert v.passed, [c.reason for c in v.checks if not c.passed]
    names = [c.name for c in v.checks]
    assert names[-len(GATE_CHECKS):] == GATE_CHECKS  # after the facts every recording gets
    assert {"gradient", "replay", "independence", "buffers", "data", "ranks"} <= set(names)
    assert v.check("exact").reason.endswith("bitwise equal at all 3 steps")
    assert set(v.references) >= {SINGLE, FLOOR, EXACT, GRADREF}


def test_the_gate_and_a_plain_loops_recording_are_judged_by_one_entry(gate, tmp_path, monkeypatch):
    """The same judge() takes the gate's fleet and a plain loop's recording (a
    user's TinyLM under AdamW, recorded in one process): the same facts, by the
    same functions, in the same order; the gate's recording adds its own
    references' facts after them, because it keeps the gate's settings."""
    import looprec

    from dormouse.gate.pipeline import check_recording

    monkeypatch.syspath_prepend(str(looprec.SUPPORT))
    plain = check_recording(looprec.one_process(tmp_path / "rec", steps=2), log=lambda line: None)
    v = judge(gate)
    names, mine = [c.name for c in v.checks], [c.name for c in plain.checks]
    assert plain.passed and names[-len(GATE_CHECKS):] == GATE_CHECKS
    facts = names[:-len(GATE_CHECKS)]  # every fact of the plain loop's, in its order (the gate's adds buffers)
    assert [n for n in facts if n in mine] == mine and set(facts) - set(mine) == {"buffers"}
    edit_json(A.recording_path(gate), lambda d: d["extra"].pop("settings"))  # the gate's settings gone:
    assert [c.name for c in judge(gate).checks] == [c.name for c in v.checks][:-len(GATE_CHECKS)]  # a plain one


# --------------------------------------------------------------------------- complete and provenance


@pytest.mark.parametrize("missing", [GRADREF, FLOOR, SINGLE, EXACT])
def test_a_missing_reference_is_incomplete_never_a_pass(gate, missing):
    if missing in (SINGLE, EXACT):
        shutil.rmtree(A.gate_reference_dir(gate, missing))
    else:
        A.gate_reference_path(gate, missing).unlink()
    v = judge(gate)
    assert not v.passed and not v.check("complete").passed
    assert f"no {missing}" in v.check("complete").reason


def test_which_references_apply_comes_from_the_settings():
    base = {"global_batch": 6, "reduce": "fp32"}
    assert references(base) == [SINGLE, FLOOR, GRADREF]
    assert references({**base, "reduce": "exact"}) == [SINGLE, FLOOR, GRADREF, EXACT]
    assert references({**base, "global_batch": None}) == [GRADREF]  # mixed window lengths: no single
    with pytest.raises(Exception, match="global_batch"):
        references({"reduce": "fp32"})


def test_no_recording_at_all_is_incomplete(tmp_path):
    v = judge(tmp_path)
    assert not v.passed and "no recording" in v.check("complete").reason


@pytest.mark.parametrize("key", PROVENANCE)
def test_a_provenance_mismatch_names_the_key_and_the_reference(gate, key):
    edit_json(A.gate_reference_path(gate, FLOOR), lambda d: d["provenance"].update({key: "other"}))
    c = judge(gate).check("provenance")
    assert not c.passed and f"floor's {key} 'other' differs from the fleet's" in c.reason


def test_the_settings_the_verdict_is_asked_for_are_the_ones_judged(gate):
    from dormouse.gate.settings import from_record

    recorded = A.RecordingSet(gate).extra["settings"]
    assert judge(gate, from_record({**recorded, "out": str(gate)})).passed
    other = from_record({**recorded, "out": str(gate), "seed": recorded["seed"] + 1})
    c = judge(gate, other).check("provenance")
    assert not c.passed and "the fleet was made with other settings (seed)" in c.reason


def test_a_single_of_the_fleets_window_count_but_other_window_lengths_is_not_comparable(gate):
    # a single made by hand at --profile 6x32 beside a fleet of 64-byte windows has the fleet's global batch
    # in windows, not in tokens: its curve is another objective's, never a judgement on the fleet
    def shorter(t):
        for k in [k for k in t if k.startswith("in/")]:
            t[k] = t[k][..., :32].contiguous()

    edit_tensors(single_dir(gate) / "rank0" / "step000001.safetensors", shorter)
    c = judge(gate).check("provenance")
    assert not c.passed and "single read windows of [32] bytes, the fleet [64]" in c.reason


def test_a_gate_recording_that_lost_its_settings_is_not_judged_as_a_plain_loop_beside_its_references(gate):
    # without extra.settings the entry would judge the recording alone and drop config, gradref, curve, exact
    edit_json(A.recording_path(gate), lambda d: d["extra"].pop("settings"))
    v = judge(gate)
    assert not v.passed and "keeps no gate settings" in v.check("complete").reason


def test_a_fleet_that_trained_another_recipe_fails_the_config_check(gate):
    edit_json(A.recording_path(gate), lambda d: d["build_kwargs"]["run"]["train"].update(lr=0.5))
    c = judge(gate).check("config")
    assert not c.passed and "the fleet's train.lr = 0.5" in c.reason


# --------------------------------------------------------------------------- gradref


def test_a_window_of_other_bytes_fails_gradref_naming_the_step_and_window(gate):
    def flip(t):
        t["in/0/arg0"][0, 3] = (t["in/0/arg0"][0, 3] + 1) % 256  # rank 1's first window at step 1

    edit_tensors(A.step_tensors_path(gate, 1, 1), flip)
    c = judge(gate).check("gradref")
    assert not c.passed and c.first_step == 1
    assert "other bytes than the data rule gives at step 1: window 4 (0-based, in rank order)" in c.reason


def test_gradref_of_another_recording_fails(gate):
    edit_json(A.gate_reference_path(gate, GRADREF), lambda d: d.update(run="another"))
    c = judge(gate).check("gradref")
    assert not c.passed and "re-run gradref" in c.reason


def test_a_wrong_eval_loss_fails_gradref_as_a_wrong_metric(gate):
    edit_json(A.gate_reference_path(gate, GRADREF), lambda d: d.update(evals=[[2, 5.0]]))
    edit_json(A.recording_path(gate), lambda d: d["extra"].update(evals=[[2, 5.0 * (1 + 1e-5 * 3)]]))
    c = judge(gate).check("gradref")
    assert not c.passed and c.first_step == 2 and "the logged eval loss is wrong: at step 2" in c.reason
    edit_json(A.recording_path(gate), lambda d: d["extra"].update(evals=[[2, 5.0 * (1 + 1e-6)]]))
    assert judge(gate).check("gradref").passed
    edit_json(A.recording_path(gate), lambda d: d["extra"].update(evals=[]))
    c = judge(gate).check("gradref")
    assert not c.passed and "the recipe evaluates at steps [2]" in c.reason


# --------------------------------------------------------------------------- exact


def test_exact_names_the_first_differing_step_tensor_element_and_ulps(gate):
    def nudge(t):
        g = next(k for k in sorted(t) if k.startswith("g/"))
        t[g].view(-1)[5] = torch.nextafter(t[g].view(-1)[5], torch.tensor(math.inf))

    edit_tensors(A.step_tensors_path(A.gate_reference_dir(gate, EXACT), 0, 2), nudge)
    refs = GateReferences(gate)
    c = check_exact(A.RecordingSet(gate), refs.recording(EXACT))
    assert not c.passed and c.first_step == 2 and c.first_tensor.startswith("g/") and c.element == 5
    assert c.ulps == 1.0 and c.steps_equal == [True, False, True]


def test_exact_judges_the_loss_bitwise(gate):
    path = A.step_meta_path(A.gate_reference_dir(gate, EXACT), 0, 3)
    edit_json(path, lambda d: d.update(loss=float(torch.nextafter(torch.tensor(d["loss"], dtype=torch.float64),
                                                                    torch.tensor(math.inf, dtype=torch.float64)))))
    c = judge(gate).check("exact")
    assert not c.passed and c.first_step == 3 and c.first_tensor == "loss" and c.ulps == 1.0


# --------------------------------------------------------------------------- the curve


def _curve(gate: Path, **kw):
    refs = GateReferences(gate)
    return check_curve(A.RecordingSet(gate), refs.recording(SINGLE), refs.meta(FLOOR), **kw)


def test_the_curve_tolerance_is_ten_times_the_running_max_of_the_ulp_floor_and_at_least_its_minimum(gate):
    single = A.RecordingSet(single_dir(gate)).losses()
    rels = [[1e-7, 4e-7, 2e-7], [3e-7, 1e-7, 1e-7]]

    def floors(d):
        for run, rel in zip(d["runs"].values(), rels):
            run["losses"] = [s * (1 + r) for s, r in zip(single, rel)]

    edit_json(A.gate_reference_path(gate, FLOOR), floors)
    c = _curve(gate)
    envelope = [3e-7, 4e-7, 4e-7]
    assert c.tolerance == pytest.approx([max(FLOOR_MULTIPLE * e, CURVE_MIN_RTOL) for e in envelope], rel=1e-6)
    assert "at least 1e-06" in c.tolerance_why


def test_a_loss_off_its_floor_fails_the_curve_at_its_step(gate):
    edit_json(A.step_meta_path(gate, 0, 2), lambda d: d.update(loss=d["loss"] * (1 + 1e-4)))
    c = _curve(gate)
    assert not c.passed and "the loss exceeds its tolerance first at step 2" in c.reason


def test_a_parameter_leaving_its_own_floor_fails_named_with_its_step(gate):
    name = {}

    def move(t):  # the single's parameters before step 3: after step 2
        k = next(k for k in sorted(t) if k.startswith("p/") and t[k].dim() == 2)
        name["n"] = k[2:]
        t[k] *= 1 + 1e-3

    edit_tensors(A.step_tensors_path(single_dir(gate), 0, 3), move)
    c = _curve(gate)
    assert not c.passed and c.first_divergent_param == name["n"] and c.first_divergent_param_step == 2
    assert f"{name['n']} leaves its floor at step 2" in c.reason


def test_the_step_one_gradients_are_compared(gate):
    def scale(t):
        for k in t:
            if k.startswith("g/"):
                t[k] *= 1.01

    edit_tensors(A.step_tensors_path(single_dir(gate), 0, 1), scale)
    c = _curve(gate)
    assert not c.passed and c.grad_step1 == pytest.approx(0.01 / 1.01, rel=1e-3)
    assert "step-1 gradients differ" in c.reason


def test_a_curve_over_other_steps_is_not_comparable(gate):
    edit_json(A.recording_path(single_dir(gate)), lambda d: d["segments"][-1].update(end=2))
    c = _curve(gate)
    assert not c.passed and "not comparable" in c.reason


def _flip(out: Path, rank: int, step: int) -> None:
    def flip(t):
        t["x/topk"][0, 0, 0, 0] = (t["x/topk"][0, 0, 0, 0] + 1) % 4

    edit_tensors(A.step_tensors_path(out, rank, step), flip)


def test_routing_flips_are_counted_in_the_fleets_window_order(gate):
    assert _curve(gate).routing_flips == [[0] * len(_curve(gate).routing_flips[0])] * 3
    _flip(gate, 0, 2)  # one launch of 2 ranks at step 1, one rank after the resume
    _flip(gate, 1, 1)
    c = _curve(gate)
    assert c.first_flip_step == 1 and c.routing_flips[0][0] == 1 and c.routing_flips[1][0] == 1
    assert sum(map(sum, c.routing_flips)) == 2


def test_a_divergence_after_a_routing_flip_is_round_off_unless_a_check_failed_first(gate):
    _flip(gate, 0, 1)
    edit_json(A.step_meta_path(gate, 0, 2), lambda d: d.update(loss=d["loss"] * (1 + 1e-4)))
    assert "round-off amplified by a discrete expert choice" in _curve(gate).summary
    c = _curve(gate, failed=("gradient", 2))
    assert "round-off" not in c.summary and "first failing check: gradient at step 2" in c.summary
    assert "round-off amplified" in _curve(gate, failed=("replay", 3)).summary  # a later failure: still excused


def test_a_nan_fleet_loss_never_passes_the_curve(gate):
    edit_json(A.step_meta_path(gate, 0, 3), lambda d: d.update(loss=float("nan")))
    assert not _curve(gate).passed


# --------------------------------------------------------------------------- the verdict's form


def test_verdict_to_dict_round_trips_to_strict_json(gate):
    for planted in (False, True):
        if planted:
            edit_json(A.gate_reference_path(gate, GRADREF), lambda d: d.update(run="another"))
        v = judge(gate)
        d = v.to_dict()
        assert json.loads(json.dumps(d, allow_nan=False)) == d
        assert d["schema"] == VERDICT_SCHEMA and d["pass"] is v.passed and "passed" not in d
        assert list(d["checks"]) == [c.name for c in v.checks]
        for c in v.checks:
            assert d["checks"][c.name]["pass"] is c.passed and d["checks"][c.name]["kind"] == type(c).__name__
    assert d["pass"] is False and d["checks"]["gradref"]["pass"] is False


def test_check_types_are_dataclasses_with_a_reason():
    c = Check("x", False, "why")
    v = Verdict("/d", False, [c], [])
    assert v.check("x") is c and v.check("y") is None
    assert v.to_dict()["checks"]["x"] == {"kind": "Check", "name": "x", "pass": False, "reason": "why"}


# --------------------------------------------------------------------------- metrics


def test_ulps_of_nextafter_is_one():
    x = torch.tensor([0.3, -1.3, 2.7, 3.1, -0.55, 1e-30, 123456.7, 0.0])
    for direction in (math.inf, -math.inf):
        y = torch.nextafter(x, torch.tensor(direction))
        for i in range(len(x)):
            assert ulps(y[i:i + 1], x[i:i + 1]) == 1.0, (float(x[i]), direction)
    assert ulps(x, x) == 0.0


def test_ulps_of_nextafter_is_one_at_powers_of_two():
    """Adjacent floats are one ulp apart, also where the spacing changes (the
    next float toward zero from a power of two)."""
    for v in (1.0, -1.0, 2.0, 0.5, -1024.0):
        x = torch.tensor([v])
        for direction in (math.inf, -math.inf):
            y = torch.nextafter(x, torch.tensor(direction))
            assert ulps(y, x) == 1.0, (v, direction, ulps(y, x))


def test_first_difference_and_relative():
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(2, 3)
    assert first_difference([("a", a, b)]) is None
    b2 = b.clone()
    b2[1, 1] = torch.nextafter(b2[1, 1], torch.tensor(math.inf))
    assert first_difference([("x", a, a.clone()), ("y", b2, b)]) == ("y", 4, 1.0)
    assert relative(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])) == pytest.approx(0.25)
    assert relative(torch.tensor([0.5]), torch.zeros(1)) == 0.5  # all-zero reference: absolute


# --------------------------------------------------------------------------- the bf16 wire's bias statistic


def _wire_series(bias: float, *, seed: int = 0, steps: int = 3, size: int = 128, world: int = 2):
    """A bf16 wire's differences from the reference: rounding-like noise within
    the bound W u sum|g_r| / T, plus `bias` x the bound x sign(p)."""
    from dormouse.gate.judge.bounds import BF16_UNIT_ROUNDOFF

    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(steps, size, size, generator=gen)
    bound = world * BF16_UNIT_ROUNDOFF * ref.abs() * (1 + torch.rand(steps, size, size, generator=gen))
    before = torch.randn(steps, size, size, generator=gen)
    d = (torch.rand(steps, size, size, generator=gen) - 0.5) * bound + bias * bound * torch.sign(before)
    return [(d, bound, ref, before)]


def test_rounding_like_errors_pass_the_bias_test_and_a_bias_far_below_the_bound_fails():
    from dormouse.gate.judge.bounds import BIAS_SIGMAS
    from dormouse.gate.judge.facts.bias import bias_check

    for seed in range(3):
        ok = bias_check(_wire_series(0.0, seed=seed), "one process's gradient")
        assert ok.passed and max(map(abs, ok.stats.values())) < 4, ok.reason
    assert ok.samples == 3 * 128 * 128 and ok.smallest < 0.02
    bad = bias_check(_wire_series(0.05), "one process's gradient")  # 5% of the per-element bound
    assert not bad.passed and bad.stats["decay"] > BIAS_SIGMAS and "decay" in bad.reason
    assert "biased beyond the bf16 wire's rounding" in bad.reason
    d, bound, _, _ = _wire_series(0.05)[0]
    assert bool((d.abs() <= bound).all())  # ... which the elementwise bound alone passes
