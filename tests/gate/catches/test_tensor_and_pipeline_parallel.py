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

import looprec
import pytest
import torch
from looprec import failing, rel
from looprec import recorded_gradients as recorded

from dormouse.gate import artifacts as A

TP_RUNS = {
    "clean": {"seed": 0},
    # the output's logits gathered (Replicate), not loss_parallel; a dropout on the feed-forwards' column-split
    # hidden, its mask keyed by (seed, position, global column), each TP rank told its column shard
    "clean_seed2": {"seed": 2, "loss_parallel": False, "dropout": 0.1},
    "sp_norm_local": {"fault": "sp_norm_local", "seed": 3},
    "tp_grad_x": {"fault": "tp_grad_x", "seed": 4},
    "tp_rows": {"fault": "tp_rows", "seed": 5},
    # the probe: one module's output off on rank 1 (TP: a column shard of w1; DP: wv), a loss scaled on rank 1,
    # and a reduction that sums where DDP averages (every module agrees: the probe says so)
    "tp_w1": {"fault": "module_x", "module": "layers.1.feed_forward.w1", "factor": 1.01, "seed": 6},
    "dp_clean": {"tp": 1, "seed": 7},
    "dp_wv": {"tp": 1, "fault": "module_x", "module": "layers.0.attention.wv", "factor": 1.01, "seed": 8},
    "dp_loss_x": {"tp": 1, "fault": "loss_x", "factor": 1.5, "seed": 9},
    "dp_sum": {"tp": 1, "fault": "dp_sum", "seed": 10},
    # pipeline parallel (pp_loop.py): 2 stages, scale_grads; the fault divides the loss by the micro-batches too
    "pp_gpipe": {"pp": True, "schedule": "GPipe", "micro": 2, "rows": 4, "seed": 11},
    "pp_1f1b": {"pp": True, "schedule": "1F1B", "micro": 3, "rows": 6, "seed": 12},
    "pp_loss_div": {"pp": True, "schedule": "1F1B", "micro": 3, "rows": 6, "fault": "loss_div", "seed": 13},
    "pp_stale": {"pp": True, "schedule": "1F1B", "micro": 3, "rows": 6, "fault": "stale", "seed": 14},
    "tp_loss_x2": {"fault": "loss_x_all", "factor": 2.0, "seed": 16, "steps": 1},  # every gradient x 2 in TP alone
    # Megatron's vocabulary-parallel cross-entropy on gathered logits, backpropagated: the objective + log(TP)
    "tp_loss_vp": {"fault": "loss_vp_gathered", "loss_parallel": False, "seed": 17},
    # the gradients DTensor leaves Partial over TP (the norms') all-reduced in bf16, the rest float32
    "tp_reduce_bf16": {"fault": "tp_reduce_bf16", "seed": 24, "steps": 1},
    # the keyed dropout of clean_seed2 keyed by each TP rank's local column
    "tp_dropout_local": {"fault": "dropout_local", "dropout": 0.1, "seed": 19, "steps": 1},
    # last in the launch: DTensor's random ops on sharded parameters
    "tp_init_shards": {"fault": "init_shards", "seed": 15, "steps": 1},
}
DP_TP_RUNS = {
    "clean": {"seed": 0},
    "loss_local": {"fault": "loss_local", "seed": 1},
    "dp_sum": {"fault": "dp_sum", "seed": 2},
    # FSDP2's reduce_dtype bf16 on dp (the TP reductions stay float32): undeclared, then declared (one
    # micro-batch: FSDP2 accumulates no-sync micro-batches in the reduce dtype, which the wire does not cover)
    "reduce_bf16": {"reduce_dtype": "bfloat16", "seed": 20, "steps": 1},
    "reduce_bf16_wire": {"reduce_dtype": "bfloat16", "wire": "bf16", "micro": 1, "rows": 4, "seed": 21, "steps": 1},
}


tp = looprec.launched_fixture("tp", TP_RUNS, "tp_loop.py", 2)
dp_tp = looprec.launched_fixture("dp_tp", DP_TP_RUNS, "tp_loop.py", 4)


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
    v = looprec.verdict(tp[run])
    assert v.passed, failing(v)
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    layout = v.check("layout")
    assert "mesh tp 2" in layout.reason and "16 of 21 parameters split" in layout.reason, layout.reason
    # independently: every rank's recorded full gradient is the plain model's on the whole batch
    want = plain_gradient(tp[run])
    for rank in (0, 1):
        got = recorded(tp[run], rank)
        assert max(rel(got[n], want[n]) for n in want) < 5e-6


