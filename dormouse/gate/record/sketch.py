"""The Recorder's CountSketch: seeded bucket/sign hashes per tensor element
and a sketch of k numbers per tensor (S x), the same bits in the Recorder and
the reference, whichever tensors share a call (record/recorder.py)."""

from __future__ import annotations

import zlib

import torch

SKETCH_CHUNK = 1 << 14  # elements summed in float32 before the float64 total (round-off ~1e-7 relative)


def sketch_buckets(name: str, numel: int, k: int, seed: int, lo: int = 0, n: int | None = None) -> torch.Tensor:
    """Bucket-and-sign of elements lo..lo+n of tensor `name` (flat global
    index, numel elements in all): b in [0, 2k), b < k bucket b with sign +1,
    b >= k bucket b-k with sign -1; returned offset by 2k per chunk of
    SKETCH_CHUNK elements (int32), the layout `sketch` sums."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    b = torch.randint(0, 2 * k, (numel,), generator=g)
    n = numel - lo if n is None else n
    b = b[lo:lo + n]
    return (b + 2 * k * (torch.arange(n) // SKETCH_CHUNK)).to(torch.int32)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's buckets are summed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(numel: int) -> int:
    return max(-(-numel // SKETCH_CHUNK), 1)


def sketch(x: torch.Tensor, buckets: torch.Tensor, k: int) -> torch.Tensor:
    """The CountSketch S x (float64, k numbers) of a flat piece of a tensor
    whose elements' buckets are `buckets` (from sketch_buckets): each chunk's
    buckets summed in float32 (float64 for a float64 x) in element order,
    then the chunks in float64 in chunk order. One tensor through Sketcher."""
    one = Sketcher(k)
    one.buckets["x"] = buckets
    return one({"x": x})["x"]


class Sketcher:
    """CountSketches of many tensors at once (the Recorder's and the
    reference's per-step sketches; `sketch` is one tensor through it).
    `buckets[name]` are the tensor's (or piece's) buckets from sketch_buckets.
    The tensors summed in the same dtype share one buffer, each chunk of each
    tensor with its own 2k buckets: one index_add_ per tensor sums its chunks'
    buckets (float32, or float64 for float64 tensors; each bucket's elements in
    element order), then one index_add_ sums each tensor's chunks (float64, in
    chunk order) for all of them: per tensor the same additions in the same
    order whichever tensors share the call, so the same numbers, in about two
    operations per tensor instead of a dozen, and no copy of the tensors
    first (index_add_ reads them where they are, before the optimizer steps;
    from another device, through one copy to the CPU each). The sketch itself,
    S x with (S x)_j = sum_{h(i)=j} s(i) x_i, is the module docstring's."""

    def __init__(self, k: int):
        self.k = k
        self.buckets: dict[str, torch.Tensor] = {}
        self._layouts: dict[tuple, tuple[list[int], torch.Tensor, int]] = {}

    def _layout(self, names: tuple[str, ...]) -> tuple[list[int], torch.Tensor, int]:
        """Each tensor's offset in the shared buffer, each chunk's tensor, the buffer's size."""
        if names not in self._layouts:
            offsets, owner, off = [], [], 0
            for j, n in enumerate(names):
                chunks = _chunks(self.buckets[n].numel())
                offsets.append(off)
                owner += [j] * chunks
                off += chunks * 2 * self.k
            self._layouts[names] = (offsets, torch.tensor(owner, dtype=torch.int64), off)
        return self._layouts[names]

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        k, groups, out = self.k, {}, {}
        for n, t in tensors.items():
            groups.setdefault(_acc(t.dtype), []).append(n)
        for acc, names in groups.items():
            offsets, owner, size = self._layout(tuple(names))
            z = torch.zeros(size, dtype=acc)
            for n, off in zip(names, offsets):
                b, x = self.buckets[n], tensors[n].detach().reshape(-1).to("cpu", acc)
                z[off:off + _chunks(b.numel()) * 2 * k].index_add_(0, b, x)
            s = torch.zeros(len(names), 2 * k, dtype=torch.float64)
            s.index_add_(0, owner, z.view(-1, 2 * k).double())
            s = s[:, :k] - s[:, k:]
            out.update({n: s[j].clone() for j, n in enumerate(names)})  # each its own storage (safetensors)
        return {n: out[n] for n in tensors}
