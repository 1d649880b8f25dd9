"""The judge on small synthetic artifacts: no training, a few tiny tensors
and three steps written with save_artifact and safetensors traces, then one
thing planted at a time. Each rule of dormouse/gate/judge.py is shown to hold
and each check is shown able to fail, for its stated reason."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from dormouse.gate.artifacts import PROVENANCE, ArtifactSet, save_artifact
from dormouse.gate.judge.bounds import (BF16_UNIT_ROUNDOFF, BIAS_SIGMAS, CURVE_MIN_RTOL as MIN_RTOL, GRAD_RTOL,
                                        LOSS_RTOL, WINDOW_RTOL)
from dormouse.gate.judge.verdict import VERDICT_SCHEMA, Check, CurveCheck, ExactCheck, TensorCheck, Verdict
from dormouse.gate.judge.entry import judge
from dormouse.gate.judge.facts.bias import check_bias
from dormouse.gate.judge.facts.curve import check_curve
from dormouse.gate.judge.facts.exact import check_exact
from dormouse.gate.judge.facts.finite import check_finite_traced
from dormouse.gate.judge.facts.gradref import check_gradref
from dormouse.gate.judge.facts.independence import check_window
from dormouse.gate.judge.facts.loss import check_loss_traced
from dormouse.gate.judge.facts.provenance import check_complete, check_config, check_provenance
from dormouse.gate.judge.facts.ranks import check_ranks_traced
from dormouse.gate.judge.facts.replay import check_replay_traced
from dormouse.gate.judge.facts.series import required
from dormouse.gate.judge.metrics import first_difference, relative, ulps
from dormouse.gate.settings import GateSettings, from_record

STEPS, T, ITERS, TOPK, EXPERTS = 3, 3, 2, 2, 4
W = "w"  # an ordinary parameter
BIAS = "moe.router_bias"  # discrete: judged by routing flips, never by a floor
SHAPES = [[4, 64], [2, 64]]  # the fleet's profile: one window length, global batch 6
LOSSES = [5.5, 5.25, 5.125]


def _params() -> dict[str, torch.Tensor]:
    base = torch.tensor([[0.3, -1.3, 2.7], [0.7, 3.1, -0.55]])
    w = torch.stack([base * (1 + 0.01 * (k + 1)) for k in range(STEPS)])
    bias = torch.stack([torch.tensor([0.0, 1e-3, -1e-3, 0.0]) * (k + 1) for k in range(STEPS)])
    return {W: w, BIAS: bias}


def _grads() -> torch.Tensor:
    g = torch.tensor([[0.25, -1.5, 0.6], [2.0, -0.4, 0.9]])  # max |g| = 2 at every step
    return torch.stack([g.clone() for _ in range(STEPS)])


def _topk(batch: int) -> torch.Tensor:
    t = torch.zeros(STEPS, batch, T, ITERS, TOPK, dtype=torch.int16)
    t[..., 1] = 1  # every token chose experts {0, 1}
    return t


def synthetic(*, reduce: str = "fp32", shapes=None, exact: bool | None = None) -> dict:
    """Every artifact of a clean gate run as plain Python: name -> {state,
    losses, meta, trace}. Tests edit it, then `write` it."""
    shapes = copy.deepcopy(shapes or SHAPES)
    capacity = ",".join(f"{b}x{t}" for b, t in shapes)
    settings = GateSettings(steps=STEPS, reduce=reduce, profile=capacity,
                            micro_batch=2 if reduce == "exact" else 0).record()
    prov = {k: (1 if k == "threads" else f"{k}-1") for k in PROVENANCE}
    p, g = _params(), _grads()
    final = {k: v[-1].clone() for k, v in p.items()}
    loads = torch.full((STEPS, ITERS, EXPERTS), 96.0)
    norm = torch.tensor([1.5, 1.25, 1.125], dtype=torch.float32)

    def trace(batch, full=True):
        t = {"topk": _topk(batch), "loads": loads.clone(), "clip": torch.ones(STEPS, dtype=torch.float64),
             "grad_norm": norm.clone()}
        if full:
            t.update({f"p/{k}": v.clone() for k, v in p.items()})
            t[f"g/{W}"] = g.clone()
        return t

    config = {"train": {"ns_dtype": "float32"}, "model": {"bf16": False}}  # the RunConfig's fields the judge reads
    common = {"settings": settings, "provenance": prov, "config": config}
    rank = {**common, "mode": "rank", "world_size": len(shapes), "rank_shapes": shapes, "start_step": 0,
            "evals": [[2, 5.0]]}
    # per-token losses whose token mean is each step's logged loss
    per_token = torch.tensor(LOSSES, dtype=torch.float32).view(-1, 1).repeat(1, 6 * T)
    per_token[:, 0] += 0.5
    per_token[:, 1] -= 0.5
    arts = {
        "rank0": {"state": final, "losses": list(LOSSES), "meta": {**rank, "rank": 0}, "trace": trace(shapes[0][0])},
        "rank1": {"state": copy.deepcopy(final), "losses": list(LOSSES), "meta": {**rank, "rank": 1},
                  "trace": trace(shapes[1][0], full=False)},
        "init": {"state": {k: v[0] for k, v in p.items()}, "losses": [], "meta": {**common, "mode": "init"}},
        "gradref": {"state": {f"g/{W}": g.clone(), f"b/{W}": g.clone(), f"a/{W}": g.abs(),
                              "batch_losses": per_token.clone(), "window_losses": per_token.clone(),
                              "loads": loads.clone()},
                    "losses": [], "meta": {**common, "mode": "gradref", "evals": [[2, 5.0]]}},
        "replay": {"state": {**{f"p/{k}": v.clone() for k, v in p.items()}, "grad_norm": norm.clone()},
                   "losses": [], "meta": {**common, "mode": "replay"}},
    }
    if len({t for _, t in shapes}) == 1:
        floor = {f"ulp{i}": {"losses": [x * (1 + 1e-8 * (i + 1)) for x in LOSSES],
                             "param_rel": {W: [1e-8] * STEPS, BIAS: [0.0] * STEPS}} for i in range(2)}
        arts["single"] = {"state": copy.deepcopy(final), "losses": list(LOSSES),
                          "meta": {**common, "mode": "single", "global_batch": sum(b for b, _ in shapes),
                                   "floor": floor, "start_step": 0},
                          "trace": trace(sum(b for b, _ in shapes))}
    if exact if exact is not None else reduce == "exact":
        arts["exact"] = {"state": copy.deepcopy(final), "losses": list(LOSSES),
                         "meta": {**common, "mode": "exact"}, "trace": trace(6)}
    return arts


def write(out: Path, arts: dict) -> ArtifactSet:
    out.mkdir(parents=True, exist_ok=True)
    for name, art in arts.items():
        save_artifact(out, name, art["state"], art["losses"], **art["meta"])
        if art.get("trace") is not None:
            (out / f"{name}_trace.safetensors").write_bytes(st_save(art["trace"]))
    return ArtifactSet(out)


def clean_set(tmp_path: Path, edit=None, **kw) -> ArtifactSet:
    arts = synthetic(**kw)
    if edit:
        edit(arts)
    return write(tmp_path / "gate", arts)


def _set_loss(arts, step: int, rel: float, names=("rank0", "rank1")) -> None:
    for n in names:
        arts[n]["losses"][step - 1] = LOSSES[step - 1] * (1 + rel)


def _floor_losses(arts, rels_per_run: list[list[float]]) -> None:
    arts["single"]["meta"]["floor"] = {
        f"ulp{i}": {"losses": [x * (1 + r) for x, r in zip(LOSSES, rels)],
                    "param_rel": {W: [0.0] * STEPS, BIAS: [0.0] * STEPS}} for i, rels in enumerate(rels_per_run)}


# --------------------------------------------------------------------------- the clean baseline


def test_the_clean_synthetic_set_passes_every_check(tmp_path):
    v = judge(clean_set(tmp_path).out)
    assert v.passed, [(c.name, c.reason) for c in v.checks if not c.passed]
    assert [c.name for c in v.checks] == ["complete", "provenance", "config", "finite", "ranks", "window", "gradref",
                                         "loss", "replay", "curve"]
    assert v.references == ["single", "init", "gradref", "replay"]
    assert isinstance(v.check("curve"), CurveCheck) and isinstance(v.check("replay"), ExactCheck)
    assert isinstance(v.check("gradref"), TensorCheck) and isinstance(v.check("window"), TensorCheck)


def test_the_clean_exact_set_passes_with_the_exact_reference(tmp_path):
    v = judge(clean_set(tmp_path, reduce="exact").out)
    assert v.passed, [(c.name, c.reason) for c in v.checks if not c.passed]
    assert "exact" in v.references and v.check("exact").passed
    assert v.check("exact").steps_equal == [True] * STEPS


# --------------------------------------------------------------------------- every check can fail


def _nan_loss(a):
    a["rank1"]["losses"][1] = math.nan


def _rank1_differs(a):
    a["rank1"]["state"][W] = a["rank1"]["state"][W] * 1.5


def _window_differs(a):
    a["gradref"]["state"][f"b/{W}"][1] *= 1.01


def _gradref_differs(a):
    a["rank0"]["trace"][f"g/{W}"][2] *= 1.01  # the fleet's reduced gradient at step 3


def _replay_differs(a):
    a["replay"]["state"][f"p/{W}"][1, 0, 0] += 1e-3


def _curve_differs(a):
    _set_loss(a, 2, 1e-3)  # the fleet trained to another loss, and logged it truly
    for k in ("window_losses", "batch_losses"):
        a["gradref"]["state"][k][1] += LOSSES[1] * 1e-3


def _exact_differs(a):
    a["exact"]["trace"][f"g/{W}"][0, 1, 1] *= 1.5


FAULTS = {
    "complete": (lambda a: a.pop("gradref"), "fp32"),
    "provenance": (lambda a: a["replay"]["meta"].update(provenance={**a["replay"]["meta"]["provenance"],
                                                                    "torch": "0.0"}), "fp32"),
    "finite": (_nan_loss, "fp32"),
    "ranks": (_rank1_differs, "fp32"),
    "window": (_window_differs, "fp32"),
    "gradref": (_gradref_differs, "fp32"),
    "replay": (_replay_differs, "fp32"),
    "curve": (_curve_differs, "fp32"),
    "exact": (_exact_differs, "exact"),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_check_can_fail_and_then_the_verdict_fails(tmp_path, name):
    edit, reduce = FAULTS[name]
    v = judge(clean_set(tmp_path, edit, reduce=reduce).out)
    c = v.check(name)
    assert c is not None and not c.passed, (name, [(x.name, x.passed, x.reason) for x in v.checks])
    assert not v.passed
    assert c.reason  # one sentence why
    others = [x.name for x in v.checks if not x.passed and x.name != name]
    # a single planted fault does not drag the independent checks down with it
    assert set(others) <= {"curve", "exact"} | ({"ranks"} if name == "finite" else set()), others


# --------------------------------------------------------------------------- complete


@pytest.mark.parametrize("missing", ["gradref", "replay", "init", "single"])
def test_a_missing_reference_is_incomplete_never_a_pass(tmp_path, missing):
    a = clean_set(tmp_path, lambda arts: arts.pop(missing))
    c = check_complete(a)
    assert not c.passed and c.reason.startswith(f"incomplete: no {missing}")
    v = judge(a.out)
    assert not v.passed and not v.check("complete").passed
    assert missing not in v.references


def test_rank_artifacts_alone_name_every_missing_reference(tmp_path):
    a = clean_set(tmp_path, lambda arts: [arts.pop(n) for n in ("single", "init", "gradref", "replay")])
    v = judge(a.out)
    assert not v.passed
    assert v.check("complete").reason.startswith("incomplete: no single, no init, no gradref, no replay")
    assert v.check("ranks").passed  # the ranks agree with each other, and still no pass
    assert v.references == []


def test_no_fleet_at_all_is_incomplete(tmp_path):
    (tmp_path / "empty").mkdir()
    v = judge(tmp_path / "empty")
    assert not v.passed and v.checks[0].name == "complete"
    assert "incomplete: no fleet artifacts" in v.checks[0].reason


def test_which_references_apply():
    assert required(GateSettings()) == ["single", "init", "gradref", "replay"]
    assert required(GateSettings(reduce="exact")) == ["single", "init", "gradref", "replay", "exact"]
    # mixed window lengths: no single process holds the global batch, so no single (and no exact)
    assert required(GateSettings(profile="4x32,2x64", reduce="exact")) == ["init", "gradref", "replay"]


def test_under_exact_a_missing_exact_reference_is_incomplete(tmp_path):
    no_exact = clean_set(tmp_path / "d", lambda arts: arts.pop("exact"), reduce="exact")
    assert check_complete(no_exact).reason.startswith("incomplete: no exact")


def test_which_references_apply_comes_from_the_settings_not_the_artifacts(tmp_path):
    """A rank artifact that lost its profile (rank_shapes) must not make the
    single process optional: the settings say one window length."""
    def edit(arts):
        arts.pop("single")
        for n in ("rank0", "rank1"):
            arts[n]["meta"].pop("rank_shapes")

    v = judge(clean_set(tmp_path, edit).out)
    assert not v.passed and v.check("complete").reason.startswith("incomplete: no single")


def test_settings_recorded_without_their_global_batch_cannot_say_which_references_apply(tmp_path):
    """artifacts.references reads the recorded settings' global batch; a
    record made before it was recorded is a FAIL that says so, not a guess."""
    a = clean_set(tmp_path, lambda arts: arts["rank0"]["meta"]["settings"].pop("global_batch"))
    v = judge(a.out)
    assert not v.passed and v.checks[0].reason.startswith(
        "cannot tell which references apply: the settings record no global_batch"), v.checks[0].reason


def test_the_settings_the_verdict_is_asked_for_are_the_ones_judged(tmp_path):
    a = clean_set(tmp_path)
    recorded = from_record(a.meta("rank0")["settings"])
    assert judge(a.out, recorded).passed
    v = judge(a.out, from_record(a.meta("rank0")["settings"], lr=0.01))
    assert not v.passed and "rank0 was made with other settings (lr)" in v.check("provenance").reason
    # a profile with two window lengths needs no single; one with one length does
    mixed = from_record(a.meta("rank0")["settings"], profile="4x32,2x64")
    assert judge(a.out, mixed).references == ["init", "gradref", "replay"]


# --------------------------------------------------------------------------- provenance


@pytest.mark.parametrize("key", PROVENANCE)
@pytest.mark.parametrize("artifact", ["rank1", "gradref", "single"])
def test_a_provenance_mismatch_names_the_key_and_the_artifact(tmp_path, key, artifact):
    def edit(arts):
        prov = dict(arts[artifact]["meta"]["provenance"])
        prov[key] = 2 if key == "threads" else f"{key}-other"
        arts[artifact]["meta"]["provenance"] = prov

    a = clean_set(tmp_path, edit)
    v = judge(a.out)
    c = v.check("provenance")
    assert not c.passed and not v.passed
    assert f"{artifact}'s {key} " in c.reason, c.reason
    assert c.reason.startswith("not comparable")
    assert ("re-run every mode" in c.reason) == (key == "source")
    # nothing is compared across artifacts that are not comparable
    assert [x.name for x in v.checks] == ["complete", "provenance"]


def test_artifacts_made_with_other_settings_name_the_setting(tmp_path):
    a = clean_set(tmp_path, lambda arts: arts["gradref"]["meta"].update(
        settings={**arts["gradref"]["meta"]["settings"], "lr": 0.01}))
    c = check_provenance(a, a.ranks() + ["single", "init", "gradref", "replay"])
    assert not c.passed and "gradref was made with other settings (lr)" in c.reason


# --------------------------------------------------------------------------- finite


def test_a_nan_loss_fails_finite_naming_artifact_and_step(tmp_path):
    a = clean_set(tmp_path, _nan_loss)
    c = check_finite_traced(a, a.ranks())
    assert not c.passed and c.reason == "rank1's loss is not finite at step 2"


@pytest.mark.parametrize("artifact,where,key,value", [
    ("rank0", "trace", f"g/{W}", math.inf),
    ("rank0", "trace", f"p/{BIAS}", math.nan),
    ("single", "trace", f"p/{W}", -math.inf),
    ("gradref", "state", f"b/{W}", math.nan),
    ("replay", "state", f"p/{W}", math.inf),
    ("rank1", "state", W, math.nan),
])
def test_nan_or_inf_in_a_tensor_fails_finite_by_name(tmp_path, artifact, where, key, value):
    def edit(arts):
        arts[artifact][where][key].view(-1)[3] = value

    a = clean_set(tmp_path, edit)
    v = judge(a.out)
    c = v.check("finite")
    assert not c.passed and not v.passed
    assert c.reason == f"{artifact}'s {key} holds NaN or inf"


# --------------------------------------------------------------------------- ranks


def test_ranks_that_differ_are_named(tmp_path):
    c = check_ranks_traced(clean_set(tmp_path, _rank1_differs))
    assert not c.passed and c.reason == f"ranks differ: rank1 vs rank0: {W}"


def test_ranks_whose_losses_differ_fail(tmp_path):
    c = check_ranks_traced(clean_set(tmp_path, lambda a: a["rank1"]["losses"].__setitem__(2, LOSSES[2] + 1e-6)))
    assert not c.passed and "rank1 vs rank0: losses" in c.reason


def test_a_missing_rank_fails(tmp_path):
    c = check_ranks_traced(clean_set(tmp_path, lambda a: a.pop("rank1")))
    assert not c.passed and "found 1 rank artifacts for a world of 2" in c.reason


# --------------------------------------------------------------------------- window


def test_the_window_check_passes_within_its_bound(tmp_path):
    c = check_window(clean_set(tmp_path, lambda a: a["gradref"]["state"][f"b/{W}"][1].mul_(1 + WINDOW_RTOL / 4)))
    assert c.passed and c.bound == WINDOW_RTOL


def test_a_batch_dependent_gradient_fails_the_window_check_naming_step_and_tensor(tmp_path):
    c = check_window(clean_set(tmp_path, _window_differs))
    assert isinstance(c, TensorCheck) and not c.passed
    assert "the network depends on which windows share a batch" in c.reason
    assert f"at step 2: {W} off by" in c.reason
    assert c.worst_step == 2 and c.worst_tensor == W
    assert c.per_step[0] == 0.0 and c.per_step[1] == pytest.approx(0.01, rel=1e-3)


def test_batch_dependent_per_token_losses_fail_the_window_check_naming_the_step(tmp_path):
    c = check_window(clean_set(tmp_path, lambda a: a["gradref"]["state"]["batch_losses"][2, 5].add_(0.01)))
    assert not c.passed
    assert "the network depends on which windows share a batch" in c.reason
    assert "per-token losses" in c.reason and "first at step 3" in c.reason


# --------------------------------------------------------------------------- gradref


def test_gradref_fp32_bound(tmp_path):
    ok = check_gradref(clean_set(tmp_path / "ok", lambda a: a["rank0"]["trace"][f"g/{W}"][1].mul_(1 + GRAD_RTOL / 2)))
    assert ok.passed and ok.worst == pytest.approx(GRAD_RTOL / 2, rel=1e-2)
    assert "expert loads equal at every step" in ok.reason
    bad = check_gradref(clean_set(tmp_path / "bad", lambda a: a["rank0"]["trace"][f"g/{W}"][1].mul_(1 + 2 * GRAD_RTOL)))
    assert not bad.passed and bad.bound == GRAD_RTOL
    assert f"at step 2: {W} off by" in bad.reason


def _bf16_edit(rel: float, scale_a: float = 1.0):
    def edit(a):
        a["rank0"]["trace"][f"g/{W}"][1, 0, 0] += rel * 2.0  # max |g| = 2: relative `rel`
        a["gradref"]["state"][f"a/{W}"].mul_(scale_a)
    return edit


def test_gradref_bf16_elementwise_bound(tmp_path):
    world, u = 2, BF16_UNIT_ROUNDOFF
    bound = world * u * 2.0 / 2.0 + GRAD_RTOL  # W u max sum|t g|/T over max|g|, plus the fp32 slack
    ok = check_gradref(clean_set(tmp_path / "ok", _bf16_edit(0.9 * bound), reduce="bf16"))
    assert ok.passed, ok.reason
    bad = check_gradref(clean_set(tmp_path / "bad", _bf16_edit(1.1 * bound), reduce="bf16"))
    assert not bad.passed and bad.bound == pytest.approx(bound, rel=1e-6)
    assert f"at step 2: {W}" in bad.reason
    # the same difference is far outside the fp32 bound
    assert not check_gradref(clean_set(tmp_path / "fp32", _bf16_edit(0.9 * bound))).passed
    # cancellation: a larger sum of |t g| than |sum t g| widens the bound in proportion
    wide = check_gradref(clean_set(tmp_path / "wide", _bf16_edit(1.1 * bound, scale_a=10.0), reduce="bf16"))
    assert wide.passed
    tight = check_gradref(clean_set(tmp_path / "tight", _bf16_edit(11 * bound, scale_a=10.0), reduce="bf16"))
    assert not tight.passed and tight.bound == pytest.approx(world * u * 10.0 + GRAD_RTOL, rel=1e-6)


def test_gradref_fails_on_other_expert_loads_naming_the_step(tmp_path):
    c = check_gradref(clean_set(tmp_path, lambda a: a["rank0"]["trace"]["loads"][2, 1, 0].add_(1.0)))
    assert not c.passed and "expert loads" in c.reason and "at step 3" in c.reason


def test_gradref_over_another_number_of_steps_fails(tmp_path):
    def edit(a):
        for k in ("g/w", "b/w", "a/w"):
            a["gradref"]["state"][k] = a["gradref"]["state"][k][:2].clone()
    c = check_gradref(clean_set(tmp_path, edit))
    assert not c.passed and "gradref covers 2 steps, the fleet ran 3" in c.reason


def test_gradref_without_the_fleets_gradients_fails(tmp_path):
    c = check_gradref(clean_set(tmp_path, lambda a: a["rank0"]["trace"].pop(f"g/{W}")))
    assert not c.passed and "recorded no per-step gradients" in c.reason


# --------------------------------------------------------------------------- replay and exact


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


def test_replay_names_the_first_differing_step_tensor_element_and_ulps(tmp_path):
    def edit(a):
        p = a["replay"]["state"][f"p/{W}"]
        p[1].view(-1)[4] = torch.nextafter(p[1].view(-1)[4], torch.tensor(math.inf))
        p[2].view(-1)[0] += 1.0  # a later, larger difference: the first one is named

    c = check_replay_traced(clean_set(tmp_path, edit))
    assert isinstance(c, ExactCheck) and not c.passed
    assert (c.first_step, c.first_tensor, c.element, c.ulps) == (2, f"p/{W}", 4, 1.0)
    assert c.steps_equal == [True, False, False]
    assert f"first differs at step 2, p/{W} element 4 (1 ulps); 1 of 3 steps bitwise equal" in c.reason


def test_replay_judges_the_routing_bias_bitwise(tmp_path):
    def edit(a):
        p = a["replay"]["state"][f"p/{BIAS}"]
        p[2, 1] = torch.nextafter(p[2, 1], torch.tensor(-math.inf))

    c = check_replay_traced(clean_set(tmp_path, edit))
    assert not c.passed and (c.first_step, c.first_tensor, c.element) == (3, f"p/{BIAS}", 1)


def test_replay_fails_on_the_clipping_norm(tmp_path):
    c = check_replay_traced(clean_set(tmp_path, lambda a: a["rank0"]["trace"]["grad_norm"][1].mul_(1.01)))
    assert not c.passed and "clipping norm is off the replay's own" in c.reason
    assert c.steps_equal == [True] * STEPS  # the parameters themselves were equal


def test_exact_names_the_first_differing_step_tensor_element_and_ulps(tmp_path):
    def edit(a):
        g = a["exact"]["trace"][f"g/{W}"]
        g[2].view(-1)[1] = torch.nextafter(g[2].view(-1)[1], torch.tensor(-math.inf))

    c = check_exact(clean_set(tmp_path, edit, reduce="exact"))
    assert not c.passed and (c.first_step, c.first_tensor, c.element, c.ulps) == (3, f"g/{W}", 1, 1.0)
    assert f"first differs at step 3, g/{W} element 1 (1 ulps)" in c.reason


def test_exact_judges_the_loss_bitwise(tmp_path):
    def edit(a):
        a["exact"]["losses"][0] = float(torch.nextafter(torch.tensor(LOSSES[0], dtype=torch.float64),
                                                        torch.tensor(math.inf, dtype=torch.float64)))

    c = check_exact(clean_set(tmp_path, edit, reduce="exact"))
    assert not c.passed and (c.first_step, c.first_tensor) == (1, "loss") and c.ulps == 1.0


def test_exact_over_another_number_of_steps_fails(tmp_path):
    c = check_exact(clean_set(tmp_path, lambda a: a["exact"]["losses"].append(5.0), reduce="exact"))
    assert not c.passed and "another number of steps" in c.reason


# --------------------------------------------------------------------------- the curve


def test_the_curve_tolerance_is_ten_times_the_running_max_of_the_ulp_floor(tmp_path):
    runs = [[3e-7, 0.0, 1e-7], [0.0, 5e-7, 0.0]]

    def edit(a):
        _floor_losses(a, runs)
        _set_loss(a, 3, 4e-6)  # above 10 x step 3's own floor (1e-6), within 10 x the running max (5e-6)

    c = check_curve(clean_set(tmp_path / "ok", edit))
    assert c.noise_floor == pytest.approx([3e-7, 5e-7, 1e-7], rel=1e-6)  # max over the nudges, per step
    assert c.tolerance == pytest.approx([3e-6, 5e-6, 5e-6], rel=1e-6)
    assert c.passed, c.reason
    assert "10 x the running maximum of 2 one-ulp nudges" in c.tolerance_why

    def worse(a):
        _floor_losses(a, runs)
        _set_loss(a, 3, 6e-6)

    bad = check_curve(clean_set(tmp_path / "bad", worse))
    assert not bad.passed and "the loss exceeds its tolerance first at step 3" in bad.reason
    assert "suspect the fleet" in bad.summary


def test_the_curve_tolerance_is_at_least_min_rtol(tmp_path):
    def edit(a, rel):
        _floor_losses(a, [[0.0] * STEPS, [1e-9] * STEPS])
        _set_loss(a, 2, rel)

    ok = check_curve(clean_set(tmp_path / "ok", lambda a: edit(a, MIN_RTOL / 2)))
    assert ok.tolerance == [MIN_RTOL] * STEPS and ok.passed
    bad = check_curve(clean_set(tmp_path / "bad", lambda a: edit(a, 2 * MIN_RTOL)))
    assert not bad.passed and "first at step 2" in bad.reason


def test_a_split_batch_run_never_widens_the_curve_tolerance(tmp_path):
    """The exact reference computes the fleet's own slices: its distance from
    single must not enter the floor (it would share a split bug)."""
    def edit(a, exact_off):
        _floor_losses(a, [[2e-7] * STEPS])
        a["exact"]["losses"] = [x * (1 + exact_off) for x in LOSSES]
        _set_loss(a, 2, 1e-4)

    near = check_curve(clean_set(tmp_path / "near", lambda a: edit(a, 0.0), reduce="exact"))
    far = check_curve(clean_set(tmp_path / "far", lambda a: edit(a, 1e-3), reduce="exact"))
    assert near.tolerance == far.tolerance == pytest.approx([2e-6] * STEPS)
    assert not near.passed and not far.passed


def test_the_step_one_gradients_are_compared(tmp_path):
    c = check_curve(clean_set(tmp_path, lambda a: a["rank0"]["trace"][f"g/{W}"][0].mul_(2.0)))
    assert not c.passed and c.grad_step1 == pytest.approx(1.0)
    assert "step-1 gradients differ by" in c.reason and "scale, weighting or split bug" in c.reason
    ok = check_curve(clean_set(tmp_path / "ok", lambda a: a["rank0"]["trace"][f"g/{W}"][0].mul_(1 + GRAD_RTOL / 4)))
    assert ok.passed


def test_a_tensor_leaving_its_own_floor_fails_named_with_its_step(tmp_path):
    def edit(a, off):
        for run in a["single"]["meta"]["floor"].values():
            run["param_rel"][W] = [1e-6, 1e-5, 1e-6]  # running max 1e-5 from step 2: tolerance 1e-4
        a["rank0"]["trace"][f"p/{W}"][2].mul_(1 + off)

    ok = check_curve(clean_set(tmp_path / "ok", lambda a: edit(a, 5e-5)))
    assert ok.passed and ok.first_divergent_param is None, ok.reason
    bad = check_curve(clean_set(tmp_path / "bad", lambda a: edit(a, 2e-4)))
    assert not bad.passed
    assert (bad.first_divergent_param, bad.first_divergent_param_step) == (W, 3)
    assert f"{W} leaves its floor at step 3" in bad.reason


def test_the_routing_bias_is_not_judged_by_a_floor(tmp_path):
    def edit(a, name):
        a["rank0"]["trace"][f"p/{name}"][0].add_(0.5)  # far outside a zero floor

    c = check_curve(clean_set(tmp_path / "bias", lambda a: edit(a, BIAS)))
    assert c.passed, c.reason
    assert c.param_divergence[BIAS][0] > 1.0 and c.first_divergent_param is None
    # the same move on an ordinary tensor fails
    w = check_curve(clean_set(tmp_path / "w", lambda a: edit(a, W)))
    assert not w.passed and w.first_divergent_param == W and w.first_divergent_param_step == 1


def test_tensors_are_not_judged_by_a_floor_where_the_optimizers_map_rounds_to_bf16(tmp_path):
    def edit(a):
        a["rank0"]["trace"][f"p/{W}"][0].mul_(1.01)
        for n in a:  # the settings' recipe runs Newton-Schulz in bfloat16
            a[n]["meta"]["config"] = {"train": {"ns_dtype": "bfloat16"}, "model": {"bf16": False}}

    c = check_curve(clean_set(tmp_path, edit))
    assert c.passed and c.first_divergent_param is None and c.param_divergence[W][0] == pytest.approx(0.01, rel=1e-4)


def _flip(a, step: int, it: int = 0):
    a["rank0"]["trace"]["topk"][step - 1, 1, 2, it] = torch.tensor([2, 3], dtype=torch.int16)


@pytest.mark.parametrize("flip_step,flip_iter,explained", [
    (None, 0, False),  # no flip at all
    (1, 0, True),  # a flip at an earlier step explains leaving the floor at step 2
    (2, 0, True),  # a flip at the same step's first iteration precedes its loss
    (2, 1, False),  # a flip at a later iteration of the same step does not
    (3, 0, False),  # a flip after the loss left cannot explain it
])
def test_the_routing_flip_explanation_rule(tmp_path, flip_step, flip_iter, explained):
    def edit(a):
        _set_loss(a, 2, 1e-3)
        if flip_step:
            _flip(a, flip_step, flip_iter)

    c = check_curve(clean_set(tmp_path, edit))
    assert not c.passed  # explained or not, the loss left its tolerance
    assert c.first_flip_step == flip_step
    if flip_step:
        assert c.routing_flips[flip_step - 1][flip_iter] == 1 and sum(map(sum, c.routing_flips)) == 1
    if explained:
        assert "after a routing flip (first at step" in c.summary and "suspect" not in c.summary
    else:
        assert c.summary.endswith("before any routing flip could explain it: suspect the fleet")
    assert c.summary in c.reason


def test_the_routing_flips_are_counted_in_the_fleets_window_order(tmp_path):
    """rank1's windows follow rank0's in the single process's batch."""
    def edit(a):
        a["rank1"]["trace"]["topk"][0, 1, 0, 0] = torch.tensor([3, 2], dtype=torch.int16)
    c = check_curve(clean_set(tmp_path, edit))
    assert c.routing_flips[0] == [1, 0] and c.first_flip_step == 1
    assert c.passed  # a flip alone, with the loss in tolerance, is no failure


