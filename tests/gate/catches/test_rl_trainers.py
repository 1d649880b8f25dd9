"""TRL's GRPOTrainer gated (tests/support/grpo_client.py): a tiny random-init Llama, generation
included (completions of 1..6 tokens sampled by the policy), 2 gloo ranks, gradient accumulation 2,
2 completions a micro-batch, max_grad_norm 1.0, one launch for every run. The advantages each
micro-batch's loss reads are recorded beside it (`rec.beside`), and each loss type's normalisation
is declared as trl 1.16's `GRPOTrainer._compute_loss` defines it. Every verdict is confirmed at
step 1 by the test's own computation in plain PyTorch from the recorded micro-batches (the
log-probabilities through cross_entropy, the on-policy surrogate -A exp(logp - sg(logp)), and the
normalisation written here), sharing no loss code with the client or the gate."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("trl") is None:
    pytest.skip("needs trl (pip install 'dormouse[dev]')", allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import casecheck  # noqa: E402
import catalogue  # noqa: E402
import grpo_client  # noqa: E402
import looprec  # noqa: E402

from dormouse.gate import artifacts as A  # noqa: E402

W, K = 2, 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return looprec.launch_client("grpo_client.py", catalogue.argv("grpo"), tmp_path_factory.mktemp("grpo"), world=W,
                                 preload=("transformers.trainer", "transformers.models.llama.modeling_llama",
                                          "trl.trainer.grpo_trainer"),
                                 **dict(PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error"))


checks = looprec.checks


@casecheck.rows("grpo")
def test_the_verdict_is_the_catalogues(fleet, case):
    """grpo (each completion's token mean, averaged over the completions), TRL's default dapo (the global
    token mean), bnpo (normalised over each local batch by design) and dapo with its loss halved (the x 0.5
    class of TRL PR #6024): each run's verdict (tests/support/catalogue.py, the "grpo" rows)."""
    casecheck.holds(fleet / case.id, case)


def by_hand(fleet, name: str, norm: str) -> tuple[dict, dict]:
    """(the fleet's gradient at step 1 over its clip coefficient, the test's own). norm: "token" (every
    completion token of the step weighted alike), "sequence" (each completion's token mean, then the
    mean over completions), "micro" (each micro-batch's token mean, then the mean over micro-batches)."""
    rec = A.RecordingSet(fleet / name)
    g = {n: t.double() / rec.step_meta(0, 1)["clip_coef"] for n, t in rec.tensors_at(1, "g/").items()}
    model = grpo_client.build_model(**rec.meta["build_kwargs"])
    batches = [b for _, _, b in rec.micro_batches(1)]
    assert len(batches) == W * K and all("old_logps" not in b for b in batches)  # on-policy: one generation
    terms, counts = [], []
    for b in batches:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        y = b["labels"][:, 1:]
        logp = -F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none")
        surrogate = -b["advantages"][:, None] * torch.exp(logp - logp.detach())  # on-policy: ratio 1, clip inactive
        on = y.ne(-100)
        terms.append((surrogate * on).sum(1))
        counts.append(on.sum(1))
    rows, tokens = torch.cat(terms), torch.cat(counts)
    if norm == "token":
        loss = rows.sum() / tokens.sum()
    elif norm == "sequence":
        loss = (rows / tokens).mean()
    else:
        loss = sum(t.sum() / c.sum() for t, c in zip(terms, counts)) / len(terms)
    loss.backward()
    return g, {n: p.grad.double() for n, p in model.named_parameters()}


def rel(a: dict, b: dict) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in b).sqrt() / sum((b[k] ** 2).sum() for k in b).sqrt())


@pytest.mark.parametrize("name, norm", [("grpo", "sequence"), ("dapo", "token")])
def test_grpo_and_dapo_pass_and_equal_one_process(fleet, name, norm):
    """grpo (each completion's token mean, averaged over the completions) and TRL's default dapo
    (num_items_in_batch: the global token mean), each declared as TRL defines it: every check passes
    and the recorded gradient is the test's own one-process gradient at the global batch."""
    assert checks(looprec.verdict(fleet / name))["gradient"].worst <= 1e-5  # its row: PASS
    g, mine = by_hand(fleet, name, norm)
    assert rel(g, mine) < 1e-6
    other = by_hand(fleet, name, "token" if norm == "sequence" else "sequence")[1]
    assert rel(mine, other) > 1e-2  # the completions' lengths differ: the two normalisations are different


