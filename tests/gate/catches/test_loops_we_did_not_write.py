"""Loops written as users write them (issue 37's review), through tests/support/wild_loop.py: a plain
DDP loop over loopmodel's TinyLM, 2 gloo ranks, every run in ONE real torchrun launch. Each verdict is
checked against this file's own computation in plain PyTorch (the loop's rows regenerated, the global
token mean differentiated in one process), and the real command (`dormouse gate check`) is run where
the finding was the command's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import casecheck
import catalogue
import looprec
import torch
import torch.nn.functional as F
from loopmodel import VOCAB, build_model, dataset
from pp_loop import RUN as RUN_PP
from wild_loop import RUN, batches, build_aux_model

from dormouse.gate import artifacts as A

W = 2
RUNS = catalogue.runs("wild")  # each row's wild_loop options (seed 3), for this file's one-process computations
fleet = looprec.launched_fixture("fleet", RUNS, "wild_loop.py", W)
# pipeline runs (pp_loop.py) and a tensor-parallel one (tp_loop.py) in one launch of tp_loop.py
pipeline = looprec.launched_fixture("pipeline", catalogue.runs("wild_pp"), "tp_loop.py", W)
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(looprec.SUPPORT), os.environ.get("PYTHONPATH", "")])}


def step_rows(name: str, step: int = 1) -> list[dict]:
    """Every rank's micro-batches of `step` as the loop built them (torch's DistributedSampler)."""
    cfg = {**RUN, **RUNS[name]}
    K, B = cfg["micro"], cfg["batch"]
    data = dataset(cfg["n"], cfg["seed"])
    out = []
    for r in range(W):
        order = list(torch.utils.data.DistributedSampler(range(cfg["n"]), num_replicas=W, rank=r, shuffle=True,
                                                         seed=cfg["seed"], drop_last=True))
        out += batches(cfg, data, order[(step - 1) * K * B:step * K * B], r)
    return out


def one_process(net, mbs: list[dict]) -> dict:
    """The global token mean's gradient in one process (float64 accumulation of plain autograd)."""
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    net.zero_grad(set_to_none=True)
    for mb in mbs:
        z = net(mb["input_ids"])[:, :-1]
        (F.cross_entropy(z.reshape(-1, VOCAB), mb["labels"][:, 1:].reshape(-1), ignore_index=-100,
                         reduction="sum") / n).backward()
    return {k: p.grad.detach().double().clone() for k, p in net.named_parameters()}


def recorded(out, step: int = 1) -> dict:
    """Rank 0's recorded gradient at `step`, over its clip coefficient where the loop clipped first."""
    m = A.RecordingSet(out).step_meta(0, step)
    c = m["clip_coef"] if m["clipped"] else 1.0
    return {k: v.double() / c for k, v in looprec.recorded_gradients(out, 0, step).items()}


@casecheck.rows("wild", "wild_pp")
def test_the_verdict_is_the_catalogues(fleet, pipeline, case):
    """Each loop's verdict and named cause (tests/support/catalogue.py, the "wild" and "wild_pp" rows);
    the tests below confirm each by this file's own computation."""
    casecheck.holds((fleet if case.fleet == "wild" else pipeline)[case.id], case)


def gate_check(out, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dormouse", "gate", "check", "--out", str(out)], env=ENV,
                          text=True, timeout=300, **({"capture_output": True} | kw))


def test_a_module_keeping_a_graph_tensor_after_its_forward_is_judged_by_the_command(fleet):
    """An MoE-style layer keeps its last forward's term as self.aux: the probe's copy of the model
    (deepcopy refuses a non-leaf tensor) crashed `gate check`, exit 3. The command now judges it: PASS,
    and the recorded step-1 gradient is this file's one-process gradient."""
    r = gate_check(fleet["aux"])
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    got = recorded(fleet["aux"])
    want = one_process(build_aux_model(seed=3), step_rows("aux"))
    assert looprec.worst(got, want) < 1e-6


