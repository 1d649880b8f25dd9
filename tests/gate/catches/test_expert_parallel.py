"""The Recorder on an expert-parallel run, with a declared sharding (issue 28):
tests/support/ep_loop.py trains ep_moe (a tiny MoE LM, 4 experts, top-2 router)
with its experts split over 2 gloo ranks (2 each, tokens dispatched by
all_to_all), data parallel over the same ranks for the dense parameters, under
real torchrun, one launch for every run. The objective is declared over the
step (objective_scope='step'): the token mean of cross-entropy plus a
load-balancing term over every rank's routing counts. The clean run passes;
each planted fault fails, named, and is confirmed against the plain model's own
autograd on the global batch (the test's own code, none of the gate's), read
straight from the recorded files. A bad declaration is refused in one line
before the run starts. The same launch runs hand-written (Megatron-style)
tensor parallelism declared the same way: the output head split over the
vocabulary as plain tensors, clean and with the input gradient's all-reduce
left out."""

from __future__ import annotations

from pathlib import Path

import casecheck
import catalogue
import looprec
import pytest
import torch
import torch.nn.functional as F
from looprec import rel
from looprec import recorded_gradients as recorded

from dormouse.gate import artifacts as A

EXPERTS = ("moe.w1", "moe.w2")


ep = looprec.launched_fixture("ep", catalogue.runs("ep"), "ep_loop.py", 2)


@casecheck.rows("ep")
def test_the_verdict_is_the_catalogues(ep, case):
    """The clean runs pass; each fault fails (or is refused) named (tests/support/catalogue.py, the "ep" rows);
    the tests below confirm each against the plain model's own autograd."""
    casecheck.holds(ep[case.id], case)


def plain_gradient(out: Path, *, local_counts: bool = False) -> dict[str, torch.Tensor]:
    """The one-process model's (every expert) gradient at step 1 of the token-mean cross-entropy plus
    0.1 * E * sum_e f_e P_e over the step's rows, from build_model and the rows ep_loop reads: f from every
    rank's routing counts, or (local_counts) each rank's term over its own rows, averaged over the ranks."""
    from ep_loop import RUN
    from ep_moe import build_model
    from tp_loop import batch_rows

    rec = A.RecordingSet(out)
    kw, replicas = rec.meta["build_kwargs"], len(rec.meta["layout"]["groups"])  # EP: every rank; TP: one
    ids = batch_rows(kw["seed"], 0, replicas * RUN["rows"], RUN["T"])
    model = build_model(**kw)
    E = model.moe.experts
    parts = ids.chunk(replicas) if local_counts else [ids]
    for rows in parts:
        z = model(rows)
        probs, idx = model.moe.stats
        f = torch.bincount(idx.reshape(-1), minlength=E).float()
        f = f / f.sum()
        loss = F.cross_entropy(z[:, :-1].flatten(0, 1), rows[:, 1:].flatten()) + 0.1 * E * (f * probs.mean(0)).sum()
        (loss / len(parts)).backward()
    return {n: p.grad for n, p in model.named_parameters()}




def test_a_clean_expert_parallel_run_passes_at_float32_resolution(ep):
    v = looprec.verdict(ep["clean"])  # its row: PASS, the sharding named
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    rec = A.RecordingSet(ep["clean"])
    assert [r for r, _, _ in rec.micro_batches(1)] == [0, 1]  # each rank its own rows: data parallel
    # independently: every rank's recorded gradient, experts assembled, is one process's with every expert
    want = plain_gradient(ep["clean"])
    for rank in (0, 1):
        got = recorded(ep["clean"], rank)
        assert got["moe.w1"].shape == want["moe.w1"].shape == (4, 16, 24)
        assert max(rel(got[n], want[n]) for n in want) < 5e-6


def test_expert_gradients_too_large_by_the_ep_size_fail_named_while_the_loss_is_right(ep):
    # its row: layout fails naming the EP size; loss and replay pass (nothing in the run's curves looks off)
    # independently: the experts' gradients are twice one process's, the dense ones one process's
    want, got = plain_gradient(ep["ep_grad_unscaled"]), recorded(ep["ep_grad_unscaled"], 0)
    for n in EXPERTS:
        assert rel(got[n], 2 * want[n]) < 5e-6
    assert max(rel(got[n], want[n]) for n in want if n not in EXPERTS) < 5e-6


