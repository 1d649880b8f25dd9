"""A step's gradients as weighted sums of spilled sources (scratch files), formed tensor by tensor
when the step's file is written: the memory of a step is one model and its gradient."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dormouse.gate import artifacts as A


class Spill:
    """One step's gradients as sums of its sources, without holding them: each
    source (a micro-batch's gradient, a row's, a merged forward's) is written
    to a scratch file as the backward leaves it in p.grad (no copy in memory),
    and each output (acc[key] = sum of weight x source, in the order added, in
    float64) is formed tensor by tensor (by row ranges for a large tensor)
    when the step's file is written: the memory of a step is one model and
    its gradient, whatever the number of micro-batches and alternatives."""

    def __init__(self, model, scratch: Path):
        self.dir = Path(scratch)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: list = []
        self.terms: dict = {}

    def put(self, model) -> tuple[int, set[str]]:
        """The gradient in `model`'s p.grad as a source: (its index, the names that have one)."""
        from dormouse.gate.artifacts.tensorfile import LazyTensors, write_streamed

        held = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        path = A.scratch_source_path(self.dir, len(self.files))
        write_streamed(path, [(n, g.dtype, tuple(g.shape)) for n, g in held], ((n, g.detach()) for n, g in held),
                       durable=False)
        self.files.append(LazyTensors([path], "the reference's scratch"))
        return len(self.files) - 1, {n for n, _ in held}

    def add(self, key, src: int, w: float = 1.0) -> None:
        self.terms.setdefault(key, []).append((src, w))

    def has(self, key) -> bool:
        return bool(self.terms.get(key))

    def value(self, key, n: str, rows: tuple[int, int] | None = None):
        """sum_i w_i source_i[n] (rows a:b of it) in float64, None where no source has n."""
        acc = None
        for src, w in self.terms.get(key, []):
            f = self.files[src]
            if n in f:
                t = f[n] if rows is None else f.rows(n, *rows)
                acc = (0 if acc is None else acc) + t.double() * w
        return acc

    def same(self, src: int, model) -> bool:
        """Whether model's p.grad equals source src exactly (None where None)."""
        f = self.files[src]
        return all((n in f) == (p.grad is not None) and (p.grad is None or torch.equal(p.grad, f[n]))
                   for n, p in model.named_parameters())

    def close(self) -> None:
        import shutil

        self.files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


# a tensor above this many elements is combined (and written) key by key, by row ranges of about this size
COMBINE_ELEMENTS = 1 << 21


class StepParts:
    """A step's reference outputs, still spread over the spilled sources:
    written to a file (write) or formed in memory (tensors, for the run mode
    that trains on them). `outputs(n, rows)` is every output of tensor n."""

    def __init__(self, spill: Spill, names: list[str], shapes: dict, outputs, keys: list[str], info: dict,
                 dtypes: dict):
        self.spill, self.names, self.shapes, self.outputs, self.keys, self.info = spill, names, shapes, outputs, keys, info
        self.dtypes = dtypes  # the dtype each output key is written in

    def _ranges(self, n: str):
        shape = self.shapes[n]
        numel = math.prod(shape) if shape else 1
        if len(shape) == 0 or numel <= COMBINE_ELEMENTS or shape[0] < 2:
            yield None
            return
        step = max(1, COMBINE_ELEMENTS // max(1, numel // shape[0]))
        for a in range(0, shape[0], step):
            yield a, min(shape[0], a + step)

    def present(self) -> list[tuple[str, str]]:
        """(key, name) of every output there is, in writing order: tensor by tensor (each tensor's outputs
        formed together from its sources read once; a large one's key by key, by row ranges)."""
        return [(key, n) for n in self.names for key in self.keys if self.outputs.has(key, n)]

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in self.keys}
        for n in self.names:
            for key, v in self.outputs(n, None).items():
                out[key][n] = v
        self.spill.close()
        kept = (A.GRAD, A.alternative("micro_mean"), A.alternative("rank_mean"))  # written even when empty
        return {k: v for k, v in out.items() if v or k in kept}

    def write(self, path: Path, extra: dict[str, torch.Tensor]) -> None:
        from dormouse.gate.artifacts.tensorfile import write_streamed

        have = self.present()
        spec = [(key + n, self.dtypes.get(key, torch.float64), tuple(self.shapes[n])) for key, n in have]
        spec += [(k, v.dtype, tuple(v.shape)) for k, v in extra.items()]

        def pieces():
            formed: tuple[str, dict] | None = None
            for key, n in have:
                ranges = list(self._ranges(n))
                if ranges == [None]:  # every output of n at once
                    if formed is None or formed[0] != n:
                        formed = (n, self.outputs(n, None))
                    yield key + n, formed[1].pop(key)
                    continue
                formed = None
                for rows in ranges:
                    yield key + n, self.outputs(n, rows, only=key)[key]
            yield from extra.items()

        try:
            # renamed into place without an fsync: the reference is derived from the recording (`gate check
            # --force` makes it again), and at size the fsync of its GBs was a tenth of the check's time
            write_streamed(path, spec, pieces(), sync=False)
        finally:
            self.spill.close()