def test_a_curve_over_another_number_of_steps_is_not_comparable(tmp_path):
    c = check_curve(clean_set(tmp_path, lambda a: a["single"]["losses"].append(5.0)))
    assert not c.passed and "not comparable" in c.reason


def test_a_nan_fleet_loss_never_passes_the_curve(tmp_path):
    c = check_curve(clean_set(tmp_path, lambda a: _set_loss(a, 2, math.nan)))
    assert not c.passed


# --------------------------------------------------------------------------- the verdict


def test_verdict_to_dict_round_trips_to_json(tmp_path):
    for sub, edit in (("pass", None), ("fail", _gradref_differs)):
        v = judge(clean_set(tmp_path / sub, edit).out)
        d = v.to_dict()
        text = json.dumps(d, allow_nan=False)
        assert json.loads(text) == d
        assert d["schema"] == VERDICT_SCHEMA and d["pass"] is v.passed and "passed" not in d
        assert d["references"] == v.references and d["out"] == v.out
        assert list(d["checks"]) == [c.name for c in v.checks]
        for c in v.checks:
            row = d["checks"][c.name]
            assert row["pass"] is c.passed and "passed" not in row
            assert row["kind"] == type(c).__name__ and row["reason"] == c.reason
    assert d["pass"] is False and d["checks"]["gradref"]["pass"] is False
    assert d["checks"]["gradref"]["worst_step"] == 3


