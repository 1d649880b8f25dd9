"""The gate on a real PyTorch Lightning fleet: loopmodel's tiny causal LM in a
LightningModule, `pl.Trainer(accelerator="cpu", strategy="ddp", devices=2)`
under torchrun (gloo), `accumulate_grad_batches=2`, `gradient_clip_val=1.0`,
variable-length padded sequences, recorded by
`dormouse.gate.record.lightning.LightningRecorder`.

One launch fits every run (tests/support/lightning_client.py says what each
mode's training_step does); each test judges its own. Every verdict is also
confirmed at step 1 against a one-process gradient computed by hand
(fieldkit.one_process_gradient: the step's micro-batches regenerated from the
data layout, not read from the recording, and not the gate's reference)."""

from __future__ import annotations


import importlib.util

import pytest

# found, not imported: the fleet's ranks import it, and the one test here that needs it (~5 CPU-s, which
# every pytest worker would otherwise pay while collecting)
if importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("needs pytorch_lightning (pip install 'dormouse[dev]')", allow_module_level=True)

import fieldkit  # noqa: E402
import loopmodel  # noqa: E402
import casecheck  # noqa: E402
import catalogue  # noqa: E402
import looprec  # noqa: E402

from dormouse.gate import artifacts as A  # noqa: E402

W = 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return looprec.launch_client("lightning_client.py", catalogue.argv("lightning"), tmp_path_factory.mktemp("lightning"), world=W,
                                 preload=("pytorch_lightning",), **dict(PYTHONWARNINGS="ignore"))


checks = looprec.checks


@casecheck.rows("lightning")
def test_the_verdict_is_the_catalogues(fleet, case):
    """Each run's verdict and named cause (tests/support/catalogue.py, the "lightning" rows); the probe,
    where it fails too, names the loss (the ranks backpropagate their losses at other scales)."""
    casecheck.holds(fleet / case.id, case)


def step1(seed: int, k: int) -> list[list[dict]]:
    """Every rank's micro-batches of step 1, regenerated from the data layout."""
    return [fieldkit.step_batches(seed=seed, world=W, rank=r, k=k, steps=4)[:k] for r in range(W)]


def recorded_gradient(fleet, name) -> dict:
    """Rank 0's recorded gradient at step 1, un-clipped when the loop clipped before recording."""
    rec = A.RecordingSet(fleet / name)
    m = rec.step_meta(0, 1)
    c = m["clip_coef"] if m["clipped"] else 1.0
    return {n: t.double() / c for n, t in rec.tensors_at(1, "g/").items()}


def build(seed):
    return lambda: loopmodel.build_model(seed=seed)


# --------------------------------------------------------------------------- clean runs pass


@pytest.mark.parametrize("name, seed", [("clean", 0)])  # another seed: docs/field-report.md
def test_ddp_with_accumulation_and_clipping_passes_and_equals_one_process(fleet, name, seed):
    """training_step returns S_m / N_step * K * W (Lightning divides by K, DDP
    averages over W): every check passes, and the recorded gradient at step 1
    is the one computed by hand in one process on the 8 rows of the global
    batch. The callback records before Lightning's clip (on_before_optimizer_step
    runs first); Lightning's clip acted (a pre-clip norm above 1) and the
    replay, clipping by torch's rule itself, is bitwise."""
    assert checks(looprec.verdict(fleet / name))["gradient"].worst <= 1e-5  # its row: PASS, the replay bitwise
    rec = A.RecordingSet(fleet / name)
    assert rec.meta["max_grad_norm"] == 1.0 and rec.step_meta(0, 1)["micro_batches"] == 2
    norms = [sum(float((t.double() ** 2).sum()) for t in rec.tensors_at(k, "g/").values()) ** 0.5 for k in rec.steps]
    assert max(norms) > 1.0, norms  # Lightning's clip acted at some step
    batches = [b for rank in step1(seed, 2) for b in rank]
    assert fieldkit.relative(recorded_gradient(fleet, name), fieldkit.one_process_gradient(build(seed), batches)) < 1e-6


def test_a_pre_batched_loader_without_dataset_len_passes_judged_by_the_loops_epochs(fleet):
    """The client's loader reads ready-made micro-batches (batch_size=None): len(dataset) counts
    micro-batches (k x steps per rank), not the rows they hold. Inferred as examples, a clean run read
    more rows than that "dataset" holds and failed the data check; the callback now leaves dataset_len
    unknown there, and the data check goes by the epochs the callback passes (trainer.current_epoch)."""
    items = fieldkit.step_batches(seed=0, world=W, rank=0, k=2, steps=2)
    rows = W * sum(int(b["input_ids"].shape[0]) for b in items)  # the rows the fleet read in its 2 steps
    assert rows > len(items)  # what len(loader.dataset) would have claimed as the examples
    assert A.RecordingSet(fleet / "inferred_len").meta["dataset_len"] == 0  # its row: PASS by the loop's epochs


