"""The HF callback on TRL's SFTTrainer and on PEFT LoRA (tests/support/trl_client.py):
a tiny random-init Llama (hidden 32, 2 layers) under torchrun (2 gloo ranks),
gradient accumulation 2, max_grad_norm 1.0, right-padded variable-length rows,
a toy tokenizer built in code, nothing downloaded. One launch trains every
run; each verdict is confirmed at step 1 by a gradient computed by hand in one
process from the recorded micro-batches (fieldkit.one_process_gradient: its
own loss code, not the gate's reference)."""

from __future__ import annotations

import importlib.util

import pytest

# found, not imported: the fleet's ranks import it, this process need not (seconds of CI)
if importlib.util.find_spec("trl") is None or importlib.util.find_spec("peft") is None:
    pytest.skip("needs trl and peft (pip install 'dormouse[dev]')", allow_module_level=True)


import casecheck  # noqa: E402
import catalogue  # noqa: E402
import fieldkit  # noqa: E402
import looprec  # noqa: E402
import trl_client  # noqa: E402

from dormouse.gate import artifacts as A  # noqa: E402

W, K = 2, 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return looprec.launch_client("trl_client.py", catalogue.argv("trl"), tmp_path_factory.mktemp("trl"), world=W,
                                 preload=("transformers.trainer", "transformers.models.llama.modeling_llama", "peft",
                                          "trl.trainer.sft_trainer"),
                                 **dict(PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error"))


checks = looprec.checks


@casecheck.rows("trl")
def test_the_verdict_is_the_catalogues(fleet, case):
    """Each run's verdict (tests/support/catalogue.py, the "trl" rows); the tests below confirm each at
    step 1 by a gradient computed by hand."""
    casecheck.holds(fleet / case.id, case)


def by_hand(fleet, name, *, weights=None):
    """(recorded gradient at step 1 over its clip coefficient, the hand-computed one, the step's micro-batches)."""
    rec = A.RecordingSet(fleet / name)
    batches = [b for _, _, b in rec.micro_batches(1)]
    m = rec.step_meta(0, 1)
    g = {n: t.double() / m["clip_coef"] for n, t in rec.tensors_at(1, "g/").items()}
    kw = rec.meta["build_kwargs"]
    ref = fieldkit.one_process_gradient(lambda: trl_client.build_model(**kw), batches,
                                        weights=weights(batches) if weights else None)
    return g, ref, batches


@pytest.mark.parametrize("name", ["sft", "sft_completion"])
def test_sft_trainer_passes_and_equals_one_process(fleet, name):
    """SFTTrainer (float32, padded; sft_completion with completion_only_loss, the
    prompt's labels -100): every check passes at float32's bound, and the
    recorded gradient at step 1 is the hand-computed global token mean's."""
    assert checks(looprec.verdict(fleet / name))["gradient"].worst <= 1e-5  # its row: PASS, the replay bitwise
    g, ref, batches = by_hand(fleet, name)
    assert len(batches) == W * K
    if name == "sft_completion":  # the prompt is masked: fewer targets than real tokens
        assert sum(fieldkit.targets(b) for b in batches) < sum(int(b["attention_mask"][:, 1:].sum()) for b in batches)
    assert fieldkit.relative(g, ref) < 1e-6


def test_sft_trainer_ignoring_num_items_in_batch_fails_named(fleet):
    """compute_loss drops num_items_in_batch (TRL's distillation trainers until
    PR #6006): each micro-batch's own token mean, which the Trainer then does
    not divide by K (it passed num_items_in_batch on): the mean of
    per-micro-batch means times K, named; by hand, weights K / (W K n_m)."""
    g, ref, _ = by_hand(fleet, "sft_no_items", weights=lambda bs: [1.0 / (W * fieldkit.targets(b)) for b in bs])
    assert fieldkit.relative(g, ref) < 1e-6
    _, global_mean, _ = by_hand(fleet, "sft_no_items")
    assert fieldkit.relative(g, global_mean) > 0.1


def test_lora_under_the_trainer_records_the_frozen_base_and_passes(fleet):
    """PEFT LoRA (r 4 on q_proj, v_proj) under the HF Trainer: build_model builds the
    same wrapped model; the frozen base is recorded as frozen and has no gradient;
    every check passes and the adapters' gradient at step 1 is the hand-computed one."""
    rec = A.RecordingSet(fleet / "lora")
    frozen = set(rec.meta["frozen"])
    assert frozen and all("lora_" not in n for n in frozen)
    g, ref, _ = by_hand(fleet, "lora")
    assert set(g) == set(ref) and all("lora_" in n for n in g) and not (set(g) & frozen)
    assert fieldkit.relative(g, ref) < 1e-6


def test_sft_trainer_with_packing_passes_though_each_rank_passes_its_own_longest_sequence(fleet):
    """SFTTrainer(packing=True): padding-free micro-batches, each with TRL's max_length_q/k (its longest
    packed sequence: data, not a branch) that differ between the ranks. The run passes, and its recorded
    gradient at step 1 is the global token mean over every packed sequence computed alone, by hand."""
    import torch.nn.functional as F

    rec = A.RecordingSet(fleet / "sft_packing")
    calls = [rec.step_meta(r, 1)["call"] for r in range(W)]
    assert any(a != b for a, b in zip(calls[0], calls[1])), calls  # the ranks' max_length_q/k differ
    m = rec.step_meta(0, 1)
    g = {n: t.double() / m["clip_coef"] for n, t in rec.tensors_at(1, "g/").items()}
    model = trl_client.build_model(**rec.meta["build_kwargs"])
    ce, n = 0.0, 0
    for _, _, b in rec.micro_batches(1):
        x, y, pos = b["input_ids"][0], b["labels"][0], b["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [len(x)]
        for a, e in zip(starts[:-1], starts[1:]):  # each packed sequence alone
            logits = model(input_ids=x[None, a:e]).logits[0]
            ce = ce + F.cross_entropy(logits[:-1], y[a + 1:e], ignore_index=-100, reduction="sum")
            n += int((y[a + 1:e] != -100).sum())
    (ce / n).backward()
    ref = {k: p.grad.double() for k, p in model.named_parameters()}
    num = sum(float((g[k] - ref[k]).pow(2).sum()) for k in ref) ** 0.5
    assert num / sum(float(ref[k].pow(2).sum()) for k in ref) ** 0.5 < 1e-6


def dpo_by_hand(fleet, name, sft):
    """(recorded gradient at step 1 over its clip coefficient, DPO's gradient by fieldkit's own pair code)."""
    rec = A.RecordingSet(fleet / name)
    batches = [b for _, _, b in rec.micro_batches(1)]
    g = {n: t.double() / rec.step_meta(0, 1)["clip_coef"] for n, t in rec.tensors_at(1, "g/").items()}
    kw = rec.meta["build_kwargs"]
    return g, fieldkit.dpo_gradient(lambda: trl_client.build_model(**kw), batches, beta=trl_client.DPO_BETA, sft=sft)


def test_dpo_trainer_declared_per_pair_passes_and_equals_one_process(fleet):
    """DPOTrainer (sigmoid, the initial model as ref_model), its objective declared per
    pair over the whole step: every check passes, and the recorded gradient at step 1
    is the mean over the step's pairs computed by hand (each micro-batch B chosen rows
    then B rejected)."""
    assert checks(looprec.verdict(fleet / "dpo"))["gradient"].worst <= 1e-5  # its row: PASS, declared per pair
    g, ref = dpo_by_hand(fleet, "dpo", None)
    assert fieldkit.relative(g, ref) < 1e-6


def test_dpo_sft_term_is_a_per_micro_batch_token_mean_and_fails(fleet):
    """loss_type ["sigmoid", "sft"]: DPOTrainer's sft term is each micro-batch's own token
    mean, so the fleet trains the mean of those, not one process's token mean over the
    global batch: the gradient fails; by hand the fleet equals the micro-batch-mean
    weighting and not the global one."""
    g, micro = dpo_by_hand(fleet, "dpo_sft", "micro")
    _, global_mean = dpo_by_hand(fleet, "dpo_sft", "global")
    assert fieldkit.relative(g, micro) < 1e-6
    assert fieldkit.relative(g, global_mean) > 1e-2


def test_padding_free_sft_passes_with_its_length_hints_differing_between_ranks(fleet):
    """padding_free=True: each micro-batch one row of concatenated examples (position_ids restarting at
    each); TRL's collator passes the longest example as int forward arguments (max_length_q/_k),
    which differ between ranks as the data does: data, not a branch one rank switches alone (a bool
    flipped on one rank still fails: test_recorder_batch_scope). Every check passes, and the fleet's
    gradient at step 1 is fieldkit's, each example computed in a forward of its own."""
    rec = A.RecordingSet(fleet / "padfree")
    hints = {tuple(c.get("max_length_q") for c in rec.step_meta(r, k)["call"]) for k in rec.steps for r in (0, 1)}
    assert len(hints) > 1 and "attention_mask" not in rec.micro_batches(1)[0][2]
    g, ref, _ = by_hand(fleet, "padfree")
    assert fieldkit.relative(g, ref) < 1e-6