def test_labels_equal_to_the_inputs_with_padding_unmasked_pass_as_the_one_process_gradient_does(fleet):
    """labels = input_ids with padding left as targets (pytorch-84803's workload): every padded
    position is a target. Fact 1 trimmed each row to its attention mask, dropping those targets, and a
    clean run failed independence (0.71). The rows alone at their padded length sum to the batch's
    gradient (this file's arithmetic: the network IS row-independent), the fleet's gradient is the
    one-process one, and the verdict passes."""
    mbs = step_rows("labels_inputs")
    assert any(bool((mb["attention_mask"] == 0).any()) for mb in mbs)  # padding that the labels make targets
    net = build_model(seed=3)
    got = recorded(fleet["labels_inputs"])
    assert looprec.worst(got, one_process(net, mbs)) < 1e-6
    mb = next(mb for mb in mbs if bool((mb["attention_mask"] == 0).any()))
    whole = one_process(net, [mb])
    n = int((mb["labels"][:, 1:] != -100).sum())
    rows = [{k: v[i:i + 1] for k, v in mb.items()} for i in range(mb["input_ids"].shape[0])]
    alone = [one_process(net, [row]) for row in rows]
    summed = {k: sum(a[k] * int((row["labels"][:, 1:] != -100).sum()) for a, row in zip(alone, rows)) / n
              for k in whole}
    assert looprec.worst(summed, whole) < 1e-6


def test_output_to_a_full_disk_is_one_line(fleet):
    """`dormouse gate check --out D > /dev/full`: a traceback and "the run crashed", exit 3, before;
    now one line saying what could not be written, exit 2."""
    with open("/dev/full", "w") as full:
        r = gate_check(fleet["aux"], stdout=full, stderr=subprocess.PIPE, capture_output=False)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in r.stderr and len(errors) == 1, r.stderr
    assert "No space left on device" in errors[0], r.stderr


def test_batchnorm_statistics_of_one_ranks_rows_are_said_not_judged_never_a_silent_ok(fleet):
    """The loop freezes its BatchNorm in the training forwards and, after each step, moves the running
    statistics by rank 0's first micro-batch alone, then broadcasts them: the verdict was a PASS with no
    word on the buffers. This file's arithmetic shows the statistics are rank 0's rows' (not the global
    batch's); the verdict's buffers line now says they were not judged, and why."""
    out = fleet["bn_rank0"]
    rec = A.RecordingSet(out)
    params, before, after = rec.tensors_at(2, "p/"), rec.tensors_at(1, "b/"), rec.tensors_at(2, "b/")

    def moved(mbs):  # BatchNorm1d's update (momentum 0.1, unbiased variance) over the rows' embeddings
        x = torch.cat([(params["tok.weight"][mb["input_ids"]] + params["pos.weight"][:mb["input_ids"].shape[1]])
                       .reshape(-1, params["tok.weight"].shape[1]) for mb in mbs])
        return 0.9 * before["bn.running_mean"] + 0.1 * x.mean(0), 0.9 * before["bn.running_var"] + 0.1 * x.var(0)

    mbs = step_rows("bn_rank0")
    rank0_first = mbs[0]
    mean0, var0 = moved([rank0_first])
    assert torch.allclose(after["bn.running_mean"], mean0, atol=1e-6)
    assert torch.allclose(after["bn.running_var"], var0, atol=1e-6)
    mean_all, _ = moved(mbs)  # what the global batch's rows would have given (a different statistic)
    assert not torch.allclose(after["bn.running_mean"], mean_all, atol=1e-3)
    # (its row: the buffers line says they were not judged, and why)


def test_rows_a_collator_altered_on_one_rank_are_said_taken_as_given(fleet):
    """Rank 1's collator drops every row's last token: the gate judges whatever reached the model, and
    the verdict passed without a word on where the rows came from. This file shows rank 1's recorded rows
    are not the dataset's (each one token short); the verdict's data line now says the rows were taken
    as given (a plain loop's Recorder holds no dataset to prove them against)."""
    out = fleet["collate_drop"]
    cfg = {**RUN, **RUNS["collate_drop"]}
    data = dataset(cfg["n"], cfg["seed"])
    order = list(torch.utils.data.DistributedSampler(range(cfg["n"]), num_replicas=W, rank=1, shuffle=True,
                                                     seed=cfg["seed"], drop_last=True))
    recorded = A.RecordingSet(out).micro_batches(1)
    rank1 = [b for r, _, b in recorded if r == 1][0]
    lengths = rank1["attention_mask"].sum(1).tolist()
    assert lengths == [len(data[i]) - 1 for i in order[:cfg["batch"]]]  # each row one token short
    # (its row: PASS, the data line saying the rows were taken as given)