def test_a_factor_on_every_gradient_of_a_tp_run_is_named_by_the_tp_size_not_the_ranks(tp):
    """A TP-only run has one data-parallel replica: its ranks are no W to normalise by."""
    v = looprec.verdict(tp["tp_loss_x2"])
    g, lay = v.check("gradient"), v.check("layout")
    assert not v.passed and not g.passed and not lay.passed, failing(v)
    assert ("times 2 = K = the TP size 2 (W = 1 data-parallel replica(s) of 2 model-parallel ranks, K = 2 "
            "micro-batches)") in g.reason, g.reason
    assert "every gradient is one process's times 2 = the TP size 2" in lay.reason, lay.reason
    assert "world size" not in lay.reason, lay.reason
    want, got = plain_gradient(tp["tp_loss_x2"]), recorded(tp["tp_loss_x2"], 0)
    assert max(rel(got[n], 2 * want[n]) for n in want) < 5e-6


def test_the_tp_peer_records_its_inputs_apart_so_the_data_check_counts_each_replica_once(tp):
    rec = A.RecordingSet(tp["clean"])
    assert rec.step_meta(0, 1)["micro_batches"] == 2
    assert rec.step_meta(1, 1)["micro_batches"] == 0 and rec.step_meta(1, 1)["tp_micro_batches"] == 2
    assert len(rec.micro_batches(1)) == 2
    assert looprec.verdict(tp["clean"]).check("data").passed


def test_a_sequence_parallel_norm_whose_weight_gradient_is_not_reduced_over_tp_fails_named(tp):
    v = looprec.verdict(tp["sp_norm_local"])
    c = v.check("layout")
    assert not v.passed and not c.passed, failing(v)
    assert "norm.weight" in c.reason and "not reduced over it" in c.reason, c.reason
    assert "the sum of the group's gradients is one process's gradient" in c.reason, c.reason
    # independently: each rank holds part of the norm weight's gradient; their sum is the plain model's
    want = plain_gradient(tp["sp_norm_local"])
    g0, g1 = recorded(tp["sp_norm_local"], 0), recorded(tp["sp_norm_local"], 1)
    n = "layers.0.attention_norm.weight"
    assert rel(g0[n], want[n]) > 0.1 and rel(g0[n] + g1[n], want[n]) < 5e-6


def test_tp_split_gradients_too_large_by_the_tp_size_fail_named(tp):
    v = looprec.verdict(tp["tp_grad_x"])
    c = v.check("layout")
    assert not v.passed and not c.passed, failing(v)
    assert "times 2 = the TP size 2" in c.reason and "split over a model-parallel" in c.reason, c.reason
    assert not v.check("gradient").passed
    want, got = plain_gradient(tp["tp_grad_x"]), recorded(tp["tp_grad_x"], 0)
    assert abs(float(got["layers.0.attention.wq.weight"].norm() / want["layers.0.attention.wq.weight"].norm()) - 2) < 1e-4
    assert rel(got["norm.weight"], want["norm.weight"]) < 5e-6


def test_a_tp_rank_fed_other_rows_than_its_replica_fails_named(tp):
    v = looprec.verdict(tp["tp_rows"])
    c = v.check("layout")
    assert not v.passed and not c.passed, failing(v)
    assert "rank 1, a model-parallel peer of rank 0" in c.reason and "other rows" in c.reason, c.reason


def test_a_clean_2d_fsdp2_by_tp_run_passes_with_each_replica_read_once(dp_tp):
    v = looprec.verdict(dp_tp["clean"])
    assert v.passed, failing(v)
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    layout = v.check("layout")
    assert "mesh dp 2 x tp 2" in layout.reason and "2 data-parallel replica(s) of 2" in layout.reason, layout.reason
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
    out = dp_tp["loss_local"]
    v = looprec.verdict(out)
    c = v.check("loss")
    assert not v.passed and not c.passed, failing(v)
    assert "rank 0's own token mean" in c.reason and "the logged loss is wrong, not the training" in c.reason
    assert v.check("gradient").passed and v.check("layout").passed and v.check("replay").passed
    # independently: rank 0 logged its replica's rows' token mean (the first K x B rows), not the global batch's
    for k in (1, 2):
        logged = A.RecordingSet(out).step_meta(0, k)["loss"]
        assert abs(logged - plain_loss(out, k, slice(0, 4))) < 1e-5 * logged
        assert abs(logged - plain_loss(out, k, slice(None))) > 1e-3 * logged