def test_a_verdict_over_a_nan_loss_is_still_valid_json(tmp_path):
    """verdict.json must be JSON a strict reader accepts, also (above all) when
    the fleet's loss is NaN."""
    v = judge(clean_set(tmp_path, lambda a: _set_loss(a, 2, math.nan)).out)  # on every rank
    assert not v.passed and v.check("finite").reason == "rank0's loss is not finite at step 2"
    json.loads(json.dumps(v.to_dict(), allow_nan=False))


def test_check_types_are_dataclasses_with_a_reason():
    c = Check("x", False, "why")
    v = Verdict("/d", False, [c], [])
    assert v.check("x") is c and v.check("y") is None
    assert v.to_dict()["checks"]["x"] == {"kind": "Check", "name": "x", "pass": False, "reason": "why"}


def test_a_fleet_that_trained_another_recipe_fails_the_config_check(tmp_path):
    def edit(a):
        a["rank0"]["meta"]["config"] = {"train": {"ns_dtype": "bfloat16"}, "model": {"bf16": False}}

    a = clean_set(tmp_path, edit)
    c = check_config(a, "gradref")
    assert not c.passed and "rank0's train.ns_dtype = 'bfloat16', gradref's 'float32'" in c.reason
    assert not judge(tmp_path).passed


def test_a_single_is_compared_with_the_fleet_through_its_global_batch(tmp_path):
    """Normalised to the fleet's profile: a single recorded as one rank of the
    global batch (by hand: single --batch 6) is the fleet's reference; a single
    at another global batch is one FAIL naming both batches."""
    def one_rank(a):
        a["single"]["meta"]["settings"] = {**a["single"]["meta"]["settings"], "world": 1, "batch": 6,
                                           "profile": "", "resume_world": 0}

    assert check_provenance(clean_set(tmp_path / "same", one_rank), ["single"]).passed

    def other(a):
        one_rank(a)
        a["single"]["meta"]["global_batch"] = 8

    c = check_provenance(clean_set(tmp_path / "other", other), ["single"])
    assert not c.passed and "single ran a global batch of 8 windows" in c.reason and "the fleet 6" in c.reason, c
    # a setting outside the profile still counts
    def lr(a):
        one_rank(a)
        a["single"]["meta"]["settings"]["lr"] = 0.5

    c = check_provenance(clean_set(tmp_path / "lr", lr), ["single"])
    assert not c.passed and "single was made with other settings (lr)" in c.reason, c