def test_expert_gradients_divided_by_the_ep_size_once_too_often_are_told_to_drop_it(ep):
    """The opposite factor (x 1/2): named as 1 / the EP size, and the advice is to remove the extra
    division, not (as it said) to divide "by the expert-parallel size too"."""
    c = looprec.verdict(ep["ep_grad_twice"]).check("layout")  # its row: failed, "remove that division"
    assert "must be divided by the expert-parallel size too" not in c.reason, c.reason
    want, got = plain_gradient(ep["ep_grad_twice"]), recorded(ep["ep_grad_twice"], 0)
    for n in EXPERTS:  # independently: the experts' gradients are half one process's
        assert rel(got[n], 0.5 * want[n]) < 5e-6


def test_expert_gradients_all_reduced_with_the_dense_ones_are_named_mixed_over_the_ep_group(ep):
    """One loop all-reduces every gradient, the experts' too: each rank's two experts get the sum of both
    ranks' (the gradient line says only "not by a constant factor"; the layout line names the mixing)."""
    want, got = plain_gradient(ep["ep_flat_reduce"]), recorded(ep["ep_flat_reduce"], 0)
    for n in EXPERTS:  # independently: each half of the assembled experts is the sum of one process's halves
        mixed = sum(want[n].chunk(2))
        assert rel(got[n], want[n]) > 0.1
        assert all(rel(half, mixed) < 5e-6 for half in got[n].chunk(2))
    assert max(rel(got[n], want[n]) for n in want if n not in EXPERTS) < 5e-6


def test_a_balancing_term_over_local_routing_counts_fails_against_the_declared_global_one(ep):
    # its row: gradient fails naming each rank's own term; layout passes (the experts' gradients are right)
    # independently: the recorded gradient is each rank's term over its own counts, not the global one's
    got = recorded(ep["aux_local"], 0)
    local, glob = plain_gradient(ep["aux_local"], local_counts=True), plain_gradient(ep["aux_local"])
    assert max(rel(got[n], local[n]) for n in local) < 5e-6
    assert rel(got["moe.router.weight"], glob["moe.router.weight"]) > 1e-3


# ----------------------------------------------------------------------------- the declaration, refused up front


def _recorder(tmp_path, model, sharding):
    from dormouse.gate import Recorder, RecordingSpec

    return Recorder(tmp_path, model, RecordingSpec(build_model="ep_moe:build_model",
                                                   build_optimizer="ep_moe:build_optimizer",
                                                   objective="ep_moe:objective", objective_scope="step",
                                                   build_kwargs={"seed": 0}),
                    sharding=sharding)


@pytest.mark.parametrize("sharding, words", [
    ({"moe.experts.*": "shard"}, "write 'replicated' or shard(dim, group, parallel)"),
    ({"moe.experts.*": {"dim": 0, "group": [0], "parallel": "expert"}}, "'moe.experts.*'] matches no parameter"),
    ({"moe.w*": {"dim": 0, "group": [0], "parallel": "expert"}, "moe.w1": "replicated"},
     "moe.w1 is matched by two patterns of the sharding, 'moe.w*' and 'moe.w1'"),
    ({"moe.w*": {"dim": 0, "group": [0, 1], "parallel": "expert"}}, "is not a list of distinct ranks of this run"),
    ({"moe.w*": {"dim": 0, "group": [0], "parallel": "pipeline"}}, "parallel 'pipeline' is none of tensor, expert"),
    ({"moe.w*": {"dim": 3, "group": [0], "parallel": "expert"}}, "moe.w1 has 3 dimension(s), no dim 3"),
])
def test_a_bad_declared_sharding_is_refused_in_one_line(tmp_path, sharding, words):
    from ep_moe import build_model

    from dormouse.gate.record.declared import ShardingError

    with pytest.raises(ShardingError) as e:
        _recorder(tmp_path, build_model(seed=0), sharding)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_sharding_whose_pieces_do_not_assemble_to_build_models_shape_is_refused_without_changing_the_run(tmp_path):
    from ep_moe import build_model, shard_experts

    from dormouse.gate import shard
    from dormouse.gate.record.declared import ShardingError

    model = shard_experts(build_model(seed=0), 0, 2)  # half the experts, declared as if rank 0 held them all
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    with pytest.raises(ShardingError, match=r"moe.w1 is assembled by the sharding \('moe.w\*': dim 0 over ranks "
                                            r"\[0\]\) to shape \[2, 16, 24\], but build_model's is \[4, 16, 24\]"):
        _recorder(tmp_path, model, {"moe.w*": shard(0, [0], "expert")})
    assert torch.equal(torch.random.get_rng_state(), state)  # build_model ran on the meta device, RNG put back


