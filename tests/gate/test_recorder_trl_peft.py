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


import fieldkit  # noqa: E402
import trl_client  # noqa: E402
import looprec  # noqa: E402

from dormouse.gate import artifacts as A  # noqa: E402

RUNS = ["lora:trainer=hf:lora=1", "sft:trainer=sft", "sft_completion:trainer=sft:completion=1",
        "sft_no_items:trainer=sft:fault=no_items"]
W, K = 2, 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return looprec.launch_client("trl_client.py", RUNS, tmp_path_factory.mktemp("trl"), world=W,
                                 preload=("transformers.trainer", "transformers.models.llama.modeling_llama", "peft",
                                          "trl.trainer.sft_trainer"),
                                 **dict(PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error"))


def verdict(fleet, name):
    return looprec.verdict(fleet / name)


checks, failed = looprec.checks, looprec.failed


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
    v = verdict(fleet, name)
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    assert checks(v)["gradient"].worst <= 1e-5 and "bitwise" in checks(v)["replay"].reason
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
    v = verdict(fleet, "sft_no_items")
    assert {"gradient", "loss"} <= failed(v) <= {"gradient", "loss", "clip"}
    assert "mean of per-micro-batch token means" in checks(v)["gradient"].reason
    g, ref, _ = by_hand(fleet, "sft_no_items", weights=lambda bs: [1.0 / (W * fieldkit.targets(b)) for b in bs])
    assert fieldkit.relative(g, ref) < 1e-6
    _, global_mean, _ = by_hand(fleet, "sft_no_items")
    assert fieldkit.relative(g, global_mean) > 0.1


def test_lora_under_the_trainer_records_the_frozen_base_and_passes(fleet):
    """PEFT LoRA (r 4 on q_proj, v_proj) under the HF Trainer: build_model builds the
    same wrapped model; the frozen base is recorded as frozen and has no gradient;
    every check passes and the adapters' gradient at step 1 is the hand-computed one."""
    v = verdict(fleet, "lora")
    assert v.passed, "\n".join(f"{c.name}: {c.reason}" for c in v.checks)
    rec = A.RecordingSet(fleet / "lora")
    frozen = set(rec.meta["frozen"])
    assert frozen and all("lora_" not in n for n in frozen)
    g, ref, _ = by_hand(fleet, "lora")
    assert set(g) == set(ref) and all("lora_" in n for n in g) and not (set(g) & frozen)
    assert fieldkit.relative(g, ref) < 1e-6
