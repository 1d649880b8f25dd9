"""The Recorder on loops whose objective is more than a sum over rows, and on
what else a forward receives (issue 27): a plain DDP loop
(tests/support/batch_loop.py), 2 gloo ranks under ONE real torchrun launch,
each recording referenced in one process and judged. Every verdict is
confirmed against this file's own one-process computation
(batchmodels' formulas on the rows batch_loop.rows gives, not the gate's
reference), read against the fleet's recorded gradient."""

from __future__ import annotations

import batch_loop
import batchmodels as BM
import casecheck
import catalogue
import looprec
import pytest
import torch
import torch.nn.functional as F
from looprec import failing, launch
from safetensors.torch import load_file

from dormouse.gate import artifacts as A

W = 2
@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_scope")
    launch([{**cfg, "out": str(root / name)} for name, cfg in catalogue.runs("batch").items()], root,
           script="batch_loop.py", world=W)
    return {name: root / name for name in catalogue.ids("batch")}


@casecheck.rows("batch")
def test_the_verdict_is_the_catalogues(recordings, case):
    """Each run's verdict and named cause (tests/support/catalogue.py, the "batch" rows); the tests below
    confirm each against this file's own one-process computation."""
    casecheck.holds(recordings[case.id], case)


# ------------------------------------------------------------------ the test's own one-process computations


def fleet_grad(out, step: int = 1) -> dict[str, torch.Tensor]:
    """The fleet's synchronised gradient at `step` as rank 0 recorded it (read from the file directly)."""
    t = load_file(str(A.step_tensors_path(out, 0, step)))
    return {k[2:]: v.double() for k, v in t.items() if k.startswith("g/")}


def rows_of(name: str, step: int = 0, seed_offset: int = 0) -> list[torch.Tensor]:
    """Every micro-batch of the step, rank then micro order, as batch_loop draws them."""
    cfg = {**batch_loop.RUN, **catalogue.runs("batch")[name]}
    cfg["seed"] += seed_offset
    return [batch_loop.rows(cfg, step, r, m, W) for r in range(W) for m in range(cfg["micro"])]


def grad_of(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: dict, b: dict) -> float:
    num = sum(float(((a[n] - b[n]) ** 2).sum()) for n in b)
    return (num / sum(float((v ** 2).sum()) for v in b.values())) ** 0.5


def moe_loss(model, xs: list[torch.Tensor], *, one_forward: bool) -> torch.Tensor:
    """Mean next-token cross-entropy + ALPHA x the load-balancing term; one_forward: the rows all in one
    forward, its statistics the global batch's; else each x its own forward and statistics, each term
    weighted by its tokens."""
    groups = [torch.cat(xs)] if one_forward else xs
    total, n = 0.0, 0
    for x in groups:
        logits, p = model(x)
        flat = p.reshape(-1, BM.EXPERTS)
        f = F.one_hot(flat.argmax(-1), BM.EXPERTS).double().mean(0)
        aux = BM.EXPERTS * (f * flat.mean(0)).sum()
        k = x.shape[0] * (x.shape[1] - 1)
        total = total + F.cross_entropy(logits[:, :-1].reshape(-1, BM.VOCAB), x[:, 1:].reshape(-1),
                                        reduction="sum") + BM.ALPHA * aux * k
        n += k
    return total / n


# ------------------------------------------------------------------ one forward for the global batch


def test_a_load_balancing_term_over_each_forwards_statistics_fails_as_rows_of_a_forward_interacting(recordings):
    # its row: independence fails, the rows of a forward interacting; the gradient passes (the micro-batches'
    # sum is what the fleet computed: only one row a forward). One process at the global batch: every row of the step in one forward, the term over all their tokens
    model = BM.build_moe()
    xs = rows_of("moe_local")
    one = grad_of(model, moe_loss(model, xs, one_forward=True))
    split = grad_of(model, moe_loss(model, xs, one_forward=False))
    fleet = fleet_grad(recordings["moe_local"])
    assert rel(fleet, split) < 1e-5  # the fleet computed each forward's own term ...
    assert rel(fleet, one) > 0.02, rel(fleet, one)  # ... which is not the global batch's