def test_bnpo_fails_named_as_a_local_normalisation(fleet):
    """bnpo divides each micro-batch's sum by its own token count: declared as one process at the
    global batch computes it (the global token mean), it fails, named as the mean of per-micro-batch
    token means; by hand, the fleet's gradient is exactly that mean and far from the global one."""
    g, micro = by_hand(fleet, "bnpo", "micro")
    assert rel(g, micro) < 1e-6
    assert rel(g, by_hand(fleet, "bnpo", "token")[1]) > 0.1


def test_a_halved_loss_fails_named_by_its_factor(fleet):
    """dapo with its loss halved in the trainer fails the gradient, named by the factor 0.5; by hand,
    the fleet's gradient is half the global token mean's."""
    g, mine = by_hand(fleet, "half", "token")
    assert rel(g, {n: 0.5 * t for n, t in mine.items()}) < 1e-6


def test_a_clean_loss_near_zero_is_held_to_its_terms_scale(fleet):
    """grpo, 8 generations a prompt, accumulation 4: each group's advantages sum to zero, so the clean run's
    loss is near 0, and its float32 rounding is relative to its terms, not to itself: the loss check failed
    it (0.059 relative). By hand, from the recorded micro-batches: the sequence objective is below 1e-6 of
    the sum of its micro-batches' |loss sums| / rows, and the logged loss is within 1e-5 of that scale of
    it, not of itself; the verdict passes (its row)."""
    rec = A.RecordingSet(fleet / "grpo_zero")
    sums, rows = [], 0
    for _, _, b in rec.micro_batches(1):  # on-policy: exp(logp - sg(logp)) = 1, the clip inactive: -A a token
        on = b["labels"][:, 1:].ne(-100)
        assert "old_logps" not in b and bool(on.any(1).all())
        sums.append(float((-b["advantages"].double()[:, None] * on).sum(1).div(on.sum(1)).sum()))
        rows += on.shape[0]
    loss, scale = sum(sums) / rows, sum(abs(x) for x in sums) / rows
    logged = rec.step_meta(0, 1)["loss"]
    assert abs(loss) < 1e-6 * scale and scale > 0.1, (loss, scale)
    assert abs(logged - loss) <= 1e-5 * scale, (logged, loss, scale)


def test_a_bad_beside_call_is_one_line(tmp_path):
    """rec.beside refuses, in one line each: a built-in objective (which never reads it), a call before
    any forward, a tensor without the forward's rows, a name the forward's inputs already hold."""
    from dormouse.errors import DormouseError
    from dormouse.gate import Recorder, RecordingSpec

    ok = {"build_model": "grpo_client:build_model", "build_optimizer": "grpo_client:build_optimizer"}
    net = torch.nn.Linear(3, 2)
    builtin = Recorder(tmp_path / "builtin", net, RecordingSpec(**ok))
    net(torch.zeros(2, 3))
    with pytest.raises(DormouseError, match="built-in objective 'causal_lm'") as e:
        builtin.beside(advantages=torch.zeros(2))
    assert "\n" not in str(e.value)
    builtin.close()
    rec = Recorder(tmp_path / "rec", net, RecordingSpec(**ok, objective="grpo_client:token_objective"))
    with pytest.raises(DormouseError, match="no forward recorded since the last rec.step"):
        rec.beside(advantages=torch.zeros(2))
    net(torch.zeros(2, 3))
    with pytest.raises(DormouseError, match="the forward's 2 rows"):
        rec.beside(advantages=torch.zeros(3))
    with pytest.raises(DormouseError, match="taken by the forward's inputs"):
        rec.beside(arg0=torch.zeros(2))
    rec.beside(advantages=torch.zeros(2))
    rec.close()