def test_manual_optimization_clipping_after_the_reduce_passes(fleet):
    """Manual optimization: backward (DDP synchronises), clip_grad_norm_ by the
    synchronised norm, logged as grad_norm for the callback: every check passes,
    the clip check among them, and the recorded gradient over its clip
    coefficient is the one-process gradient."""
    batches = [b for rank in step1(0, 1) for b in rank]
    assert fieldkit.relative(recorded_gradient(fleet, "manual"), fieldkit.one_process_gradient(build(0), batches)) < 1e-6


# --------------------------------------------------------------------------- faults fail, named


def test_loss_normalised_per_rank_fails_as_the_mean_of_rank_means(fleet):
    """Each rank divides by its own token count (its two micro-batches' targets):
    the gradient is the mean of the ranks' token means, which the hand-computed
    gradient with weights 1 / (W N_r) reproduces and the global mean does not."""
    ranks = step1(0, 2)
    batches = [b for rank in ranks for b in rank]
    weights = [1.0 / (W * sum(fieldkit.targets(b) for b in rank)) for rank in ranks for _ in rank]
    g = recorded_gradient(fleet, "rank_mean")
    assert fieldkit.relative(g, fieldkit.one_process_gradient(build(0), batches, weights=weights)) < 1e-6
    assert fieldkit.relative(g, fieldkit.one_process_gradient(build(0), batches)) > 1e-3


def test_accumulation_with_a_per_micro_batch_mean_fails_named(fleet):
    """training_step returns its micro-batch's own token mean (Lightning's usual
    idiom), which Lightning divides by K: the mean of per-micro-batch token
    means, reproduced by hand with weights 1 / (W K n_m)."""
    batches = [b for rank in step1(0, 2) for b in rank]
    weights = [1.0 / (W * 2 * fieldkit.targets(b)) for b in batches]
    g = recorded_gradient(fleet, "micro_mean")
    assert fieldkit.relative(g, fieldkit.one_process_gradient(build(0), batches, weights=weights)) < 1e-6
    assert fieldkit.relative(g, fieldkit.one_process_gradient(build(0), batches)) > 1e-3


def test_clipping_before_the_reduce_fails_the_clip_check_named(fleet):
    """Manual optimization without DDP's sync (opt.toggle_model(sync_grad=False)),
    each rank clipping its own gradient, then an all-reduce by hand: the clip
    check names the local norms, and by hand the ranks' own norms differ from
    the global gradient's."""
    rec = A.RecordingSet(fleet / "clip_local")
    norms = [rec.step_meta(r, 1)["grad_norm"] for r in range(W)]
    ranks = step1(0, 1)
    g_global = fieldkit.one_process_gradient(build(0), [b for rank in ranks for b in rank])
    total = sum(fieldkit.targets(b) for rank in ranks for b in rank)
    for r, rank in enumerate(ranks):  # each rank's own gradient: its share of the global loss, times W
        own = fieldkit.one_process_gradient(build(0), rank, weights=[W / total] * len(rank))
        assert norms[r] == pytest.approx(sum(float((t.double() ** 2).sum()) for t in own.values()) ** 0.5, rel=1e-5)
    global_norm = sum(float((t.double() ** 2).sum()) for t in g_global.values()) ** 0.5
    assert min(abs(n - global_norm) for n in norms) > 0.05 * global_norm


# --------------------------------------------------------------------------- bad input: one line


def test_what_the_callback_cannot_judge_is_refused_in_one_line(tmp_path):
    """A manual clip's norm without its threshold, value clipping, a network
    attribute the module lacks: each one RecorderError line, before any step
    (the hook is called with a real, unfitted Trainer)."""
    import pytorch_lightning as pl

    from dormouse.gate import RecordingSpec
    from dormouse.gate.record.lightning import LightningRecorder
    from dormouse.gate.record.options import RecorderError

    paths = dict(build_model="loopmodel:build_model", build_optimizer="loopmodel:build_optimizer")
    with pytest.raises(RecorderError, match="without max_grad_norm"):
        LightningRecorder(tmp_path, RecordingSpec(**paths), grad_norm_key="grad_norm")

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = loopmodel.build_model(seed=0)

    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    value = pl.Trainer(gradient_clip_val=1.0, gradient_clip_algorithm="value", **quiet)
    with pytest.raises(RecorderError, match="gradient_clip_algorithm") as e:
        LightningRecorder(tmp_path, RecordingSpec(**paths), module="net").on_fit_start(value, Lit())
    assert "\n" not in str(e.value)
    with pytest.raises(RecorderError, match="has no network attribute 'model'"):
        LightningRecorder(tmp_path, RecordingSpec(**paths), module="model").on_fit_start(pl.Trainer(**quiet), Lit())
