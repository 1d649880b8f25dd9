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

import looprec
from looprec import failing, worst
from looprec import recorded_gradients as recorded

from dormouse.gate import artifacts as A

MISSING = [m for m in ("torchtitan", "triton") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"{' and '.join(MISSING)} not installed (torchtitan 0.3.0 imports triton with its "
                          "llama3 model); see docs/parallelisms.md, 'torchtitan proper'")

RUNS = {
    "clean": {"seed": 0},
    # K = 3 micro-batches, so that the factor 1/2 is the TP size's alone
    "world_tokens": {"fault": "world_tokens", "seed": 5, "micro": 3},
    # torchtitan's trainer's order: built on meta, parallelised, then init_states() on each rank's shards
    "init_after": {"fault": "init_after", "seed": 7, "steps": 1},
}
DP_TP_RUNS = {  # 4 ranks: dp 2 x tp 2, FSDP2 on torchtitan's fsdp mesh
    "clean": {"seed": 0},
    "local_tokens": {"fault": "local_tokens", "seed": 1, "micro": 3},  # K = 3: the factor 2 is not K's
}


titan = looprec.launched_fixture("titan", RUNS, "titan_loop.py", 2)
titan_2d = looprec.launched_fixture("titan_2d", DP_TP_RUNS, "titan_loop.py", 4)


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


def passes_at_float32_resolution(out: Path, mesh: str, replicas: str, ranks: int) -> None:
    """The verdict passes with its gradient under 5e-6, its layout read from torchtitan's meshes, and
    every rank's recorded gradient is the plain model's on the whole batch."""
    v = looprec.verdict(out)
    assert v.passed, failing(v)
    assert v.check("gradient").worst < 5e-6, v.check("gradient").reason
    layout = v.check("layout")
    assert mesh in layout.reason and replicas in layout.reason, layout.reason
    want = plain_gradient(out, micro=2)
    for rank in range(ranks):
        assert worst(recorded(out, rank), want) < 5e-6


def fails_named_by(out: Path, words: str, micro: int, factor: float) -> object:
    """The layout check fails with `words`, so do the gradient and loss checks; replay passes (the
    optimizer applied what the loop computed); rank 0's gradient is `factor` times the plain model's."""
    v = looprec.verdict(out)
    lay = v.check("layout")
    assert not v.passed and not lay.passed, failing(v)
    assert words in lay.reason, lay.reason
    assert not v.check("gradient").passed and not v.check("loss").passed and v.check("replay").passed
    assert worst(recorded(out, 0), plain_gradient(out, micro=micro), factor=factor) < 5e-6
    return v


def test_torchtitans_own_tensor_parallel_llama_passes_at_float32_resolution(titan):
    passes_at_float32_resolution(titan["clean"], "mesh fsdp 1 x tp 2", "12 of 17 parameters split", ranks=2)


def test_torchtitans_token_count_summed_over_the_tp_peers_too_fails_named_by_the_tp_size(titan):
    v = fails_named_by(titan["world_tokens"], "every gradient is one process's times 0.5 = 1 / the TP size 2",
                       micro=3, factor=0.5)
    g = v.check("gradient")
    assert "times 0.5 = 1 / the TP size 2 (W = 1 data-parallel replica(s)" in g.reason, g.reason


def test_torchtitans_init_after_parallelising_is_refused_naming_the_shards_each_tp_rank_drew_alike(titan):
    from titan_loop import build_model

    from dormouse.errors import DormouseError
    from dormouse.gate.record.reference import make_reference

    out = titan["init_after"]
    init, _ = A.read_tensors(A.step_tensors_path(out, 0, 1), "step tensors")
    w = init["p/layers.0.attention.wo.weight"]  # RowwiseParallel: split along dim 1
    left, right = w.chunk(2, 1)
    assert torch.equal(left, right)
    assert not torch.equal(w, dict(build_model(seed=7).named_parameters())["layers.0.attention.wo.weight"].detach())
    with pytest.raises(DormouseError) as e:
        make_reference(out, log=looprec.QUIET)
    assert "equal copies of one shard along dim 1" in str(e.value), str(e.value)
    assert "initialise the model before parallelising it" in str(e.value), str(e.value)


def test_torchtitans_own_2d_fsdp2_by_tp_llama_passes_at_float32_resolution(titan_2d):
    passes_at_float32_resolution(titan_2d["clean"], "mesh fsdp 2 x tp 2", "2 data-parallel replica(s) of 2", ranks=4)
    rec = A.RecordingSet(titan_2d["clean"])
    assert "_StridedShard" in rec.meta["layout"]["params"]["tok_embeddings.weight"]["placements"][0]


def test_a_2d_loss_divided_by_each_ranks_own_token_count_fails_named_by_the_dp_size(titan_2d):
    fails_named_by(titan_2d["local_tokens"], "every gradient is one process's times 2 = the DP size 2",
                   micro=3, factor=2.0)
