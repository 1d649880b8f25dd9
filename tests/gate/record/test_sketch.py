"""The Recorder's CountSketch (record/recorder.py): Sketcher, which sketches
all of a step's tensors in a few operations, gives per tensor the very bits
of `sketch` (the reference's), whichever tensors share the call and at any
thread count; both are the documented S x, and row pieces (FSDP2 shards)
sum to the whole tensor's sketch."""

from __future__ import annotations

import torch

from dormouse.gate.record.sketch import SKETCH_CHUNK, Sketcher, sketch, sketch_buckets

K = 64


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(3 * SKETCH_CHUNK + 123, generator=g).view(-1, 1),  # four chunks
            "w": torch.randn(48, 32, generator=g), "b": torch.randn(7, generator=g),
            "d": torch.randn(5, 11, generator=g, dtype=torch.float64),
            "h": torch.randn(300, generator=g).to(torch.bfloat16)}


def sketcher(ts) -> Sketcher:
    s = Sketcher(K)
    s.buckets.update({n: sketch_buckets(n, t.numel(), K, 3) for n, t in ts.items()})
    return s


def dense(x: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """S x by the definition, in float64: bucket h(i) = b mod k, sign s(i) = +1 for b < k, -1 else."""
    b = buckets.long() - 2 * K * (torch.arange(x.numel()) // SKETCH_CHUNK)
    sign = torch.where(b < K, 1.0, -1.0).double()
    return torch.zeros(K, dtype=torch.float64).index_add_(0, b % K, sign * x.reshape(-1).double())


def test_the_sketcher_gives_sketchs_bits_per_tensor_whatever_shares_the_call_and_the_definition():
    ts = tensors()
    s = sketcher(ts)
    together = s(ts)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = sketcher(ts)(ts)
    finally:
        torch.set_num_threads(threads)
    for n, t in ts.items():
        alone = sketch(t, s.buckets[n], K)
        assert together[n].dtype == torch.float64 and together[n].shape == (K,)
        assert torch.equal(together[n], alone) and torch.equal(two[n], alone), n
        assert torch.equal(sketcher({n: t})({n: t})[n], alone), n
        want = dense(t, s.buckets[n])
        assert float((alone - want).abs().max() / want.abs().max()) < 1e-6, n  # float32 partial sums
    # the copies are their own (safetensors refuses shared storage) and the inputs untouched
    assert len({v.untyped_storage().data_ptr() for v in together.values()}) == len(ts)
    assert torch.equal(ts["w"], tensors()["w"])


def test_row_pieces_sketch_to_parts_that_sum_to_the_whole_tensors_sketch():
    x = torch.randn(2 * SKETCH_CHUNK // 64 + 5, 64)  # rows split as FSDP2's Shard(0) would
    whole = sketch(x, sketch_buckets("x", x.numel(), K, 1), K)
    rows = -(-x.shape[0] // 2)
    parts = [sketch(p, sketch_buckets("x", x.numel(), K, 1, lo * 64, p.numel()), K)
             for lo, p in ((0, x[:rows]), (rows, x[rows:]))]
    assert float(((parts[0] + parts[1]) - whole).abs().max() / whole.abs().max()) < 1e-6
