"""The Recorder on tensor-parallel runs with no annotation (issue 28):
tests/support/tp_loop.py trains tp_llama (a torchtitan-style tiny llama,
torchtitan's TP plan: ColwiseParallel, RowwiseParallel, SequenceParallel,
PrepareModuleInput, loss_parallel) on a 1-D TP mesh of 2 gloo ranks, and on a
2-D (dp 2, tp 2) mesh with FSDP2 on dp (4 ranks, placements
(_StridedShard(dim=0, sf=2), Shard(dim=0))), under real torchrun. Clean runs
pass at float32 resolution; each planted fault fails, named by the layout
check or the loss check. Each finding is confirmed against a computation that
shares none of the gate's code: the unparallelised model's own autograd on
the global batch, read straight from the recorded files. The same 2-rank
launch runs plain DDP runs (the probe: the module a rank computes wrong, a loss
scaled on one rank, a summed reduction) and pipeline runs (pp_loop.py: 2
stages, GPipe and 1F1B, scale_grads). One launch per mesh size."""

from __future__ import annotations

import math
from pathlib import Path

import casecheck
import catalogue
import looprec
import pytest
import torch
from looprec import rel
from looprec import recorded_gradients as recorded

from dormouse.gate import artifacts as A

tp = looprec.launched_fixture("tp", catalogue.runs("tp"), "tp_loop.py", 2)
dp_tp = looprec.launched_fixture("dp_tp", catalogue.runs("dp_tp"), "tp_loop.py", 4)


@casecheck.rows("tp", "dp_tp")
def test_the_verdict_is_the_catalogues(request, case):
    """Clean runs pass; each fault fails (or is refused) for its named cause (tests/support/catalogue.py),
    on 2 ranks (tp) and 4 (dp_tp); the tests below confirm each against this file's own computation."""
    casecheck.holds(request.getfixturevalue(case.fleet)[case.id], case)


def plain_gradient(out: Path, step: int = 1, rows: int | None = None) -> dict[str, torch.Tensor]:
    """The unparallelised model's gradient of the global token mean at step 1,
    from build_model and the rows tp_loop reads (its own rule, not the
    recording's inputs): what every clean layout must equal."""
    import torch.nn.functional as F
    from tp_llama import build_model
    from tp_loop import RUN, batch_rows

    rec = A.RecordingSet(out)
    seed = rec.meta["build_kwargs"]["seed"]
    replicas = len(rec.meta["layout"]["groups"]) if rec.meta.get("layout") else rec.meta["world"]
    ids = batch_rows(seed, step - 1, rows or replicas * RUN["micro"] * RUN["rows"], RUN["T"])
    model = build_model(**rec.meta["build_kwargs"])
    z = model(ids)
    F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}




@pytest.mark.parametrize("run", ["clean", "clean_seed2"])
def test_a_clean_tensor_parallel_run_passes_at_float32_resolution(tp, run):
    v = looprec.verdict(tp[run])  # its row: PASS, the mesh named
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    # independently: every rank's recorded full gradient is the plain model's on the whole batch
    want = plain_gradient(tp[run])
    for rank in (0, 1):
        got = recorded(tp[run], rank)
        assert max(rel(got[n], want[n]) for n in want) < 5e-6


def test_a_factor_on_every_gradient_of_a_tp_run_is_named_by_the_tp_size_not_the_ranks(tp):
    """A TP-only run has one data-parallel replica: its ranks are no W to normalise by."""
    lay = looprec.verdict(tp["tp_loss_x2"]).check("layout")  # its row: gradient and layout fail, the TP size named
    assert "world size" not in lay.reason, lay.reason
    want, got = plain_gradient(tp["tp_loss_x2"]), recorded(tp["tp_loss_x2"], 0)
    assert max(rel(got[n], 2 * want[n]) for n in want) < 5e-6


def test_the_tp_peer_records_its_inputs_apart_so_the_data_check_counts_each_replica_once(tp):
    rec = A.RecordingSet(tp["clean"])
    assert rec.step_meta(0, 1)["micro_batches"] == 2
    assert rec.step_meta(1, 1)["micro_batches"] == 0 and rec.step_meta(1, 1)["tp_micro_batches"] == 2
    assert len(rec.micro_batches(1)) == 2  # (its row: the data check passes)