# ------------------------------------------------------------------ batch-level objectives, declared


def test_load_balancing_over_all_reduced_statistics_passes_when_declared_over_the_step(recordings):
    # its row: PASS, the probe saying why it did not probe (not a guess)
    model = BM.build_moe()
    one = grad_of(model, moe_loss(model, rows_of("moe_global"), one_forward=True))
    assert rel(fleet_grad(recordings["moe_global"]), one) < 1e-5


def test_contrastive_with_negatives_gathered_from_every_rank_passes_when_declared(recordings):
    model = BM.build_pair()
    q = model.encode(torch.cat(rows_of("pair")))
    k = model.encode(torch.cat(rows_of("pair", seed_offset=17)))
    loss = F.cross_entropy(q @ k.T / BM.TAU, torch.arange(q.shape[0]))
    assert rel(fleet_grad(recordings["pair"]), grad_of(model, loss)) < 1e-5  # (pair_undeclared's row: a FAIL)


# ------------------------------------------------------------------ what the forward receives


def test_a_bool_keyword_loop_set_attributes_and_loss_only_labels_are_recorded(recordings):
    assert "judged against input_ids" not in looprec.verdict(recordings["switch"]).check("gradient").reason
    # the test's own: micro-batch 0 of each rank with flip=True, mix.on from the start, labels masked
    model = BM.build_switch()
    model.mix.on = True
    xs = rows_of("switch")
    flips = [m == 0 for r in range(W) for m in range(2)]

    def loss(flip_used: bool):
        total, n = 0.0, 0
        for x, flip in zip(xs, flips):
            y = x.clone()
            y[:, :3] = -100
            z = model(x, flip=flip and flip_used)
            total = total + F.cross_entropy(z[:, :-1].reshape(-1, BM.VOCAB), y[:, 1:].reshape(-1),
                                            ignore_index=-100, reduction="sum")
            n += int((y[:, 1:] != -100).sum())
        return total / n
    fleet = fleet_grad(recordings["switch"])
    assert rel(fleet, grad_of(model, loss(True))) < 1e-5
    assert rel(fleet, grad_of(model, loss(False))) > 0.01  # the keyword matters: had it been lost, a FAIL
    model.mix.on = False
    assert rel(fleet, grad_of(model, loss(True))) > 0.01  # and so does the attribute


@pytest.mark.parametrize("name", ["flip_rank1", "attrs_rank1"])
def test_a_branch_one_rank_switches_alone_is_not_what_one_process_computes(recordings, name):
    # (its row: the ranks check fails, named) the test's own: one process running rank 0's network (no
    # flip, no gain) over every rank's rows of step 1 is not what the fleet computed
    model = BM.build_switch()
    model.mix.on = bool(catalogue.runs("batch")[name].get("attrs"))
    xs = rows_of(name)
    z = model(torch.cat(xs))
    loss = F.cross_entropy(z[:, :-1].reshape(-1, BM.VOCAB), torch.cat(xs)[:, 1:].reshape(-1))
    assert rel(fleet_grad(recordings[name]), grad_of(model, loss)) > 0.01


@pytest.mark.parametrize("where", ["outer", "inner", "block", "given"])
def test_a_compiled_model_is_recorded_in_every_placement_of_the_compile(recordings, where):
    model = BM.build_switch()
    model.mix.on = True
    xs = rows_of(f"compile_{where}")
    z = model(torch.cat(xs))
    loss = F.cross_entropy(z[:, :-1].reshape(-1, BM.VOCAB), torch.cat(xs)[:, 1:].reshape(-1))
    assert rel(fleet_grad(recordings[f"compile_{where}"]), grad_of(model, loss)) < 1e-5  # its row: PASS


