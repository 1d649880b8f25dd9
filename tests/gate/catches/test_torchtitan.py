"""The gate on torchtitan itself (issue 28): tests/support/titan_loop.py builds
torchtitan's llama3 model (its debugmodel's builder, shrunk), parallelises it
with torchtitan's own parallelize_llama (tensor parallel with SequenceParallel
and the vocabulary-parallel loss, FSDP2 on its fsdp mesh) over torchtitan's
ParallelDims meshes, and trains it with torchtitan's CrossEntropyLoss in a
plain AdamW loop, recorded by the Recorder: one real torchrun launch of 2
gloo ranks (TP 2) and one of 4 (dp 2 x tp 2). A clean run passes at float32 resolution; the token count
summed over the world mesh (TP peers included) where torchtitan sums it over
its batch mesh fails, named by the TP size; on 4 ranks (dp 2 x tp 2) a clean
run passes and a loss divided by each rank's own token count fails, named by
the DP size. Both are confirmed against the
unparallelised model's own autograd on the global batch, read straight from
the recorded files. torchtitan's own order (initialise after parallelising)
is refused in one line, naming the equal shards each TP rank drew. Skipped where torchtitan (and triton, which its llama3
model imports) is not installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import casecheck
import catalogue
import looprec
from looprec import worst
from looprec import recorded_gradients as recorded

from dormouse.gate import artifacts as A

MISSING = [m for m in ("torchtitan", "triton") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"{' and '.join(MISSING)} not installed (torchtitan 0.3.0 imports triton with its "
                          "llama3 model); see docs/parallelisms.md, 'torchtitan proper'")

titan = looprec.launched_fixture("titan", catalogue.runs("titan"), "titan_loop.py", 2)
titan_2d = looprec.launched_fixture("titan_2d", catalogue.runs("titan_2d"), "titan_loop.py", 4)


@casecheck.rows("titan", "titan_2d")
def test_the_verdict_is_the_catalogues(request, case):
    """torchtitan's clean runs pass, each fault fails or is refused named (tests/support/catalogue.py): on
    2 ranks (titan) and 4 (titan_2d)."""
    casecheck.holds(request.getfixturevalue(case.fleet)[case.id], case)


def plain_gradient(out: Path, micro: int) -> dict[str, torch.Tensor]:
    """The unparallelised torchtitan model's gradient of the global token mean at step 1, from
    titan_loop.build_model and the rows titan_loop reads (its own rule, not the recording's inputs)."""
    import torch.nn.functional as F
    from titan_loop import RUN, build_model, batch_rows

    rec = A.RecordingSet(out)
    seed, replicas = rec.meta["build_kwargs"]["seed"], len(rec.meta["layout"]["groups"])
    ids = batch_rows(seed, 0, replicas * micro * RUN["rows"], RUN["T"])
    model = build_model(seed=seed)
    z = model(ids)
    F.cross_entropy(z[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def passes_at_float32_resolution(out: Path, ranks: int) -> None:
    """The verdict (PASS, its layout read from torchtitan's meshes: the row's) has its gradient under 5e-6,
    and every rank's recorded gradient is the plain model's on the whole batch."""
    assert looprec.verdict(out).check("gradient").worst < 5e-6, looprec.verdict(out).check("gradient").reason
    want = plain_gradient(out, micro=2)
    for rank in range(ranks):
        assert worst(recorded(out, rank), want) < 5e-6


def is_plain_times(out: Path, micro: int, factor: float) -> None:
    """Rank 0's gradient is `factor` times the plain model's (the row: layout, gradient and loss fail, replay
    passes: the optimizer applied what the loop computed)."""
    assert worst(recorded(out, 0), plain_gradient(out, micro=micro), factor=factor) < 5e-6


def test_torchtitans_own_tensor_parallel_llama_passes_at_float32_resolution(titan):
    passes_at_float32_resolution(titan["clean"], ranks=2)


def test_torchtitans_token_count_summed_over_the_tp_peers_too_fails_named_by_the_tp_size(titan):
    is_plain_times(titan["world_tokens"], micro=3, factor=0.5)


def test_torchtitans_init_after_parallelising_is_refused_naming_the_shards_each_tp_rank_drew_alike(titan):
    from titan_loop import build_model

    out = titan["init_after"]  # its row: refused, naming the shards drawn alike
    init, _ = A.read_tensors(A.step_tensors_path(out, 0, 1), "step tensors")
    w = init["p/layers.0.attention.wo.weight"]  # RowwiseParallel: split along dim 1
    left, right = w.chunk(2, 1)
    assert torch.equal(left, right)
    assert not torch.equal(w, dict(build_model(seed=7).named_parameters())["layers.0.attention.wo.weight"].detach())


def test_torchtitans_own_2d_fsdp2_by_tp_llama_passes_at_float32_resolution(titan_2d):
    passes_at_float32_resolution(titan_2d["clean"], ranks=4)
    rec = A.RecordingSet(titan_2d["clean"])
    assert "_StridedShard" in rec.meta["layout"]["params"]["tok_embeddings.weight"]["placements"][0]


def test_a_2d_loss_divided_by_each_ranks_own_token_count_fails_named_by_the_dp_size(titan_2d):
    is_plain_times(titan_2d["local_tokens"], micro=3, factor=2.0)