# --------------------------------------------------------------------------- the logged loss


def test_a_wrong_logged_loss_fails_the_loss_check_apart_from_the_gradients(tmp_path):
    c = check_loss_traced(clean_set(tmp_path / "ok"))
    assert c.passed and c.worst <= 1e-7 and "eval losses at steps [2]" in c.reason
    v = judge(clean_set(tmp_path / "bad", lambda a: _set_loss(a, 2, 3 * LOSS_RTOL)).out)
    c = v.check("loss")
    assert not c.passed and c.first_step == 2
    assert c.reason.startswith("the logged loss is wrong: at step 2")
    assert v.check("gradref").passed and v.check("replay").passed


def test_a_wrong_eval_loss_fails_the_loss_check(tmp_path):
    def off(a):
        a["rank0"]["meta"]["evals"] = [[2, 5.0 * (1 + 3 * LOSS_RTOL)]]

    c = check_loss_traced(clean_set(tmp_path / "off", off))
    assert not c.passed and c.reason.startswith("the logged eval loss is wrong: at step 2")
    c = check_loss_traced(clean_set(tmp_path / "none", lambda a: a["rank0"]["meta"].pop("evals")))
    assert not c.passed and "reported eval losses at steps [], the recipe evaluates at steps [2]" in c.reason