def test_a_vocabulary_parallel_cross_entropy_on_gathered_logits_is_named_off_by_log_tp_at_the_loss(tp):
    """Megatron #7452 (2): its vocab_parallel_cross_entropy given logits every TP rank holds whole counts
    each logit TP times in the sum of exponentials (the loss the objective + log(TP)), and its local backward
    leaves the target's one-hot on rank 0 alone (the gradient wrong)."""
    out = tp["tp_loss_vp"]
    v = looprec.verdict(out)
    c, g, p = v.check("loss"), v.check("gradient"), v.check("probe")
    assert not v.passed and not c.passed and not g.passed and not p.passed, failing(v)
    assert "it is the declared objective + log(2) = + 0.6931, log of the TP size 2, at every step" in c.reason, c.reason
    assert "every module's forward output agrees with one process's, but the gradient flowing into the output of " \
           "output departs" in p.reason and "the gradient parts at the model's own output (its loss)" in p.reason
    assert v.check("layout").passed and v.check("replay").passed
    # independently: the logged loss minus the plain model's token mean on the whole batch is log 2 at each step
    for k in (1, 2):
        logged = A.RecordingSet(out).step_meta(0, k)["loss"]
        assert abs(logged - plain_loss(out, k, slice(None)) - math.log(2)) < 1e-5
    want, got = plain_gradient(out), recorded(out, 0)
    assert max(rel(got[n], want[n]) for n in want) > 0.1


def test_the_probe_agrees_module_by_module_on_clean_tp_and_dp_runs(tp):
    for run in ("clean", "dp_clean"):
        v = looprec.verdict(tp[run])
        c = v.check("probe")
        assert v.passed and c.passed, failing(v)
        assert "every module's forward output and output gradient agree" in c.reason, c.reason
        assert "not compared" not in c.reason, c.reason  # every TP piece assembled


def test_the_probe_names_the_module_a_tp_rank_computes_wrong(tp):
    v = looprec.verdict(tp["tp_w1"])
    c = v.check("probe")
    assert not v.passed and not c.passed, failing(v)
    assert "the first module whose forward output departs from one process's is layers.1.feed_forward.w1" in c.reason
    assert "the 20 module(s) before it in execution order agree" in c.reason, c.reason
    # independently: the recorded (assembled) w1 output is the plain model's but for rank 1's column shard x 1.01
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
    v = looprec.verdict(tp["dp_wv"])
    c = v.check("probe")
    assert not v.passed and not c.passed, failing(v)
    assert "on rank 1's first micro-batch the first module whose forward output departs" in c.reason, c.reason
    assert "is layers.0.attention.wv" in c.reason and "the 4 module(s) before it" in c.reason, c.reason
    # independently: rank 1's recorded wv output on its first micro-batch is the plain model's x 1.01, the
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


def test_the_probe_names_the_loss_when_a_rank_backpropagates_another_multiple_of_it(tp):
    v = looprec.verdict(tp["dp_loss_x"])
    c = v.check("probe")
    assert not v.passed and not c.passed, failing(v)
    assert "rank 1 backpropagates its loss at 1.5 times rank 0's scale" in c.reason, c.reason
    assert "the loss is at fault, not a module" in c.reason


def test_the_probe_puts_a_reduction_fault_after_the_backward(tp):
    v = looprec.verdict(tp["dp_sum"])
    assert not v.check("gradient").passed and "= W" in v.check("gradient").reason, v.check("gradient").reason
    c = v.check("probe")
    assert c.passed and "after the backward (the reduction)" in c.reason, c.reason


@pytest.mark.parametrize("run", ["pp_gpipe", "pp_1f1b"])
def test_a_clean_pipeline_run_passes_with_its_stages_merged_by_name(tp, run):
    v = looprec.verdict(tp[run])
    assert v.passed, failing(v)
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    assert "pipeline of 2 stages" in v.check("layout").reason and "21 parameters" in v.check("layout").reason
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


def test_a_pipeline_loss_divided_by_the_micro_batches_on_top_of_scale_grads_fails_named(tp):
    v = looprec.verdict(tp["pp_loss_div"])
    c = v.check("gradient")
    assert not v.passed and not c.passed, failing(v)
    assert "times 0.3333 = 1/K" in c.reason and "K = 3 micro-batches" in c.reason, c.reason
    assert not v.check("loss").passed