# ------------------------------------------------------------------ bad input, one line


def test_a_bad_objective_scope_or_labels_call_is_one_line(tmp_path):
    from dormouse.errors import DormouseError
    from dormouse.gate import Recorder, RecordingSpec

    ok = {"build_model": "batchmodels:build_switch", "build_optimizer": "batchmodels:build_optimizer"}
    for bad, match in (({"objective_scope": "global"}, "is none of example, forward, step"),
                       ({"objective_scope": "step"}, "needs objective='pkg.mod:fn'")):
        with pytest.raises(DormouseError, match=match) as e:
            Recorder(tmp_path / "bad", BM.build_switch(), RecordingSpec(**ok, **bad))
        assert "\n" not in str(e.value)
    model = BM.build_switch()
    rec = Recorder(tmp_path / "rec", model, RecordingSpec(**ok))
    with pytest.raises(DormouseError, match="no forward recorded since the last rec.step"):
        rec.labels(torch.zeros(2, BM.T, dtype=torch.long))
    model(torch.zeros(2, BM.T, dtype=torch.long))
    with pytest.raises(DormouseError, match="for a forward of 2 rows"):
        rec.labels(torch.zeros(3, BM.T, dtype=torch.long))
    rec.close()


def test_an_attribute_the_loop_added_is_set_and_one_on_a_submodule_build_model_lacks_is_refused(tmp_path):
    """One-process recordings whose loop gave the model attributes build_model's model does not have:
    on a submodule it has, the reference sets them; on one it lacks, one line."""
    from dormouse.errors import DormouseError
    from dormouse.gate import Recorder, RecordingSpec
    from dormouse.gate.record.reference import make_reference

    def record(out, loop_sets):
        model = BM.build_switch()
        loop_sets(model)
        rec = Recorder(out, model, RecordingSpec(build_model="batchmodels:build_switch",
                                                 build_optimizer="batchmodels:build_optimizer", objective="causal_lm"))
        opt = BM.build_optimizer(model)
        x = torch.randint(0, BM.VOCAB, (2, BM.T), generator=torch.Generator().manual_seed(3))
        F.cross_entropy(model(x)[:, :-1].reshape(-1, BM.VOCAB), x[:, 1:].reshape(-1)).backward()
        rec.step(optimizer=opt)
        opt.step()
        rec.close()
        return out

    # mix.on (build_switch's False) and mix.tempo (not built) are set on the rebuilt model: a PASS, which
    # without mix.on would fail (test_a_bool_keyword_... shows the gradient with it off differs) ...
    out = record(tmp_path / "added", lambda m: (setattr(m.mix, "on", True), setattr(m.mix, "tempo", 3)))
    assert looprec.verdict(out).passed, failing(looprec.verdict(out))
    # ... and one on a submodule the rebuilt model lacks is refused, named
    bad = record(tmp_path / "extra", lambda m: (setattr(m, "extra", torch.nn.Identity()),
                                                 setattr(m.extra, "flag", True)))
    with pytest.raises(DormouseError, match="'extra.flag'") as e:
        make_reference(bad, log=looprec.QUIET)
    assert "\n" not in str(e.value) and "does not have" in str(e.value)


def test_a_fleet_that_is_one_forward_over_the_step_says_declare_the_step_first(recordings):
    """Statistics over every rank's rows, undeclared (issue 37, d18: a synchronised BatchNorm, one micro-batch a
    rank): the verdict stays FAIL, its first failing line is the gradient's objective_scope='step' advice (the
    rows' dependence after it), and the probe does not blame the module that computes over the step by design."""
    v = looprec.verdict(recordings["moe_global_undeclared"])
    failing = [c for c in v.checks if not c.passed]
    assert not v.passed and failing[0].name == "gradient", [c.name for c in failing]
    assert "declare objective_scope='step'" in failing[0].reason
    probe = v.check("probe")
    assert probe is None or probe.passed, probe.reason