def test_a_sequence_parallel_norm_whose_weight_gradient_is_not_reduced_over_tp_fails_named(tp):
    # independently: each rank holds part of the norm weight's gradient; their sum is the plain model's
    want = plain_gradient(tp["sp_norm_local"])
    g0, g1 = recorded(tp["sp_norm_local"], 0), recorded(tp["sp_norm_local"], 1)
    n = "layers.0.attention_norm.weight"
    assert rel(g0[n], want[n]) > 0.1 and rel(g0[n] + g1[n], want[n]) < 5e-6


def test_sequence_parallel_norms_averaged_over_tp_where_summed_are_named_on_those_tensors_alone(tp):
    """The plain block norms' parts averaged (not summed) over TP: half one process's on those tensors
    alone, the final norm (a DTensor, reduced by DTensor) right: a factor on a subset of the replicated
    tensors, which the layout line names."""
    want, got = plain_gradient(tp["sp_norm_avg"]), recorded(tp["sp_norm_avg"], 0)
    norms = [n for n in want if ".attention_norm." in n or ".ffn_norm." in n]
    assert norms and max(rel(got[n], 0.5 * want[n]) for n in norms) < 5e-6
    assert max(rel(got[n], want[n]) for n in want if n not in norms) < 5e-6


def test_tp_split_gradients_too_large_by_the_tp_size_fail_named(tp):
    want, got = plain_gradient(tp["tp_grad_x"]), recorded(tp["tp_grad_x"], 0)
    assert abs(float(got["layers.0.attention.wq.weight"].norm() / want["layers.0.attention.wq.weight"].norm()) - 2) < 1e-4
    assert rel(got["norm.weight"], want["norm.weight"]) < 5e-6


def test_a_clean_2d_fsdp2_by_tp_run_passes_with_each_replica_read_once(dp_tp):
    v = looprec.verdict(dp_tp["clean"])  # its row: PASS, the mesh named
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    rec = A.RecordingSet(dp_tp["clean"])
    assert "_StridedShard" in rec.meta["layout"]["params"]["layers.0.attention.wq.weight"]["placements"][0]
    assert [r for r, _, _ in rec.micro_batches(1)] == [0, 0, 2, 2]  # each replica's leader, K = 2 each
    want = plain_gradient(dp_tp["clean"])
    for rank in range(4):
        got = recorded(dp_tp["clean"], rank)
        assert max(rel(got[n], want[n]) for n in want) < 5e-6