def test_a_pipeline_stage_that_never_zeroes_its_gradients_fails_named_with_its_tensors(tp):
    import torch.nn.functional as F
    from tp_llama import build_model
    from tp_loop import RUN, batch_rows

    out = tp["pp_stale"]
    v = looprec.verdict(out)
    c = v.check("gradient")
    assert not v.passed and not c.passed, failing(v)
    assert "not zeroed between steps: from step 2 on" in c.reason and "times 0.3333 = 1/K" in c.reason, c.reason
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

    from dormouse.errors import DormouseError
    from dormouse.gate.record.reference import make_reference

    out = tp["tp_init_shards"]
    init, _ = A.read_tensors(A.step_tensors_path(out, 0, 1), "step tensors")
    built = dict(build_model(seed=15).named_parameters())
    w = init["p/layers.0.attention.wq.weight"]  # ColwiseParallel: split along dim 0
    top, bottom = w.chunk(2, 0)
    assert torch.equal(top, bottom) and not torch.equal(w, built["layers.0.attention.wq.weight"].detach())
    with pytest.raises(DormouseError) as e:
        make_reference(out)
    assert "equal copies of one shard along dim 0" in str(e.value) and "after parallelize_module" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_2d_run_whose_dp_reduction_sums_fails_named_by_the_mesh(dp_tp):
    v = looprec.verdict(dp_tp["dp_sum"])
    c = v.check("layout")
    assert not v.passed and not c.passed, failing(v)
    assert "every gradient is one process's times 2 = the DP size 2" in c.reason, c.reason
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
                                                                build_optimizer="tp_llama:build_optimizer", sketch=64), pipeline_stage=Stage())


def test_a_keyed_dropout_on_the_column_split_hidden_passes_when_each_tp_rank_keys_its_global_columns(tp):
    out = tp["clean_seed2"]  # its dropout: tp_llama.KeyedDropout, p = 0.1
    assert A.RecordingSet(out).meta["build_kwargs"]["dropout"] == 0.1
    v = looprec.verdict(out)
    assert v.passed and v.check("probe").passed, failing(v)
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

    out = tp["tp_dropout_local"]
    v = looprec.verdict(out)
    g, c = v.check("gradient"), v.check("probe")
    assert not v.passed and not g.passed and not c.passed, failing(v)
    assert "not by a constant factor" in g.reason, g.reason
    assert "the first module whose forward output departs from one process's is layers.0.feed_forward.drop" in c.reason
    assert "the 10 module(s) before it in execution order agree" in c.reason, c.reason
    assert v.check("layout").passed and v.check("replay").passed
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
    out = dp_tp["reduce_bf16"]
    v = looprec.verdict(out)
    g = v.check("gradient")
    assert not v.passed and not g.passed, failing(v)
    assert "every element of the fleet's gradient is a bfloat16 value" in g.reason, g.reason
    assert "declare it, Recorder(wire='bf16')" in g.reason, g.reason
    assert v.check("loss").passed and v.check("layout").passed and v.check("replay").passed
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
    out = tp["tp_reduce_bf16"]
    v = looprec.verdict(out)
    g = v.check("gradient")
    assert not v.passed and not g.passed, failing(v)
    assert "the gradients of 5 tensor(s) (layers.0.attention_norm.weight, layers.0.ffn_norm.weight, " \
           "layers.1.attention_norm.weight, ...) are bfloat16 values in every element" in g.reason, g.reason
    assert "a reduce dtype applied on one mesh dimension only" in g.reason, g.reason
    assert v.check("loss").passed and v.check("replay").passed
    # independently: the norms' recorded gradients lie on the bf16 grid, a bf16 rounding from the plain model's;
    # every other tensor is the plain model's at float32 resolution
    want, got = plain_gradient(out), recorded(out, 0)
    norms = [n for n in want if n.endswith("norm.weight")]
    assert len(norms) == 5 and bf16_grid({n: got[n] for n in norms})
    assert all(1e-5 < rel(got[n], want[n]) < 1e-2 for n in norms)
    assert max(rel(got[n], want[n]) for n in want if n not in norms) < 5e-6


def test_a_2d_run_reducing_over_dp_in_bf16_passes_when_it_declares_the_bf16_wire(dp_tp):
    out = dp_tp["reduce_bf16_wire"]
    v = looprec.verdict(out)
    assert v.passed, failing(v)
    assert "declared bf16 wire's bound" in v.check("gradient").reason, v.check("gradient").reason
    assert v.check("bias").passed
    want = plain_gradient(out, rows=8)
    got = recorded(out, 0)
    assert bf16_grid(got) and 1e-4 < max(rel(got[n], want[n]) for n in want) < 1e-2