def test_a_declared_sharding_is_refused_with_sketches_or_the_probe(tmp_path):
    from ep_moe import build_model

    from dormouse.gate import Recorder, RecordingSpec, shard
    from dormouse.gate.record.options import RecorderError

    for extra in ({"sketch": 64}, {"probe_steps": [1]}):
        with pytest.raises(RecorderError, match="a declared sharding is recorded in full tensors"):
            Recorder(tmp_path, build_model(seed=0), RecordingSpec(build_model="ep_moe:build_model",
                                                                  build_optimizer="ep_moe:build_optimizer",
                                                                  **extra), sharding={"moe.w*": shard(0, [0], "expert")})


def test_a_clean_hand_written_tensor_parallel_run_declared_the_same_way_passes(ep):
    v = looprec.verdict(ep["tp_clean"])  # its row: PASS, the sharding and the layout named
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    rec = A.RecordingSet(ep["tp_clean"])
    assert [r for r, _, _ in rec.micro_batches(1)] == [0]  # the replica's rows once: rank 1's kept apart
    assert rec.step_meta(1, 1)["tp_micro_batches"] == 1
    want = plain_gradient(ep["tp_clean"])
    for rank in (0, 1):
        got = recorded(ep["tp_clean"], rank)
        assert got["out.weight"].shape == want["out.weight"].shape == (64, 16)
        assert max(rel(got[n], want[n]) for n in want) < 5e-6


def test_a_hand_written_all_reduce_left_out_of_the_backward_fails_named(ep):
    # its row: layout fails, "not reduced over it"; independently: the head's (assembled) gradient is one process's, the replicated ones are not
    want, got = plain_gradient(ep["tp_no_reduce"]), recorded(ep["tp_no_reduce"], 0)
    assert rel(got["out.weight"], want["out.weight"]) < 5e-6
    assert rel(got["norm.weight"], want["norm.weight"]) > 1e-2


def test_hand_written_tp_summing_the_replicated_gradients_over_the_tp_ranks_is_named_so(ep):
    # its row: layout fails, "summed over the TP group instead of averaged"
    # independently: every replicated gradient is twice one process's, the split head's is one process's
    want, got = plain_gradient(ep["tp_sum_replicated"]), recorded(ep["tp_sum_replicated"], 0)
    assert max(rel(got[n], want[n]) for n in ("out.weight", "out.bias")) < 5e-6
    assert max(rel(got[n], 2 * want[n]) for n in want if not n.startswith("out.")) < 5e-6


def test_a_declaration_naming_the_ranks_out_of_order_is_refused_at_the_rebuild_naming_the_sharding(ep):
    # its row: refused in one line naming the sharding; independently: the recorded initial experts are build_model's with the two ranks' halves swapped
    from ep_moe import build_model

    init, _ = A.read_tensors(A.init_path(ep["declare_reversed"], 0), "initial state")
    w1 = build_model(seed=5).moe.w1.detach()
    assert torch.equal(init["moe.w1"], torch.cat([w1[2:], w1[:2]]))


def test_tp_ranks_drawing_different_dropout_masks_are_named_so_not_an_unreduced_gradient(ep):
    """Hand-written TP with torch's dropout on the embedding's output (a region every TP rank holds
    whole): seeded alike, the ranks draw one mask and their replicated gradients agree (this file's
    torch.equal on their recorded files; the layout check passes); seeded by rank, they differ, and
    the layout line said "not reduced over it", inviting an all-reduce. It now names the masks."""
    for name, apart in (("tp_rng_alike", False), ("tp_rng_apart", True)):
        g0, g1 = recorded(ep[name], 0), recorded(ep[name], 1)
        assert torch.equal(g0["emb.weight"], g1["emb.weight"]) != apart, name
    # their rows: alike, the layout check passes; apart, it names the masks, "Not a missing reduction"