def plain_loss(out: Path, step: int, rows: slice) -> float:
    """The unparallelised model's token-mean cross-entropy at the parameters recorded before `step`, on
    `rows` of the step's global batch (tp_loop's rule for the rows, not the recording's inputs)."""
    import torch.nn.functional as F
    from tp_llama import build_model
    from tp_loop import RUN, batch_rows

    rec = A.RecordingSet(out)
    replicas = len(rec.meta["layout"]["groups"])
    t, _ = A.read_tensors(A.step_tensors_path(out, 0, step), "step tensors")
    model = build_model(**rec.meta["build_kwargs"])
    model.load_state_dict({n[2:]: v for n, v in t.items() if n.startswith("p/")})
    ids = batch_rows(rec.meta["build_kwargs"]["seed"], step - 1, replicas * RUN["micro"] * RUN["rows"], RUN["T"])[rows]
    with torch.no_grad():
        z = model(ids)
        return float(F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def test_a_2d_loss_logged_without_its_dp_reduction_fails_the_loss_alone(dp_tp):
    """torchtitan #3329's kind: the gradient right, the logged loss one replica's."""
    out = dp_tp["loss_local"]  # its row: the loss alone fails, "the logged loss is wrong, not the training"
    # independently: rank 0 logged its replica's rows' token mean (the first K x B rows), not the global batch's
    for k in (1, 2):
        logged = A.RecordingSet(out).step_meta(0, k)["loss"]
        assert abs(logged - plain_loss(out, k, slice(0, 4))) < 1e-5 * logged
        assert abs(logged - plain_loss(out, k, slice(None))) > 1e-3 * logged


def test_a_vocabulary_parallel_cross_entropy_on_gathered_logits_is_named_off_by_log_tp_at_the_loss(tp):
    """Megatron #7452 (2): its vocab_parallel_cross_entropy given logits every TP rank holds whole counts
    each logit TP times in the sum of exponentials (the loss the objective + log(TP)), and its local backward
    leaves the target's one-hot on rank 0 alone (the gradient wrong)."""
    out = tp["tp_loss_vp"]  # its row: loss, gradient and probe fail, log(TP) named at the loss
    # independently: the logged loss minus the plain model's token mean on the whole batch is log 2 at each step
    for k in (1, 2):
        logged = A.RecordingSet(out).step_meta(0, k)["loss"]
        assert abs(logged - plain_loss(out, k, slice(None)) - math.log(2)) < 1e-5
    want, got = plain_gradient(out), recorded(out, 0)
    assert max(rel(got[n], want[n]) for n in want) > 0.1


def test_the_probe_agrees_module_by_module_on_clean_tp_and_dp_runs(tp):
    for run in ("clean", "dp_clean"):  # their rows: PASS, every module agreeing
        c = looprec.verdict(tp[run]).check("probe")
        assert "not compared" not in c.reason, c.reason  # every TP piece assembled


def test_the_probe_names_the_module_a_tp_rank_computes_wrong(tp):
    # its row: the probe names layers.1.feed_forward.w1; independently: the recorded (assembled) w1 output is the plain model's but for rank 1's column shard x 1.01
    t0, _ = A.read_tensors(A.step_tensors_path(tp["tp_w1"], 0, 1), "step tensors")
    t1, _ = A.read_tensors(A.step_tensors_path(tp["tp_w1"], 1, 1), "step tensors")
    a, b = t0["po/layers.1.feed_forward.w1"], t1["po/layers.1.feed_forward.w1"]
    assert a.shape == b.shape == (2, 8, 32)  # each rank's column shard (hidden 64 over tp 2)
    from tp_llama import build_model
    from tp_loop import batch_rows

    model, seen = build_model(seed=6), {}
    model.layers["1"].feed_forward.w1.register_forward_hook(lambda m, i, o: seen.update(w1=o.detach()))
    model(batch_rows(6, 0, 4, 8)[:2])
    assert rel(a, seen["w1"][..., :32]) < 1e-5 and abs(float(b.norm() / seen["w1"][..., 32:].norm()) - 1.01) < 1e-5


def test_the_probe_names_the_module_a_dp_rank_computes_wrong(tp):
    # its row: the probe names layers.0.attention.wv on rank 1's first micro-batch; independently: rank 1's recorded wv output on its first micro-batch is the plain model's x 1.01, the
    # module before it (wk) the plain model's, and rank 0's wv output the plain model's
    from tp_llama import build_model
    from tp_loop import RUN, batch_rows

    model, seen = build_model(seed=8), {}
    for name in ("wk", "wv"):
        getattr(model.layers["0"].attention, name).register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, o.detach()))
    K, B = RUN["micro"], RUN["rows"]
    rows = batch_rows(8, 0, 2 * K * B, RUN["T"])
    for rank, factor in ((0, 1.0), (1, 1.01)):
        t, _ = A.read_tensors(A.step_tensors_path(tp["dp_wv"], rank, 1), "step tensors")
        model(rows[rank * K * B:rank * K * B + B])
        assert rel(t["po/layers.0.attention.wk"], seen["wk"]) < 1e-5
        assert rel(t["po/layers.0.attention.wv"], factor * seen["wv"]) < 1e-5


@pytest.mark.parametrize("run", ["pp_gpipe", "pp_1f1b"])
def test_a_clean_pipeline_run_passes_with_its_stages_merged_by_name(tp, run):
    v = looprec.verdict(tp[run])  # its row: PASS, the stages named
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    rec = A.RecordingSet(tp[run])
    micro = 2 if run == "pp_gpipe" else 3
    # the schedule's shape-inference forward is not a micro-batch; stage 1's inputs (activations) are not data
    assert [r for r, _, _ in rec.micro_batches(1)] == [0] * micro
    # independently: stage 0 records the embedding, stage 1 the output; each the plain model's gradient
    want = plain_gradient(tp[run], rows=4 if run == "pp_gpipe" else 6)
    g0, g1 = recorded(tp[run], 0), recorded(tp[run], 1)
    assert "tok_embeddings.weight" in g0 and "output.weight" in g1 and not set(g0) & set(g1)
    both = {**g0, **g1}
    assert max(rel(both[n], want[n]) for n in want) < 5e-6