# --------------------------------------------------------------------------- the bf16 wire's bias


def _wire(bias: float, *, seed: int = 0, size: int = 128):
    """A bf16 fleet whose reduced gradient is gradref's plus rounding-like
    noise within the bound W u sum t|g|/T, plus `bias` x the bound x sign(p)."""
    def edit(a):
        gen = torch.Generator().manual_seed(seed)
        ref = torch.randn(STEPS, size, size, generator=gen)
        absum = ref.abs() * (1 + torch.rand(STEPS, size, size, generator=gen))
        bound = len(SHAPES) * BF16_UNIT_ROUNDOFF * absum
        params = torch.randn(STEPS + 1, size, size, generator=gen)
        noise = (torch.rand(STEPS, size, size, generator=gen) - 0.5) * bound
        a["gradref"]["state"].update({f"g/{W}": ref, f"a/{W}": absum, f"b/{W}": ref.clone()})
        a["rank0"]["trace"][f"g/{W}"] = ref + noise + bias * bound * torch.sign(params[:-1])
        a["rank0"]["trace"][f"p/{W}"] = params[1:].clone()
        a["init"]["state"][W] = params[0].clone()
    return edit


def test_rounding_like_errors_pass_the_bias_test_and_a_bias_far_below_the_bound_fails(tmp_path):
    for seed in range(3):
        ok = check_bias(clean_set(tmp_path / f"ok{seed}", _wire(0.0, seed=seed), reduce="bf16"))
        assert ok.passed and max(map(abs, ok.stats.values())) < 4, ok.reason
    assert ok.samples == STEPS * 128 * 128 and ok.smallest < 0.02
    bad = check_bias(clean_set(tmp_path / "bad", _wire(0.05), reduce="bf16"))  # 5% of the per-element bound
    assert not bad.passed and bad.stats["decay"] > BIAS_SIGMAS and "decay" in bad.reason
    assert "biased beyond the bf16 wire's rounding" in bad.reason
    # ... which the elementwise bound alone passes
    assert check_gradref(clean_set(tmp_path / "bad2", _wire(0.05), reduce="bf16")).passed


