"""The Recorder's reference-free checks inside the run (`Recorder(selfcheck=k)`):
every step, at k numbers per tensor per rank, with no reference.

- The reduction, through linear sketches (artifacts/selfcheck.py says the rule
  and its bound): each rank's LOCAL gradient is sketched before the reduce,
  from every gradient autograd accumulates into a parameter (a hook on the
  tensor autograd accumulates into: the parameter under DDP, FSDP2's unsharded
  parameter), plus what the parameter's .grad held before the step's first
  accumulation; a sketch is linear, so the sum of these sketches is the sketch
  of what the reduce receives, whichever communication hook (a user's
  bf16_compress_hook, a custom reduce-scatter) the loop's DDP or FSDP2 runs.
  At rec.step the synchronised gradient is sketched too (its shard under FSDP2).
- Replicas' parameters equal (DDP): each rank's sketch of its parameters.
- The logged loss against each rank's loss sum and token count, where the
  loop passes them (rec.step(loss_sum=..., tokens=...)).

One all_gather of every rank's sketches a step; every rank then applies the
same rule to the same numbers, so every rank reaches the same decision (what
`stop_on_fail` acts on, without a collective of its own). Sketches are summed
in float64 (their own round-off far below the bound's)."""

from __future__ import annotations

import zlib

import torch

from dormouse.gate.artifacts import layout as A
from dormouse.gate.artifacts import selfcheck as rule


def _buckets(name: str, numel: int, k: int, seed: int) -> torch.Tensor:
    """Bucket-and-sign of every element of tensor `name` (flat global index), int32
    in [0, 2k): b < k bucket b with sign +1, else bucket b - k with sign -1; the
    self-check's own seeded hash, one table per tensor (4 bytes an element)."""
    g = torch.Generator().manual_seed((seed * 999_983 + zlib.crc32(name.encode()) + 17) % (2**63))
    return torch.randint(0, 2 * k, (numel,), generator=g, dtype=torch.int32)