def test_a_pipeline_stage_that_never_zeroes_its_gradients_fails_named_with_its_tensors(tp):
    import torch.nn.functional as F
    from tp_llama import build_model
    from tp_loop import RUN, batch_rows

    out = tp["pp_stale"]  # its row: the gradient fails, "not zeroed between steps"
    # by hand: the plain model at the recorded step-2 parameters, on step 2's rows; the last stage's
    # recorded gradient is that plus a third of its step-1 gradient, the first stage's is that alone
    t = {**A.read_tensors(A.step_tensors_path(out, 0, 2), "step tensors")[0],
         **A.read_tensors(A.step_tensors_path(out, 1, 2), "step tensors")[0]}
    model = build_model(seed=14)
    model.load_state_dict({n[2:]: v for n, v in t.items() if n.startswith("p/")})
    ids = batch_rows(14, 1, 6, RUN["T"])
    z = model(ids)
    F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    g1 = recorded(out, 1, 1)
    for n, p in model.named_parameters():
        got = t[f"g/{n}"]
        assert rel(got - p.grad, g1[n] / 3) < 5e-6 if n in g1 else rel(got, p.grad) < 5e-6, n


def test_a_tp_run_initialised_shard_by_shard_after_parallelising_is_refused_naming_the_copied_shards(tp):
    from tp_llama import build_model

    out = tp["tp_init_shards"]  # its row: refused, the copied shards named
    init, _ = A.read_tensors(A.step_tensors_path(out, 0, 1), "step tensors")
    built = dict(build_model(seed=15).named_parameters())
    w = init["p/layers.0.attention.wq.weight"]  # ColwiseParallel: split along dim 0
    top, bottom = w.chunk(2, 0)
    assert torch.equal(top, bottom) and not torch.equal(w, built["layers.0.attention.wq.weight"].detach())


def test_a_2d_run_whose_dp_reduction_sums_fails_named_by_the_mesh(dp_tp):
    v = looprec.verdict(dp_tp["dp_sum"])  # its row: layout fails, the DP size named
    # the gradient check counts W in data-parallel replicas, not ranks: 2 replicas of 2 TP ranks
    g = v.check("gradient").reason
    assert "times 2 = W = K = the TP size 2 (W = 2 data-parallel replica(s) of 2 model-parallel ranks, K = 2" in g, g
    want, got = plain_gradient(dp_tp["dp_sum"]), recorded(dp_tp["dp_sum"], 3)
    assert max(rel(got[n], 2 * want[n]) for n in want) < 5e-6


def test_a_pipeline_recording_with_sketches_is_refused_in_one_line(tmp_path):
    from dormouse.gate import Recorder, RecordingSpec
    from dormouse.gate.record.options import RecorderError

    class Stage:  # a PipelineStage's two fields the Recorder reads
        stage_index, num_stages = 0, 2

    with pytest.raises(RecorderError, match="a pipeline is recorded in full tensors"):
        Recorder(tmp_path, torch.nn.Linear(2, 2), RecordingSpec(build_model="tp_llama:build_model",
                                                                build_optimizer="tp_llama:build_optimizer",
                                                                sketch=64), pipeline_stage=Stage())


def test_a_keyed_dropout_on_the_column_split_hidden_passes_when_each_tp_rank_keys_its_global_columns(tp):
    out = tp["clean_seed2"]  # its dropout: tp_llama.KeyedDropout, p = 0.1
    assert A.RecordingSet(out).meta["build_kwargs"]["dropout"] == 0.1
    t0, t1 = (A.read_tensors(A.step_tensors_path(out, r, 1), "step tensors")[0]["po/layers.0.feed_forward.drop"]
              for r in (0, 1))
    assert t0.shape == (2, 8, 32) and not torch.equal(t0 == 0, t1 == 0)  # each TP rank its own columns' mask
    assert 0.05 < float((t0 == 0).float().mean()) < 0.15


