"""The gate on a real Hugging Face Trainer fleet (issue 13): a tiny random-init
GPT-2 trained by `transformers.Trainer` under `torchrun --nproc_per_node=2`
(gloo, CPU, gradient accumulation 2, max_grad_norm 1.0, variable-length padded
sequences), recorded by `TrainerRecorder` and judged by the recording judge.

One launch trains every run below in turn (tests/support/hf_client.py; the
imports and the process group are paid once); each test judges its own.
Faults enter through HF's own extension points in the client (a Trainer
subclass, a Trainer attribute), never by patching."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

import casecheck
import catalogue
import hf_client
import looprec  # noqa: E402

from dormouse.gate import artifacts as A
from dormouse.gate.judge.entry import judge_recording
from dormouse.gate.judge.metrics import fit
from dormouse.gate.record.reference import make_reference

@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return looprec.launch_client("hf_client.py", catalogue.argv("hf"), tmp_path_factory.mktemp("hf"), world=2,
                                 preload=("transformers.trainer", "transformers.models.gpt2.modeling_gpt2"),
                                 **dict(TRANSFORMERS_VERBOSITY="error"))


checks = looprec.checks


@casecheck.rows("hf")
def test_the_verdict_is_the_catalogues(fleet, case):
    """Each run's verdict (tests/support/catalogue.py, the "hf" rows). A wrong gradient fails gradient and
    loss; clip, when it fails, points at the gradient; the probe, when it fails, at the loss (each rank
    backpropagating its own multiple of it), not at a module."""
    casecheck.holds(fleet / case.id, case)


# --------------------------------------------------------------------------- what the callback records


def test_callback_records_the_trainer_step(fleet):
    """Per step and rank: HF's micro-batches (GA 2), the lr its scheduler set,
    the loss it logged, its pre-clip norm and the clip coefficient it applied
    (clipping is active at some steps, so the judge's un-clipping is exercised)."""
    rec = A.RecordingSet(fleet / "clean")
    assert rec.meta["world"] == 2 and rec.steps == [1, 2, 3, 4]
    assert rec.meta["max_grad_norm"] == 1.0 and rec.meta["dataset_len"] == hf_client.EXAMPLES
    assert rec.meta["build_model"] == "hf_client:build_model"
    coefs = []
    for k in rec.steps:
        for r in range(2):
            m = rec.step_meta(r, k)
            assert m["micro_batches"] == 2 and m["clipped"] and m["loss"] is not None
            assert m["lr"] == pytest.approx(hf_client.LR * (1 - (k - 1) / hf_client.MAX_STEPS), rel=1e-12)
            assert m["clip_coef"] == pytest.approx(min(1.0, 1.0 / (m["grad_norm"] + 1e-6)), rel=1e-12)
        coefs.append(m["clip_coef"])
        # the recorded gradient is the clipped one: its norm is clip_coef times the logged pre-clip norm
        g = rec.tensors_at(k, "g/")
        norm = float(torch.sqrt(sum((t.double() ** 2).sum() for t in g.values())))
        assert norm == pytest.approx(m["clip_coef"] * m["grad_norm"], rel=1e-5)
    assert min(coefs) < 0.9 and max(coefs) == 1.0
    # the run that evaluates every 2 steps recorded its training micro-batches only
    evaluated = A.RecordingSet(fleet / "clean_s1")
    assert [evaluated.step_meta(0, k)["micro_batches"] for k in evaluated.steps] == [2, 2, 2, 2]
    logged = {r["name"]: r["logged"] for r in json.loads((fleet / "hf_client.json").read_text())}
    assert sum("eval_loss" in x for x in logged["clean_s1"]) == 2


# --------------------------------------------------------------------------- clean runs pass


@pytest.mark.parametrize("name", ["clean", "clean_s1", "clean_s2"])
def test_average_tokens_across_devices_true_passes(fleet, name):
    """HF's default (average_tokens_across_devices=True, the Trainer counting
    the shifted labels): the fleet trains what one process trains at the
    global batch, every check passing, at three data seeds (clean_s1 also
    evaluates and uses gradient checkpointing; clean_s2 holds a parameter
    its forward never uses: DDP, with accelerate's find_unused_parameters=True,
    leaves its gradient None)."""
    assert checks(looprec.verdict(fleet / name))["gradient"].worst <= 1e-5  # its row: PASS, equal to one process


def test_the_in_run_reduction_check_passes_either_token_average_and_the_gradient_tells_them_apart(fleet):
    """Recorded with selfcheck=32: the in-run checks judge the REDUCTION (the synchronised gradient against
    the mean of the ranks' local gradients, sampled before DDP's all-reduce), not the normalisation, so
    they pass average_tokens_across_devices=True and False alike; the one-process reference is what tells
    the two apart (False: each rank's own token mean, the gradient check fails)."""
    for name, right in (("clean", True), ("local", False)):
        v = looprec.verdict(fleet / name)  # their rows: the reduction passes, on 32 sampled elements per tensor
        assert checks(v)["gradient"].passed is right, (name, checks(v)["gradient"].reason)


def test_bf16_autocast_passes_within_ten_times_its_measured_floor(fleet):
    """bf16=True: accelerate wraps the model's forward in CPU bfloat16 autocast,
    entered after the model's own pre-hook; the Recorder reads it inside the
    forward, and the reference computes each micro-batch under it. The
    bounds are 10x the bfloat16 floor the reference measures (the same
    gradient through a loss scaled by 1/3)."""
    rec = A.RecordingSet(fleet / "clean_bf16")
    assert rec.autocast_dtypes() == ["bfloat16"]
    g = checks(looprec.verdict(fleet / "clean_bf16"))["gradient"]  # its row: PASS, the autocast floor named
    assert 1e-5 < g.bound and g.worst <= g.bound, g.reason


# --------------------------------------------------------------------------- HF's settings that fail


def test_gpt2_as_it_comes_overcounts_tokens(fleet):
    """transformers 5.24 with GPT2LMHeadModel as it comes: its loss_type is None,
    so the Trainer counts num_items_in_batch over the unshifted labels (one
    target per row too many) and divides the shifted loss sum by it. The
    gradient is the global token mean's scaled, at each step, by
    N / (N + rows): not a constant, but a scalar per step whose implied count
    N + rows the verdict names (the targets before the shift); the logged loss
    is low by the same factor."""
    rec = A.RecordingSet(fleet / "stock")
    for k in rec.steps:
        labels = [b["labels"] for _, _, b in rec.micro_batches(k)]
        n = sum(int(y[:, 1:].ne(-100).sum()) for y in labels)
        rows = sum(int(y[:, 0].ne(-100).sum()) for y in labels)
        m = rec.step_meta(0, k)
        g = {n_: t.double() / m["clip_coef"] for n_, t in rec.tensors_at(k, "g/").items()}
        ref, _ = A.read_tensors(A.reference_step_tensors_path(fleet / "stock", k), "reference")
        g_ref = {n_[2:]: t for n_, t in ref.items() if n_.startswith("g/")}
        c, resid = fit(g, g_ref, sorted(g_ref))
        assert c == pytest.approx(n / (n + rows), rel=1e-5) and resid < 1e-5


# --------------------------------------------------------------------------- planted faults
# (average_tokens_across_devices=False: each rank divides by its own token count and DDP averages the
# ranks, the mean of the ranks' token means, the logged loss the same; HF's pre-fix (2024) gradient
# accumulation, each micro-batch's own token mean; the loss's world-size compensation, HF's x W undoing
# DDP's average, left out or applied twice, named 1/W or W with W = 2, K = 3: their rows alone.)


def test_packed_sequences_pass_with_their_position_ids_and_the_trainers_config(fleet, tmp_path):
    """DataCollatorWithFlattening: each micro-batch one row of packed
    sequences, position_ids restarting at each. The callback records
    position_ids unasked (a forward keyword with the batch's rows) and the
    model's config as the Trainer set it (use_cache = False, under which GPT-2
    keeps the packed sequences apart); the reference rebuilds both, and the
    fleet passes. Without them the reference attended across sequences."""
    rec = A.RecordingSet(fleet / "flat")
    assert all("position_ids" in b and b["input_ids"].shape[0] == 1 for _, _, b in rec.micro_batches(1))
    assert rec.meta["hf_config"]["use_cache"] is False
    bare = tmp_path / "flat"  # the same recording without the config: GPT-2 as build_model makes it
    shutil.copytree(fleet / "flat", bare, ignore=shutil.ignore_patterns("reference"))
    meta = json.loads(A.recording_path(bare).read_text())
    del meta["hf_config"]
    A.recording_path(bare).write_text(json.dumps(meta))
    make_reference(bare, log=lambda line: None)
    assert not checks(judge_recording(bare))["gradient"].passed


def test_an_uneven_epoch_end_filled_with_repeated_examples_fails_the_data_check(fleet):
    """18 examples at a global batch of 8: accelerate's even_batches fills the
    epoch's last batch on rank 1 with examples read at step 1, which one process
    would not read again. The callback records the Trainer's epochs, so the
    repeat is one within epoch 0 (steps 1 and 3), named as HF's doing; over two
    epochs too, where a dataset_len rule had put step 3 in a new epoch."""
    for name in ("uneven", "uneven_two"):
        rec = A.RecordingSet(fleet / name)
        assert [rec.step_meta(0, k)["epoch"] for k in rec.steps] == ([0, 0, 0] + ([1, 1, 1] if name == "uneven_two" else []))
        # (its row: the data check fails, the repeat named within epoch 0 with the two ways out)


def test_zero_gradients_for_unused_parameters_fail_the_mask(fleet):
    """A callback that gives the unused parameter a zero gradient (what DDP
    once did): AdamW's weight decay moves it where one process leaves it."""
    assert set(A.RecordingSet(fleet / "clean_s2").step_meta(0, 1)["no_grad"]) == {"extra.weight", "extra.bias"}


def test_resume_from_a_trainer_checkpoint_passes(fleet):
    """trainer.train(resume_from_checkpoint=...) after step 2: the callback
    records a second segment into the same directory; the replay of one
    uninterrupted optimizer and scheduler equals it bitwise, and the data
    check sees no example of the epoch read twice (HF skips the batches
    already trained)."""
    assert [s["start"] for s in A.RecordingSet(fleet / "resume").meta["segments"]] == [1, 3]


# --------------------------------------------------------------------------- an MoE model's load-balancing term


def moe_gradients(out) -> tuple[dict, dict, dict]:
    """This file's own one-process gradients at step 1 (the initial model) of the MoE runs, from the
    micro-batches the ranks recorded (read from their files): HF's (each forward's CE sum over the step's
    target count N, plus router_aux_loss_coef x transformers' load_balancing_loss_func over THAT forward's
    router logits, each forward's term counted once: Qwen3MoeForCausalLM.forward's loss under the Trainer's
    x W, DDP's / W, no / K), the global batch's (every row in one forward, the term over all of them), and
    the fleet's recorded (clipped) gradient."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    files = [load_file(str(A.step_tensors_path(out, r, 1))) for r in range(2)]
    batches = [{k: t[f"in/{m}/{k}"] for k in ("input_ids", "attention_mask", "labels")} for t in files
               for m in range(2)]
    model = hf_client.build_model(moe=True)
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)

    def loss(group):
        out = model(input_ids=group["input_ids"], attention_mask=group["attention_mask"], output_router_logits=True)
        ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), group["labels"][:, 1:].flatten(), ignore_index=-100,
                             reduction="sum")
        aux = load_balancing_loss_func(out.router_logits, hf_client.EXPERTS, 2, group["attention_mask"])
        return ce / n + hf_client.AUX_COEF * aux

    def grad(total):
        model.zero_grad(set_to_none=True)
        total.backward()
        return {k: p.grad.double().clone() for k, p in model.named_parameters() if p.grad is not None}

    per_forward = grad(sum(loss(b) for b in batches))
    one_forward = grad(loss({k: torch.cat([b[k] for b in batches]) for k in batches[0]}))
    fleet = {k[2:]: v.double() for k, v in files[0].items() if k.startswith("g/")}
    return per_forward, one_forward, fleet


def clipped_rel(fleet: dict, g: dict) -> float:
    """||fleet - c g|| / ||c g||, c the clip coefficient max_grad_norm 1 gives g (torch's rule)."""
    norm = float(torch.sqrt(sum((v ** 2).sum() for v in g.values())))
    c = min(1.0, 1.0 / (norm + 1e-6))
    num = sum(float(((fleet[k] - c * g[k]) ** 2).sum()) for k in g)
    return (num ** 0.5) / (c * norm)


def test_an_moe_models_per_forward_load_balancing_declared_per_forward_passes(fleet):
    """Qwen3-MoE under the Trainer, one row a micro-batch (2 ranks x GA 2): each forward adds its own
    load-balancing term, a choice declared with objective_scope='forward'. The gate passes and says how far
    one process at the global batch is; this file's own computation agrees: the fleet computed HF's
    per-forward objective, 10% or more away from the global batch's in one forward."""
    per_forward, one_forward, got = moe_gradients(fleet / "moe")
    assert clipped_rel(got, per_forward) < 1e-5
    assert clipped_rel(got, one_forward) > 0.1, clipped_rel(got, one_forward)


def test_an_moe_models_per_forward_term_undeclared_fails_as_rows_of_a_forward_interacting(fleet):
    """The same fleet with nothing declared (the global batch's semantics): the issue's false pass, one row
    a forward, where the per-example check sees nothing, now fails on the step's rows in one forward."""
    # (its row: independence alone fails: the micro-batches' sum is what the fleet computed)
    per_forward, one_forward, got = moe_gradients(fleet / "moe_undeclared")
    assert clipped_rel(got, per_forward) < 1e-5 and clipped_rel(got, one_forward) > 0.1


def test_an_moe_fleet_judged_against_a_declared_global_batch_fails_naming_each_forwards_statistics(fleet):
    """The user declares the global batch's objective (objective_scope='step', every row in one forward);
    the Trainer computes each forward's own: the gradient line fails and names what the fleet computed."""
    per_forward, one_forward, got = moe_gradients(fleet / "moe_global")
    assert clipped_rel(got, per_forward) < 1e-5 and clipped_rel(got, one_forward) > 0.1


# --------------------------------------------------------------------------- bad input, one line


def test_bad_callback_input_is_one_line(tmp_path, capsys):
    from transformers import TrainingArguments

    from dormouse.errors import DormouseError
    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.hf import TrainerRecorder

    ok = {"build_model": "hf_client:build_model", "build_optimizer": "hf_client:build_optimizer"}
    for bad, match in (({"build_model": "hf_client.build_model"}, "is not an import path"),
                       ({"build_optimizer": "__main__:build_optimizer"}, "names the script being run"),
                       ({"objective": "mse"}, "objective 'mse' is none of"),
                       ({"every": 0}, "every a whole number >= 1")):
        with pytest.raises(DormouseError, match=match) as e:
            TrainerRecorder(tmp_path, RecordingSpec(**{**ok, **bad}))
        assert "\n" not in str(e.value)
    cb = TrainerRecorder(tmp_path, RecordingSpec(**ok))
    args = TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to="none")
    with pytest.raises(DormouseError, match="before on_train_begin"):
        cb.on_pre_optimizer_step(args, None, None, optimizer=None)
    smooth = TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to="none", label_smoothing_factor=0.1)
    with pytest.raises(DormouseError, match="the recording holds no labels") as e:  # the Trainer pops them
        cb.on_train_begin(smooth, None, None, model=hf_client.build_model())
    assert "\n" not in str(e.value)
    args.fsdp = True  # set after construction: TrainingArguments(fsdp=...) would switch accelerate's env to FSDP
    with pytest.raises(DormouseError, match="does not record the Trainer's FSDP"):
        cb.on_train_begin(args, None, None, model=hf_client.build_model())
    # the client script, as a researcher's script should: the one line, exit 2, before any training
    assert hf_client.main(["--out", str(tmp_path / "c"), "bad:build=main"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: build_model '__main__:build_model' names the script being run")
    assert not (tmp_path / "c" / "bad" / "recording.json").exists()


def test_callback_without_transformers_is_one_line():
    """Without the [hf] extra, importing the callback says what to install."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from dormouse.errors import DormouseError\n"
            "try:\n    import dormouse.gate.record.hf\nexcept DormouseError as e:\n    print(e); sys.exit(2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pip install 'dormouse[hf]'" in done.stdout, done.stdout + done.stderr


def test_neftune_is_refused_in_one_line_before_the_first_step(tmp_path):
    """The Trainer's NEFTune hook (random noise on the input embeddings, each rank its own draw) cannot
    be reproduced by one process: a real one-process Trainer with neftune_noise_alpha stops at its start."""
    from transformers import Trainer, TrainingArguments

    from dormouse.errors import DormouseError
    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.hf import TrainerRecorder

    model = hf_client.build_model()
    args = TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to="none", max_steps=1,
                             per_device_train_batch_size=2, neftune_noise_alpha=5.0, save_strategy="no")
    cb = TrainerRecorder(tmp_path / "rec", RecordingSpec(build_model="hf_client:build_model",
                                                         build_optimizer="hf_client:build_optimizer"))
    trainer = Trainer(model=model, args=args, train_dataset=hf_client.PaddedSequences(0, n=4),
                      optimizers=hf_client.build_optimizer(model), callbacks=[cb])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(DormouseError, match="NEFTune") as e:
        trainer.train()
    assert "\n" not in str(e.value) and "hooked on" in str(e.value), str(e.value)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # no step was taken