def test_the_verdict_runs_the_bias_test_under_the_bf16_wire_only(tmp_path):
    assert judge(clean_set(tmp_path / "fp32").out).check("bias") is None
    v = judge(clean_set(tmp_path / "bf16", reduce="bf16").out)
    assert v.check("bias") is not None and [c.name for c in v.checks].index("bias") == 7


# --------------------------------------------------------------------------- explanations


def test_no_divergence_is_excused_at_or_after_a_failing_check(tmp_path):
    def edit(a):
        _curve_differs(a)  # the loss leaves its floor at step 2 ...
        _flip(a, 1)  # ... after a routing flip at step 1: round-off, had nothing failed
        a["rank0"]["trace"][f"g/{W}"][1] *= 1.01  # but gradref fails at step 2

    v = judge(clean_set(tmp_path, edit).out)
    c = v.check("curve")
    assert not v.check("gradref").passed and v.check("gradref").first_step == 2
    assert "round-off" not in c.summary and "routing flip" not in c.summary
    assert "first failing check: gradref at step 2" in c.summary
    # without the failing check the same divergence is explained by the flip
    c = check_curve(clean_set(tmp_path / "flip", lambda a: (_curve_differs(a), _flip(a, 1))))
    assert "round-off amplified by a discrete expert choice" in c.summary
    # a check failing only after the divergence does not take the explanation away
    c = check_curve(clean_set(tmp_path / "later", lambda a: (_curve_differs(a), _flip(a, 1))), failed=("replay", 3))
    assert "round-off amplified" in c.summary