class Watch:
    """Local-gradient sketches of one rank's parameters, step by step."""

    def __init__(self, module, *, k: int, seed: int, rank: int, world: int, placements: dict, wire: str,
                 reduction: str, dist: bool):
        self.k, self.rank, self.world, self.wire, self.reduction, self.dist = k, rank, world, wire, reduction, dist
        self.placements = placements
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.numel = {n: (int(torch.Size(placements[n]["shape"]).numel()) if n in placements else p.numel())
                      for n, p in self.named}
        self.dtype = {n: str(p.dtype).removeprefix("torch.") for n, p in self.named}
        self.table = {n: _buckets(n, self.numel[n], k, seed) for n, _ in self.named}
        self.local: dict[str, torch.Tensor] = {}
        self.hooks = []
        self.watched: set[int] = set()
        if placements:  # FSDP2: autograd accumulates into each FSDPParam's unsharded parameter (made at its
            self._fsdp = self._fsdp_params(module)  # first all-gather): hooked once it exists
            self.hooks.append(module.register_forward_hook(lambda *a: self._watch_fsdp()))
        else:
            self._fsdp = []
            for n, p in self.named:
                self._watch(n, p)

    def _fsdp_params(self, module) -> list:
        from torch.distributed.fsdp import FSDPModule

        names = {id(p): n for n, p in self.named}
        out = []
        for m in module.modules():
            if isinstance(m, FSDPModule):
                state = m._get_fsdp_state()
                for group in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
                    for fp in (group.fsdp_params if group is not None else []):
                        if id(fp.sharded_param) in names:
                            out.append((names[id(fp.sharded_param)], fp))
        return out

    def _watch_fsdp(self) -> None:
        for n, fp in self._fsdp:
            leaf = getattr(fp, "_unsharded_param", None)
            if leaf is not None and id(leaf) not in self.watched:
                self._watch(n, leaf)

    def _watch(self, name: str, leaf: torch.Tensor) -> None:
        self.watched.add(id(leaf))
        self.hooks.append(leaf.register_hook(lambda g, n=name, p=leaf: self._add(n, p, g)))

    def _sketch(self, name: str, x: torch.Tensor, lo: int = 0) -> torch.Tensor:
        x = x.detach().reshape(-1).to("cpu", torch.float64)
        z = torch.zeros(2 * self.k, dtype=torch.float64).index_add_(0, self.table[name][lo:lo + x.numel()], x)
        return z[:self.k] - z[self.k:]

    def _add(self, name: str, leaf: torch.Tensor, grad: torch.Tensor):
        if name not in self.local:  # what .grad held before the step's first accumulation (a loop that never
            held = leaf.grad            # zeroes it), which the reduce receives too
            self.local[name] = (self._sketch(name, held) if held is not None and not hasattr(held, "to_local")
                                else torch.zeros(self.k, dtype=torch.float64))
        self.local[name] += self._sketch(name, grad)
        return None

    def _shard_lo(self, name: str, piece: torch.Tensor) -> int:
        pl = self.placements.get(name)
        if not pl:
            return 0
        rows, n = pl["shape"][0], self.numel[name]
        row = n // rows if rows else 0
        per = -(-rows // self.world)
        return min(self.rank * per, rows) * row

    def _gather(self, vec: torch.Tensor) -> list[torch.Tensor]:
        if not self.dist:
            return [vec]
        import torch.distributed as dist

        dev = self.named[0][1].device if self.named and self.named[0][1].device.type != "meta" else vec.device
        vec = vec.to(dev)
        out = [torch.empty_like(vec) for _ in range(self.world)]
        dist.all_gather(out, vec)
        return [x.cpu() for x in out]

    def finish(self, module_named, *, micro: int, clip: float | None, loss: float | None,
               loss_sum: float | None, tokens: float | None, clip_unknown: bool = False) -> tuple[dict, dict]:
        """The step's sketches (this rank's, for its step file) and the findings
        every rank reaches alike from every rank's sketches (one all_gather)."""
        if self._fsdp:
            self._watch_fsdp()
        local, self.local = self.local, {}
        names = [n for n, _ in self.named]
        params = dict(module_named)
        sync, present = {}, []
        for n in names:
            g = params[n].grad
            present.append(g is not None)
            if g is not None:
                piece = g.detach().to_local() if hasattr(g, "to_local") else g.detach()
                sync[n] = self._sketch(n, piece, self._shard_lo(n, piece))
        psk = {} if self.placements else {n: self._sketch(n, params[n]) for n in names}
        k, z = self.k, torch.zeros(self.k, dtype=torch.float64)
        vec = torch.cat([*(local.get(n, z) for n in names), *(sync.get(n, z) for n in names),
                         *(psk.get(n, z) for n in names),
                         torch.tensor([float(x + 2 * (n in local)) for x, n in zip(present, names)] + [float("nan") if loss_sum is None else loss_sum,
                                                                     float("nan") if tokens is None else tokens,
                                                                     float("nan") if loss is None else loss,
                                                                     float("nan") if clip is None else clip],
                                      dtype=torch.float64)])
        rows = self._gather(vec)
        P = len(names)

        def part(r, i):
            return {n: rows[r][(i * P + j) * k:(i * P + j + 1) * k] for j, n in enumerate(names)}

        present_r = [[int(x) & 1 for x in rows[r][3 * P * k:3 * P * k + P]] for r in range(self.world)]
        local_names = [{n for j, n in enumerate(names) if int(rows[r][3 * P * k + j]) & 2} for r in range(self.world)]
        loc = [{n: v for n, v in part(r, 0).items() if n in local_names[r]} for r in range(self.world)]
        syn = [{n: v for (n, v), h in zip(part(r, 1).items(), present_r[r]) if h} for r in range(self.world)]
        par = [] if self.placements else [part(r, 2) for r in range(self.world)]
        implied = (rule.implied_clip(loc, syn, names, self.reduction, bool(self.placements))
                   if clip is None and clip_unknown else None)
        extras = [rows[r][3 * P * k + P:] for r in range(self.world)]
        num = lambda x: float(x) if x == x else None  # noqa: E731  (NaN: not passed)
        losses = [(num(e[2]), num(e[0]), num(e[1])) for e in extras]
        clips = [implied if implied is not None else num(e[3]) for e in extras]
        findings = rule.step_findings(loc, syn, par, names=names, numel=self.numel, dtype=self.dtype, k=k,
                                      micro=micro, clips=clips, wire=self.wire,
                                      reduction=self.reduction, sharded=bool(self.placements), losses=losses)
        tensors = {**{A.LOCAL_SKETCH + n: v for n, v in local.items()},
                   **{A.SYNC_SKETCH + n: v for n, v in sync.items()}, **{A.PARAM_SKETCH + n: v for n, v in psk.items()}}
        meta = {"k": k, "reduction": self.reduction, "wire": self.wire, "loss_sum": loss_sum, "tokens": tokens,
                "clip_implied": implied, "findings": findings}
        return tensors, meta

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