def test_a_tied_weight_whose_stage_copies_part_fails_at_the_first_step_named(pipeline):
    """A 2-stage pipeline whose output projection is tied to its input embedding: each stage holds a
    copy and the loop must sum the two gradient parts into both. Reduced to the first stage only, the
    last stage's copy keeps its own part, and one step passed (the ranks line said each parameter
    "exists once"). This file's one-process gradient of the tied model is the clean copies' (both), and
    not the one-way last stage's; the verdict now fails on ranks, naming the tied pair and the step."""
    from pp_loop import build_tied_model
    from tp_loop import batch_rows

    ids = batch_rows(0, 0, RUN_PP["rows"], RUN_PP["T"])
    net = build_tied_model(seed=0)
    F.cross_entropy(net(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    want = net.tok_embeddings.weight.grad.double()
    for name in ("tied", "tied_one_way"):
        first = looprec.recorded_gradients(pipeline[name], 0)["tok_embeddings.weight"].double()
        last = looprec.recorded_gradients(pipeline[name], 1)["output.weight"].double()
        assert looprec.rel(first, want) < 1e-6
        assert (looprec.rel(last, want) < 1e-6) == (name == "tied"), (name, looprec.rel(last, want))
    # (their rows: tied passes, its copies equal bitwise; tied_one_way fails the ranks line naming the pair)


def test_a_weight_both_stages_hold_under_one_name_is_judged_copy_by_copy(pipeline):
    """The embedding reused as the output projection under its one name, tok_embeddings.weight, on both
    stages (a review's pipeline: the layout line failed it, "stages must each hold their own"). This
    file's one-process gradient (tp_llama's blocks, the head written here as F.linear on the embedding)
    is both clean copies', and only the first stage's where the sum reached stage 0 alone."""
    from tp_loop import batch_rows

    from dormouse.bench.tp_llama import build_model

    ids = batch_rows(0, 0, RUN_PP["rows"], RUN_PP["T"])
    net = build_model(seed=0)
    h = net.tok_embeddings(ids)
    for layer in net.layers.values():
        h = layer(h)
    logits = F.linear(net.norm(h), net.tok_embeddings.weight)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    want = net.tok_embeddings.weight.grad.double()
    for name in ("tied_shared", "tied_shared_one_way"):
        first, last = (looprec.recorded_gradients(pipeline[name], r)["tok_embeddings.weight"].double() for r in (0, 1))
        assert looprec.rel(first, want) < 1e-6
        assert (looprec.rel(last, want) < 1e-6) == (name == "tied_shared"), (name, looprec.rel(last, want))


def test_a_loop_that_clips_without_passing_grad_norm_is_told_to_pass_it(fleet):
    """The loop clips by 0.3 before rec.step and passes no grad_norm: the recorded gradient is the
    clipped one, read as unclipped. The per-step scalars are exactly the clip coefficients (this file's
    arithmetic: the recorded step-1 gradient is 0.3 / ||g|| times its one-process gradient g); the
    verdict named a token count ("divided by 152.984"), and now names the clip and the missing grad_norm."""
    out = fleet["clip_no_norm"]
    want = one_process(build_model(seed=3), step_rows("clip_no_norm"))
    norm = sum(float((g ** 2).sum()) for g in want.values()) ** 0.5
    assert norm > 0.3
    assert looprec.worst(looprec.recorded_gradients(out, 0), want, 0.3 / (norm + 1e-6)) < 1e-5
    v = looprec.verdict(out)  # its row: the gradient fails naming the clip and the missing grad_norm
    assert "divided each step's loss sum by" not in v.check("gradient").reason


def test_an_edited_initial_state_is_named_as_edited_not_as_ranks_seeded_apart(fleet, tmp_path):
    """A rank's init.safetensors edited after the run (one tensor x 1.5). Rank 0's: `gate check` blamed
    the ranks' seeds ("seed every rank alike"); rank 1's: nothing read it, a PASS. Each rank recorded
    its parameters before step 1 itself (hash-checked), and they are equal across the ranks (this
    file's torch.equal): the command now says the initial state was edited, in one line, exit 2, and
    the verdict's intact check names rank 1's."""
    from gatekit import copy_of, edit_tensors

    for r in (0, 1):
        out = copy_of(fleet["labels_inputs"], tmp_path / f"edited{r}")
        shutil.rmtree(out / "reference", ignore_errors=True)
        edit_tensors(out / f"rank{r}" / "init.safetensors", lambda t: t["ln1.weight"].mul_(1.5))
        rec = A.RecordingSet(out)
        assert torch.equal(rec.step_tensors(0, 1)["p/ln1.weight"], rec.step_tensors(1, 1)["p/ln1.weight"])
        r_ = gate_check(out)
        said = r_.stdout + r_.stderr
        assert r_.returncode in (1, 2), said[-3000:]
        assert f"rank {r}'s recorded initial state (init.safetensors) is not the parameters that rank recorded " \
               "before step 1" in said, said[-3000:]
        assert "seed every rank alike" not in said and "Traceback" not in said
        if r == 0:  # the rebuild refuses it, one line
            assert r_.returncode == 2 and "edited or damaged after the run" in r_.stderr, said[-3000:]
        else:  # judged: the intact check fails on it
            assert r_.returncode == 1 and "[FAIL] intact: rank 1's recorded initial state" in r_.stdout, said[-3000:]


def test_an_optimizer_step_without_any_backward_is_recorded_and_judged(fleet):
    """The loop calls opt.step() at step 2 with no forward or backward (pytorch #115607's Adam step
    counter lives in such steps): the reference refused the run ("is the Recorder on the model the loop
    calls?", exit 2). It is recorded and judged: with gradients None, AdamW leaves every parameter as it
    was (this file's torch.equal) and the verdict passes; with gradients zeroed instead (zero_grad(
    set_to_none=False)), AdamW decays every weight at that step (this file's arithmetic: the parameters
    move) and the verdict fails, naming the gradients one process does not have."""
    none, zeros = A.RecordingSet(fleet["skip_step"]), A.RecordingSet(fleet["skip_step_zeros"])
    p2, p3 = none.tensors_at(2, "p/"), none.tensors_at(3, "p/")
    assert all(torch.equal(p2[n], p3[n]) for n in p2)
    assert none.step_meta(0, 2)["micro_batches"] == 0 and none.step_meta(1, 2)["micro_batches"] == 0
    r = gate_check(fleet["skip_step"])
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    z2, z3 = zeros.tensors_at(2, "p/"), zeros.tensors_at(3, "p/")
    assert not torch.equal(z2["fc.weight"], z3["fc.weight"])  # weight decay and the moments on zeros
    # (skip_step_zeros's row: grad_mask fails at step 2)


def test_a_replica_apart_after_the_last_step_is_named_with_its_rank_and_tensor(fleet, tmp_path):
    """Rank 1's state after the last step holding another value of one tensor, with a hash of its own
    beside it (as a replica that kept a stale parameter records it): the ranks line names rank 1 and the
    tensor (a review's stale replica was reported without either). The test's own torch.equal says which
    tensor it moved."""
    from gatekit import copy_of, edit_json, edit_tensors

    out = copy_of(fleet["labels_inputs"], tmp_path / "apart")
    edit_tensors(A.final_tensors_path(out, 1), lambda t: t["p/ln1.bias"].add_(1.0))
    edit_json(A.final_meta_path(out, 1), lambda m: m.update(param_hash="0" * 64))
    mine = A.read_tensors(A.final_tensors_path(out, 0), "final")[0]
    theirs = A.read_tensors(A.final_tensors_path(out, 1), "final")[0]
    assert [n for n in mine if not torch.equal(mine[n], theirs[n])] == ["p/ln1.bias"]
    ranks = looprec.verdict(out).check("ranks")  # judged in this process (the command's own path: gate_check's tests)
    assert not ranks.passed and ranks.reason.startswith("rank 1's parameters or persistent buffers differ from rank "
                                                        "0's after the last step") and "ln1.bias" in ranks.reason, \
        ranks.reason


def test_a_clean_loop_with_dropout_is_not_judged_by_the_probe_never_blamed_on_the_loss(fleet):
    """A clean DDP loop with dropout, each rank seeding its own masks: the probe said rank 1 backpropagates
    its loss at another scale than rank 0 ("the loss is at fault"), where the two ranks' masks differ. This
    file's one-process gradient of rank 0's first micro-batch differs under two RNG states (the draws); the
    probe now says it was not judged, and why. The gradient is judged at the masks each rank drew (its row:
    PASS): this file's one-process gradient of every rank's step-1 rows, each forward from the RNG state its
    rank's started from (the Recorder keeps it), is the fleet's."""
    import drawn

    rec = A.RecordingSet(fleet["dropout"])
    assert looprec.worst(recorded(fleet["dropout"]), drawn.one_process(rec, 1, drawn.recorded_state(rec, 1))) < 1e-6
    mb = step_rows("dropout")[0]
    net = build_model(seed=3, dropout=0.1)
    torch.manual_seed(0)
    a = one_process(net, [mb])
    torch.manual_seed(1)
    assert looprec.worst(one_process(net, [mb]), a) > 1e-3
    v = looprec.verdict(fleet["dropout"])  # its row: PASS, independence and the probe not judged
    probe = v.check("probe")
    assert probe.passed and probe.reason.startswith("not judged: one process's gradient of the probed "
                                                    "micro-batch at step 1 changes with the RNG state"), probe.reason
    assert "each rank drew its own masks" in probe.reason and "loss is at fault" not in probe.reason


def _dropout_states_edited(fleet, tmp_path, edit):
    """The wild dropout loop's recording copied, each step file's tensors given to edit(tensors, micro-batches),
    referenced and judged."""
    from safetensors.torch import load_file, save_file

    from dormouse.gate.judge.entry import judge_recording
    from dormouse.gate.record.reference import make_reference

    dst = tmp_path / "edited"
    shutil.copytree(fleet["dropout"], dst, ignore=shutil.ignore_patterns("reference"))
    rec = A.RecordingSet(dst)
    for k in rec.steps:
        for r in range(rec.world_at(k)):
            t = load_file(A.step_tensors_path(dst, r, k))
            edit(t, rec.step_meta(r, k)["micro_batches"])
            save_file(t, A.step_tensors_path(dst, r, k))
    make_reference(dst, log=looprec.QUIET)
    return judge_recording(dst)


def test_dropout_masks_drawn_on_cuda_are_said_not_judged_never_a_fail(fleet, tmp_path):
    """A forward on CUDA draws its dropout masks from CUDA's generator, which the reference (on the CPU) cannot
    draw again. The dropout loop's recording with a CUDA state beside each micro-batch's CPU one (what the
    Recorder keeps for a model on CUDA) gets gradient, loss, clip and independence "not judged: dropout masks
    drawn on cuda", never a FAIL; the same recording without them is judged (its row: the gradient equals
    one process's)."""
    def on_cuda(t, micro):
        for m in range(micro):
            t[A.rng_key(m, "cuda")] = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's seed and offset

    v = _dropout_states_edited(fleet, tmp_path, on_cuda)
    assert v.passed, looprec.failing(v)
    assert v.check("gradient").reason.startswith("not judged: dropout masks drawn on cuda (")
    assert all(v.check(n).reason == "not judged: dropout masks drawn on cuda (see gradient)"
               for n in ("loss", "clip", "independence"))


def test_a_dropout_recording_without_rng_states_fails_saying_to_record_it_again(fleet, tmp_path):
    """A recording made before the Recorder kept the RNG states (the states taken out of the dropout loop's):
    the reference draws from one seed, the gradient fails (this file's arithmetic above: one seed's masks are
    not the ranks'), and independence says to record it again, in its one line."""
    def unkept(t, micro):
        for m in range(micro):
            del t[A.rng_key(m, "cpu")]

    v = _dropout_states_edited(fleet, tmp_path, unkept)
    assert not v.passed and not v.check("gradient").passed
    assert "this recording keeps no RNG states (made before the Recorder kept them): record it again" in \
        v.check("independence").reason


def test_labels_zeroed_on_one_ranks_device_copy_fail_the_data_named(fleet):
    """Rank 1 moves each micro-batch to its device (a copy) and zeroes the copy's labels before the forward:
    it trains every position towards token 0. The gate's one process read the zeroed labels the forward got,
    and the verdict passed (a review's variant blamed independence). This file's arithmetic: rank 1's
    recorded labels are all 0 where the dataset's rows hold other tokens, and the fleet's step-1 gradient is
    the one-process gradient of the zeroed rows, not of the dataset's; the data check now names rank 1's
    labels."""
    out = fleet["zero_labels"]
    rank1 = [b for r, _, b in A.RecordingSet(out).micro_batches(1) if r == 1]
    assert all(bool((b["labels"] == 0).all()) for b in rank1)
    assert any(bool((b["input_ids"] != 0).any()) for b in rank1)
    zeroed = step_rows("zero_labels")
    clean = [{**mb, "labels": mb["input_ids"].masked_fill(mb["attention_mask"] == 0, -100)} for mb in zeroed]
    net = build_model(seed=3)
    got = recorded(out)
    assert looprec.worst(got, one_process(net, zeroed)) < 1e-6
    assert looprec.worst(got, one_process(net, clean)) > 1e-2
    # (its row: the data check fails naming rank 1 and its labels)


def test_a_sketched_adamw_run_names_the_step_whose_own_gradient_is_wrong(fleet):
    """Sketched tensors (k=64), AdamW, every rank's loss x 1.5 at step 2 alone: the verdict said the
    gradient equals one process's where the parameters agree and "the fault is in a step between", because
    it asked whether the parameters agree at the gradient's bound, which AdamW's replayed parameters pass
    only before step 2. This file trains the loop in one process (its rows, AdamW, the clip): the loop's
    own gradient norm is one process's at step 1 and 1.5 x it at step 2; the verdict now names that
    step's scalar 1.5."""
    from loopmodel import build_optimizer

    out, cfg = fleet["sketch_late"], {**RUN, **RUNS["sketch_late"]}
    net = build_model(seed=3)
    opt, sched = build_optimizer(net, seed=3, lr=cfg["lr"])
    norms = []
    for k in (1, 2):
        g = one_process(net, step_rows("sketch_late", k))
        norms.append(sum(float((t ** 2).sum()) for t in g.values()) ** 0.5)
        coef = min(1.0, cfg["max_grad_norm"] / (norms[-1] + 1e-6))
        for n, p in net.named_parameters():
            p.grad = (g[n] * coef).float()
        opt.step()
        sched.step()
    rec = A.RecordingSet(out)
    logged = [rec.step_meta(0, k)["grad_norm"] for k in (1, 2)]
    assert abs(logged[0] / norms[0] - 1) < 1e-5 and abs(logged[1] / norms[1] - 1.5) < 1e-4, (logged, norms)
    v = looprec.verdict(out)  # its row: the gradient fails, "1, 1.5 at steps 1, 2"
    assert "a step between" not in v.check("gradient").reason


def test_a_factor_on_one_tensors_gradient_alone_is_named_with_the_tensor(fleet):
    """After the all-reduce, every rank halves fc.weight's gradient alone (as a tied weight's or a router's
    gradient averaged once more than the rest): the verdict said "not by a constant factor", naming
    neither the 0.5 nor that the other tensors agree. This file's one-process gradient: the recorded
    fc.weight gradient is 0.5 x it, every other tensor is it; the verdict now names the factor and the
    tensor."""
    out = fleet["half_fc"]
    want = one_process(build_model(seed=3), step_rows("half_fc"))
    got = recorded(out)
    assert looprec.rel(got["fc.weight"], 0.5 * want["fc.weight"]) < 1e-6
    assert looprec.worst({n: t for n, t in got.items() if n != "fc.weight"},
                         {n: t for n, t in want.items() if n != "fc.weight"}) < 1e-6
    # (its row: the gradient fails naming the factor and the tensor)


def test_a_replicated_norm_clipped_on_one_tp_rank_fails_the_clip_named(pipeline):
    """DeepSpeed #1801's mechanism on 2 gloo ranks (TP 2): the loop clips every gradient by the global norm,
    but TP rank 1 keeps its replicated norms' gradients unclipped, so the replicas step apart. The layout
    line blamed a missing reduction and the clip line said [ok]. This file's one-process gradient of the
    step's rows: rank 0 recorded the norms' gradients times the clip coefficient, rank 1 recorded them
    unclipped; the clip line now fails, naming the ranks and the tensors, and the layout line sends there."""
    from tp_llama import build_model as build_tp
    from tp_loop import RUN as RUN_TP, batch_rows

    cfg = {**RUN_TP, **catalogue.runs("wild_pp")["ds1801"]}
    ids = batch_rows(cfg["seed"], 0, cfg["micro"] * cfg["rows"], cfg["T"])
    net = build_tp(seed=cfg["seed"])
    F.cross_entropy(net(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    g = {n: p.grad.double() for n, p in net.named_parameters()}
    coef = cfg["max_grad_norm"] / (sum(float((t ** 2).sum()) for t in g.values()) ** 0.5 + 1e-6)
    rec = A.RecordingSet(pipeline["ds1801"])
    first, second = (A.prefixed(A.GRAD, rec.step_tensors(r, 1)) for r in (0, 1))
    norms = [n for n in g if n.endswith("norm.weight")]
    assert len(norms) == 5 and coef < 0.1
    for n in norms:
        assert looprec.rel(first[n], coef * g[n]) < 1e-5 and looprec.rel(second[n], g[n]) < 1e-5, n
    v = looprec.verdict(pipeline["ds1801"])  # its row: the clip fails naming the ranks and the tensors
    assert "not a missing reduction (see clip)" in v.check("layout").reason


def test_a_pipeline_accumulating_over_schedule_calls_with_scale_grads_weighs_the_first_call_less(pipeline):
    """torchtitan #1733 in torch's own schedules: 2 schedule.step() calls a step, each dividing the gradients
    already accumulated by its 2 micro-batches. This file's one-process gradients of each call's rows
    (token means, g1 and g2): the recorded gradient is g1 / 4 + g2 / 2, not (g1 + g2) / 2, which
    scale_grads=False with the loss divided by micro-batches x calls records (the rows' verdicts)."""
    from tp_loop import batch_rows

    from dormouse.bench.tp_llama import build_model

    def grad(call):
        net = build_model(seed=0)
        ids = batch_rows(0, call, RUN_PP["rows"], RUN_PP["T"])
        F.cross_entropy(net(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        return {n: p.grad.double() for n, p in net.named_parameters()}

    g1, g2 = grad(0), grad(1)
    for name, want in (("pp_accum", {n: g1[n] / 4 + g2[n] / 2 for n in g1}),
                       ("pp_accum_fixed", {n: (g1[n] + g2[n]) / 2 for n in g1})):
        got = {**looprec.recorded_gradients(pipeline[name], 0), **looprec.recorded_gradients(pipeline[name], 1)}
        assert set(got) == set(want) and looprec.worst(got, want) < 1e-5, name


def test_a_replicated_gradient_changed_on_one_tp_rank_after_the_reduce_is_named_so(pipeline):
    """A review's TP loop: the plain norms' gradient parts summed over the TP group (right), then TP rank
    1 scales its copies by 1.001. The layout line said "not reduced over it" while the ranks line said
    every rank's synchronised gradient agreed. This file's one-process gradient: rank 0's recorded norms'
    gradients are it, rank 1's are 1.001 times it (the row: the layout line says so)."""
    from tp_llama import build_model as build_tp
    from tp_loop import RUN as RUN_TP, batch_rows

    cfg = {**RUN_TP, **catalogue.runs("wild_pp")["norms_x_rank1"]}
    ids = batch_rows(cfg["seed"], 0, cfg["micro"] * cfg["rows"], cfg["T"])
    net = build_tp(seed=cfg["seed"])
    F.cross_entropy(net(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    rec = A.RecordingSet(pipeline["norms_x_rank1"])
    first, second = (A.prefixed(A.GRAD, rec.step_tensors(r, 1)) for r in (0, 1))
    norms = [n for n, p in net.named_parameters() if "attention_norm" in n or "ffn_norm" in n]
    assert norms
    for n in norms:
        want = dict(net.named_parameters())[n].grad.double()
        assert looprec.rel(first[n], want) < 1e-5 and looprec.rel(second[n], 1.001 * want) < 1e-5, n
    assert "compared in the layout line" in looprec.verdict(pipeline["norms_x_rank1"]).check("ranks").reason


def test_an_objective_reads_the_runs_seed_from_build_kwargs(fleet):
    """A DPO-like objective (each target token against a frozen reference: the initial model, built with
    the run's seed): a step objective could not receive the seed (build_kwargs reached build_model only),
    so its reference was another model. build_kwargs now reach an objective that names them: this file's
    one-process gradient with the reference built at the run's seed (3) is the fleet's, one built at
    another seed (0) is not; the verdict passes (its row)."""
    from wild_loop import REF_BETA

    mbs = step_rows("ref")
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)

    def grad(ref_seed: int) -> dict:
        net, ref = build_model(seed=3), build_model(seed=ref_seed)
        for mb in mbs:
            y = mb["labels"][:, 1:]
            lp, lr = (torch.log_softmax(m(mb["input_ids"])[:, :-1], -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
                      for m in (net, ref))
            ((-F.logsigmoid(REF_BETA * (lp - lr.detach())) * (y != -100)).sum() / n).backward()
        return {k: p.grad.double() for k, p in net.named_parameters()}

    got = recorded(fleet["ref"])
    assert looprec.worst(got, grad(3)) < 1e-6 and looprec.worst(got, grad(0)) > 1e-3


def test_rec_step_after_the_optimizer_step_is_the_first_failing_line(fleet):
    """A clean loop calling rec.step after opt.step() (issue 37, d15): the parameters moved between the
    step's first forward and rec.step, and the verdict's first failing line says so (not "edited or damaged
    after the run; re-record", which re-recording reproduces); a loop calling it before is not flagged."""
    v = looprec.verdict(fleet["rec_late"])
    first = next(c for c in v.checks if not c.passed)
    assert first.name == "intact" and first.reason.startswith("rec.step ran after optimizer.step()"), first
    assert "moved_before_step" in A.RecordingSet(fleet["rec_late"]).step_meta(1, 2)
    assert "moved_before_step" not in A.RecordingSet(fleet["aux"]).step_meta(0, 1)


def test_a_forward_no_backward_reaches_is_no_micro_batch_and_one_on_one_rank_is_named(fleet):
    """A metric forward in training mode with gradients on, never backpropagated (a later review's
    false alarm: it was recorded as a micro-batch, and gradient, loss and clip failed). On every rank:
    the recorded step-1 gradient is this file's one-process gradient of the loop's rows without the
    metric forwards (its row passes, the data line counts them); on rank 0 alone, over rows it trained on:
    passes too. A loss rank 1 leaves out of its backward, beside rank 0's metric (equal counts of dropped
    forwards), fails the data line: rank 1 read rows it did not train on."""
    assert looprec.worst(recorded(fleet["metric_fwd"]), one_process(build_model(seed=3),
                                                                    step_rows("metric_fwd"))) < 1e-6
    rec = A.RecordingSet(fleet["metric_fwd_rank0"])
    assert [rec.step_meta(r, 1).get("micro_batches") for r in range(W)] == [RUN["micro"]] * W
    for name in ("detach_r1", "val_metric_detach_r1"):  # reviews' false passes: rank 0's metric hid rank 1's loss
        rec = A.RecordingSet(fleet[name])
        assert [rec.step_meta(r, 1).get("micro_batches") for r in range(W)] == [RUN["micro"], RUN["micro"] - 1]


def test_an_eval_model_returning_a_dataclass_is_recorded(fleet):
    """model.eval() and a forward returning a dataclass (DCOut.logits): the backward's hook is put on the
    dataclass's tensor, so the forwards are micro-batches (they were dropped: "recorded no micro-batch",
    exit 2); the recorded gradient is one process's (TinyLM at the same seed holds the same weights)."""
    assert looprec.worst(recorded(fleet["dc_eval"]), one_process(build_model(seed=3), step_rows("dc_eval"))) < 1e-6
    for name in ("slots_out", "posmask"):  # an output class with __slots__; the attention mask passed positionally
        assert looprec.worst(recorded(fleet[name]), one_process(build_model(seed=3), step_rows(name))) < 1e-6


def test_a_stale_gradient_at_a_step_without_backward_is_step_ones_again(fleet):
    """skip_step_stale: no zero_grad after step 1, no forward or backward at step 2: rank 0's recorded
    gradient at step 2 is its step-1 gradient, bit for bit (what the gradient line names), and the same
    loop that zeroes (skip_step_logged) holds none there."""
    g1 = looprec.recorded_gradients(fleet["skip_step_stale"], 0, 1)
    g2 = looprec.recorded_gradients(fleet["skip_step_stale"], 0, 2)
    assert g1 and set(g1) == set(g2) and all(torch.equal(g1[n], g2[n]) for n in g1)
    assert not looprec.recorded_gradients(fleet["skip_step_logged"], 0, 2)


def test_a_rank_scaling_its_gradient_and_a_nan_attribute_are_what_the_rows_say(fleet):
    """rank_grad_half: rank 1's recorded gradient is rank 0's times 0.5 (no clip: the ranks line names
    a scaled gradient, not a clip coefficient). nan_attr: both ranks started with best = NaN (equal, though
    NaN != NaN)."""
    g0 = looprec.recorded_gradients(fleet["rank_grad_half"], 0, 1)
    g1 = looprec.recorded_gradients(fleet["rank_grad_half"], 1, 1)
    assert all(torch.equal(g1[n], g0[n] * 0.5) for n in g0)
    rec = A.RecordingSet(fleet["nan_attr"])
    starts = [rec.step_meta(r, 1)["attrs_start"][""]["best"] for r in range(W)]
    assert all(x != x for x in starts)


def test_a_flag_one_rank_set_that_the_forward_never_reads_is_said_not_failed(fleet):
    """is_main = (rank == 0) on the model: the ranks line says it and passes, because the gradient the
    reference computed at rank 0's value is the fleet's, and this file's one-process gradient (TinyLM,
    which never reads the flag) is the fleet's too. Rank 1's dropout p set apart (row rank1_p) still fails."""
    assert looprec.worst(recorded(fleet["is_main"]), one_process(build_model(seed=3), step_rows("is_main"))) < 1e-6


def test_an_optimizer_over_another_instance_leaves_the_recorded_parameters_where_they_were(fleet):
    """opt_copy: the optimizer holds another instance's parameters: rank 0's recorded parameters are the
    same bit for bit before every step (what the replay line names; judging it crashed on a zero ratio)."""
    def params(step):
        t, _ = A.read_tensors(A.step_tensors_path(fleet["opt_copy"], 0, step), "step tensors")
        return {n: v for n, v in t.items() if n.startswith("p/")}

    first, last = params(1), params(RUN["steps"])
    assert first and set(first) == set(last) and all(torch.equal(first[n], last[n]) for n in first)
