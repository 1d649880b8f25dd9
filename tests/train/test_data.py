"""dormouse.train.data: windows, the span rule, rank offsets, the corpus file, the fleet's plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dormouse.config import TrainConfig
from dormouse.errors import ConfigError, DataError, FleetError, PlanError
from dormouse.train.data import (
    ByteCorpus, FleetPlan, RankShape, _windows, builtin_corpus, rank_byte_offset, span_bytes, step_span_start,
)


def _random_corpus(tmp_path, n: int, seed: int = 0):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / "corpus.bin"
    path.write_bytes(data)
    return path, data


def test_windows_cut_inputs_and_targets_shifted_by_one_byte():
    raw = bytes(range(3 * (5 + 1)))  # 3 windows of 6 bytes: 0..5, 6..11, 12..17
    x, y = _windows(raw, 3, 5)
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == torch.int64
    assert x.tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10], [12, 13, 14, 15, 16]]
    assert y.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11], [13, 14, 15, 16, 17]]


def test_windows_accept_numpy_and_keep_byte_values_above_127():
    raw = np.array([200, 255, 0, 128], dtype=np.uint8)
    x, y = _windows(raw, 2, 1)
    assert x.tolist() == [[200], [0]] and y.tolist() == [[255], [128]]


def test_windows_refuse_the_wrong_number_of_bytes():
    with pytest.raises(DataError, match="12"):
        _windows(bytes(11), 2, 5)


def test_step_span_start_is_step_mod_n_times_span():
    # 35 bytes hold n = 3 whole spans of 10
    starts = [step_span_start(k, 10, 35, "sequential") for k in range(8)]
    assert starts == [0, 10, 20, 0, 10, 20, 0, 10]
    assert step_span_start(1000, 7, 7, "sequential") == 0  # one span: every step reads it


def test_step_span_start_refuses_a_corpus_shorter_than_one_span():
    with pytest.raises(DataError, match="global batch"):
        step_span_start(0, 11, 10)


def test_rank_byte_offset_follows_the_slices_of_lower_ranks():
    shapes = [RankShape(2, 3), RankShape(1, 5), RankShape(4, 1)]
    assert [rank_byte_offset(shapes, r) for r in range(3)] == [0, 8, 14]
    assert span_bytes(shapes) == 8 + 6 + 8
    assert shapes[1].tokens == 5 and shapes[1].nbytes == 6
    assert shapes[0].line() == "batch=2 seq_len=3 tokens=6"


def test_missing_corpus_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        ByteCorpus(tmp_path / "nope.bin")


def test_a_directory_is_not_a_corpus(tmp_path):
    with pytest.raises(DataError, match="not a regular file"):
        ByteCorpus(tmp_path)


def test_empty_corpus_file_is_a_data_error(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        ByteCorpus(tmp_path / "empty.bin")


def test_corpus_shorter_than_one_global_batch_is_a_data_error_naming_sizes(tmp_path):
    path, _ = _random_corpus(tmp_path, 100)
    corpus = ByteCorpus(path)
    shapes = [RankShape(2, 64)]  # needs 130 bytes
    with pytest.raises(DataError) as info:
        corpus.step_batch(0, shapes, [0])
    msg = str(info.value)
    assert "100" in msg and "130" in msg and "global batch" in msg


def test_corpus_is_memory_mapped_and_step_reads_the_file_bytes(tmp_path):
    path, data = _random_corpus(tmp_path, 1000)
    corpus = ByteCorpus(path, order="sequential")
    assert isinstance(corpus.bytes, np.memmap)
    shapes = [RankShape(3, 9)]  # span 30, n = 33
    for step in (0, 1, 32, 33, 34):
        (x, y), = corpus.step_batch(step, shapes, [0])
        start = (step % 33) * 30
        want = torch.tensor(list(data[start:start + 30])).view(3, 10)
        assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])


@pytest.mark.parametrize("split", [[2, 2], [3, 1], [1, 1, 1, 1]])
@pytest.mark.parametrize("order", ["sequential", "shuffle"])
def test_single_process_at_batch_4_reads_exactly_the_bytes_of_the_fleet_split(tmp_path, split, order):
    path, _ = _random_corpus(tmp_path, 5000)
    corpus = ByteCorpus(path, order=order, seed=3)
    T = 16
    single = [RankShape(4, T)]
    fleet = [RankShape(b, T) for b in split]
    assert span_bytes(single) == span_bytes(fleet)
    for step in range(0, 150, 7):  # wraps around the corpus (n = 73 spans)
        (xs, ys), = corpus.step_batch(step, single, [0])
        parts = corpus.step_batch(step, fleet, list(range(len(fleet))))
        # each rank may ask for its own slice alone (in its own process) and gets the same bytes
        for r in range(len(fleet)):
            (xr, yr), = ByteCorpus(path, order=order, seed=3).step_batch(step, fleet, [r])
            assert torch.equal(xr, parts[r][0]) and torch.equal(yr, parts[r][1])
        assert torch.equal(xs, torch.cat([p[0] for p in parts]))
        assert torch.equal(ys, torch.cat([p[1] for p in parts]))


def test_eval_tail_is_held_out_of_training(tmp_path):
    path, data = _random_corpus(tmp_path, 1000)
    corpus = ByteCorpus(path, eval_frac=0.1)
    assert corpus.train_bytes == 900 and corpus.eval_bytes == 100
    with pytest.raises(DataError):
        corpus.read(850, 60)  # would run into the tail
    batches = corpus.eval_batches(batch=2, seq_len=9)
    x = torch.cat([b[0] for b in batches])
    assert x.shape == (10, 9)  # 100 bytes hold 10 windows of 10
    assert x[0].tolist() == list(data[900:909])
    # a training step never reads past byte 900
    for order in ("sequential", "shuffle"):
        assert {step_span_start(k, 200, corpus.train_bytes, order) for k in range(20)} == {0, 200, 400, 600}


def test_eval_tail_shorter_than_a_window_is_a_data_error(tmp_path):
    path, _ = _random_corpus(tmp_path, 1000)
    with pytest.raises(DataError, match="eval_frac"):
        ByteCorpus(path, eval_frac=0.01).eval_batches(batch=2, seq_len=63)


def test_builtin_corpus_is_real_text_and_deterministic():
    a, b = builtin_corpus(), builtin_corpus()
    assert a == b and len(a) > 10_000
    assert b"def " in a and b"import torch" in a


def _span_order(order: str, seed: int, steps: int, n: int = 7, span: int = 10) -> list[int]:
    return [step_span_start(k, span, n * span + 3, order, seed) // span for k in range(steps)]


def test_sequential_order_reads_span_k_mod_n():
    assert _span_order("sequential", 5, 15) == [k % 7 for k in range(15)]


def test_shuffle_visits_every_span_once_per_epoch_in_a_fresh_order():
    order = _span_order("shuffle", 1, 7 * 4)
    epochs = [order[i * 7:(i + 1) * 7] for i in range(4)]
    for e in epochs:
        assert sorted(e) == list(range(7))
    assert len({tuple(e) for e in epochs}) > 1  # not the same order every epoch
    assert epochs != [list(range(7))] * 4


def test_shuffle_is_the_documented_rule_and_a_function_of_seed_epoch_and_step_only():
    n, span, seed = 7, 10, 4
    for k in range(30):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + k // n))
        assert step_span_start(k, span, n * span, "shuffle", seed) == int(perm[k % n]) * span
    # asked in any order, from fresh or cached corpora: the same answer
    assert _span_order("shuffle", seed, 30) == _span_order("shuffle", seed, 30)
    assert _span_order("shuffle", seed, 30) != _span_order("shuffle", seed + 1, 30)


def test_a_corpus_reads_the_same_bytes_whatever_steps_it_read_before(tmp_path):
    # the cached permutation must not leak: step k after a jump (a resume) is step k
    path, _ = _random_corpus(tmp_path, 2000)
    shapes = [RankShape(2, 9)]  # span 20, n = 100
    walked = ByteCorpus(path, seed=9)
    seen = {k: walked.step_batch(k, shapes, [0])[0][0] for k in range(0, 260, 3)}
    for k in (250, 3, 120, 99, 100, 0):
        (x, _), = ByteCorpus(path, seed=9).step_batch(k, shapes, [0])
        if k in seen:
            assert torch.equal(x, seen[k])
        (x2, _), = walked.step_batch(k, shapes, [0])
        assert torch.equal(x, x2)


def test_an_unknown_data_order_is_a_data_error(tmp_path):
    path, _ = _random_corpus(tmp_path, 100)
    with pytest.raises(DataError, match="'sequential', 'shuffle'"):
        ByteCorpus(path, order="random")


def _spans_by_rule(corpus: bytes, span: int, steps: int, seed: int, eval_frac: float) -> list[int]:
    """The data rule as documented (data.py, DESIGN.md), stated here on its own: the training part
    is the corpus less its last floor(len * eval_frac) bytes; it holds n = floor(train / span) whole
    spans; step k (0-based) of epoch e = k // n reads span perm_e[k mod n], perm_e =
    torch.randperm(n) from a generator seeded with seed * 1_000_003 + e."""
    n = (len(corpus) - int(len(corpus) * eval_frac)) // span
    return [int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + k // n))[k % n])
            for k in range(steps)]


def _spans_read(corpus: bytes, inputs: list[torch.Tensor], span: int, window: int) -> list[int]:
    """Which span each step's windows came from, found by their bytes alone (the corpus is random:
    every 16-byte string occurs once), with the windows checked to be consecutive in the span."""
    spans = []
    for x in inputs:
        starts = [corpus.find(bytes(row.tolist())) for row in x]
        assert all(s >= 0 and s % span == i * window for i, s in enumerate(starts)), starts
        spans.append(starts[0] // span)
    return spans


def test_the_trainer_reads_the_span_the_documented_rule_names_at_every_step_across_a_resume(tmp_path):
    """What train() feeds the model (a forward pre-hook records it) at each of 12 steps over two
    epochs and a half, stopped at step 6 and resumed from its checkpoint, is the span the rule above
    names; against the rule at another seed the same check fails (it can fail)."""
    from dormouse.config import RunConfig, TrainConfig, preset
    from dormouse.train.loop import build_model, train

    path, corpus = _random_corpus(tmp_path, 5 * 34 + 7 + 40, seed=5)  # 5 spans of 2 x (16 + 1), a tail
    seen: list[torch.Tensor] = []
    for leg in (1, 2):
        run = RunConfig(model=preset("tiny"), train=TrainConfig(
            steps=12, batch=2, seq_len=16, data=str(path), out_dir=str(tmp_path / "out"), seed=11,
            data_order="shuffle", eval_frac=0.15, eval_every=0, log_every=100, ckpt_every=6 if leg == 1 else 0,
            stop_at=6 if leg == 1 else 0, resume=leg == 2))
        model = build_model(run)
        hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
        train(model, run, log=lambda _: None)
        hook.remove()
    assert len(seen) == 12
    read = _spans_read(corpus, seen, span=34, window=17)
    assert read == _spans_by_rule(corpus, 34, 12, seed=11, eval_frac=0.15)
    assert sorted(read[:5]) == list(range(5)) and read[:5] != read[5:10]  # an epoch each, reshuffled
    assert read != _spans_by_rule(corpus, 34, 12, seed=12, eval_frac=0.15)


# --------------------------------------------------------------------------- FleetPlan


def test_a_fleet_plan_holds_the_shapes_slices_tokens_and_offsets_of_its_profile():
    plan = FleetPlan.make(" 4, 2x8 ", world=2, batch=3, seq_len=5, micro_batch=2, max_seq_len=8)
    assert plan.profile == "4,2x8" and plan.shapes == (RankShape(4, 5), RankShape(2, 8))
    assert plan.counts == (2, 1) and plan.n_slices == 3 and [plan.first_slice(r) for r in range(2)] == [0, 2]
    assert plan.slice_batch(0) == plan.slice_batch(1) == 2
    assert plan.tokens == 4 * 5 + 2 * 8 and plan.span == 4 * 6 + 2 * 9 == span_bytes(list(plan.shapes))
    assert plan.rank_byte_offset(1) == 24 and plan.mixed_lengths and plan.global_batch is None
    even = FleetPlan.make("", world=3, batch=2, seq_len=5)
    assert even.shapes == (RankShape(2, 5),) * 3 and even.counts == (1, 1, 1) and even.global_batch == 6
    assert even.slice_batch(2) == 2 and even.exact_slice() == 2  # micro_batch 0: the whole local batch
    assert even.evenly(2).profile == "3x5,3x5" and even.evenly(2).global_batch == 6


@pytest.mark.parametrize("make, field, words", [
    (dict(profile="4,x", world=2), "profile", "rank 1's entry 'x' is not a batch size"),
    (dict(profile="4,2,1", world=2), "profile", "has 3 entries but world = 2"),
    (dict(profile="0,2", world=2), "profile", "rank 0's entry '0' must be positive"),
    (dict(profile="4x65,2", world=2), "profile", "exceeds the model's max_seq_len 64"),
    (dict(profile="4,2", world=2, micro_batch=3), "micro_batch", "does not divide every rank's batch (4, 2)"),
    (dict(profile="", world=1, micro_batch=3), "micro_batch", "does not divide every rank's batch (4)"),
    (dict(profile="", world=0), "world", "at least one rank"),
])
def test_a_malformed_plan_is_one_error_naming_its_field(make, field, words):
    with pytest.raises(PlanError) as info:
        FleetPlan.make(make.pop("profile"), batch=4, seq_len=8, max_seq_len=64, **make)
    e = info.value
    assert e.field == field and words in e.reason and str(e).startswith(f"{field} = ")
    assert isinstance(e, ConfigError) and isinstance(e, FleetError)  # caught as either, as before


def test_an_uneven_profile_has_no_one_exact_slice_and_no_even_split_of_another_size():
    plan = FleetPlan.make("4,2", world=2, batch=1, seq_len=8)
    with pytest.raises(PlanError, match="needs micro_batch > 0"):
        plan.exact_slice()
    with pytest.raises(PlanError, match="does not split evenly"):
        plan.evenly(4)
    assert FleetPlan.make("4,2", world=2, batch=1, seq_len=8, micro_batch=1).exact_slice() == 1


def test_parse_capacity_is_the_plans_shapes():
    from dormouse.train.distributed import parse_capacity

    cfg = TrainConfig(batch=2, seq_len=8)
    assert parse_capacity("", world_size=2, cfg=cfg, max_seq_len=8) == [RankShape(2, 8)] * 2
    assert parse_capacity("3x4,1", world_size=2, cfg=cfg, max_seq_len=8) == [RankShape(3, 4), RankShape(1, 8)]