def test_dropout_drawn_alike_on_the_tp_ranks_of_a_column_split_region_fails_and_the_probe_names_it(tp):
    """Megatron-LM #26's kind (a dropout outside the model-parallel RNG tracker): every TP rank keys the
    dropout mask by its local column, so each draws the first shard's mask where one process draws one
    mask over all the columns."""
    from tp_llama import build_model
    from tp_loop import batch_rows

    out = tp["tp_dropout_local"]  # its row: gradient and probe fail, the dropout module named
    # independently, from the recorded outputs alone: both TP ranks zeroed the same elements of their shards
    t0, t1 = (A.read_tensors(A.step_tensors_path(out, r, 1), "step tensors")[0]["po/layers.0.feed_forward.drop"]
              for r in (0, 1))
    assert t0.shape == t1.shape == (2, 8, 32) and torch.equal(t0 == 0, t1 == 0)
    # and against the plain model: rank 1's shard is the plain hidden under the FIRST shard's mask, which
    # differs from its own columns' mask in about a sixth of the elements; rank 0's shard is the plain one
    model, seen = build_model(seed=19, dropout=0.1), {}
    drop = model.layers["0"].feed_forward.drop
    drop.register_forward_hook(lambda m, i, o: seen.update(h=i[0].detach(), out=o.detach()))
    model(batch_rows(19, 0, 4, 8)[:2])
    first, own = drop.mask(8, 0, 32), drop.mask(8, 32, 32)
    assert rel(t0, seen["out"][..., :32]) < 1e-5 and rel(t1, seen["out"][..., 32:]) > 0.1
    assert rel(t1, seen["h"][..., 32:] * first / 0.9) < 1e-5
    assert 0.1 < float((first != own).float().mean()) < 0.25
    want, got = plain_gradient(out), recorded(out, 0)
    assert max(rel(got[n], want[n]) for n in want) > 1e-2


def bf16_grid(grads: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, v.bfloat16().float()) for v in grads.values())


def test_a_2d_run_reducing_over_dp_in_bf16_under_an_undeclared_wire_fails_naming_the_bf16_wire(dp_tp):
    """FSDP2's MixedPrecisionPolicy(reduce_dtype=bfloat16) on the dp dimension of a 2-D run (the TP
    reductions in float32: the reduce dtype applied on one mesh dimension, pytorch #190627's kind), the
    Recorder's wire left at its default fp32."""
    out = dp_tp["reduce_bf16"]  # its row: the gradient fails naming the bf16 wire
    # independently: every rank's recorded gradient lies on the bf16 grid, a bf16 rounding away from the plain
    # model's; the float32 run's does not
    want = plain_gradient(out)
    for rank in range(4):
        got = recorded(out, rank)
        assert bf16_grid(got) and 1e-4 < max(rel(got[n], want[n]) for n in want) < 1e-2
    assert not bf16_grid(recorded(dp_tp["clean"], 0))


def test_a_tp_reduction_in_bf16_of_the_replicated_parameters_alone_fails_naming_those_tensors(tp):
    """pytorch #190626's kind in a float32 run: the TP-replicated parameters' gradients (the sequence-parallel
    norms') reduced over the TP group in bfloat16, every other reduction float32."""
    out = tp["tp_reduce_bf16"]  # its row: the gradient fails naming the 5 norms' bf16 gradients
    # independently: the norms' recorded gradients lie on the bf16 grid, a bf16 rounding from the plain model's;
    # every other tensor is the plain model's at float32 resolution
    want, got = plain_gradient(out), recorded(out, 0)
    norms = [n for n in want if n.endswith("norm.weight")]
    assert len(norms) == 5 and bf16_grid({n: got[n] for n in norms})
    assert all(1e-5 < rel(got[n], want[n]) < 1e-2 for n in norms)
    assert max(rel(got[n], want[n]) for n in want if n not in norms) < 5e-6


def test_a_2d_run_reducing_over_dp_in_bf16_passes_when_it_declares_the_bf16_wire(dp_tp):
    out = dp_tp["reduce_bf16_wire"]  # its row: PASS within the declared wire's bound
    want = plain_gradient(out, rows=8)
    got = recorded(out, 0)
    assert bf16_grid(got) and 1e-4 < max(rel(got[n], want[n]) for n in want) < 1e-2
