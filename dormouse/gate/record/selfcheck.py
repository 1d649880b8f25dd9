"""The Recorder's reference-free checks inside the run (`RecordingSpec(selfcheck=k)`):
every step, at k numbers per tensor per rank, with no reference.

- The reduction, element by element on k elements of each tensor drawn anew
  each step from one shared seed (artifacts/selfcheck.py says the rule and its
  bound): each rank's LOCAL gradient is read there before the reduce, from
  every gradient autograd accumulates into a parameter (a hook on the tensor
  autograd accumulates into: the parameter under DDP, FSDP2's unsharded
  parameter), plus what the parameter's .grad held before the step's first
  accumulation: the sum of these is what the reduce receives, whichever
  communication hook (a user's bf16_compress_hook, a custom reduce-scatter)
  the loop's DDP or FSDP2 runs, or the loop's own all-reduce. At rec.step the
  synchronised gradient is read at the same elements (under FSDP2 those in
  this rank's shard).
- Replicas' parameters equal (DDP): the same elements and a checksum of each
  whole tensor.
- The logged loss against each rank's loss sum and token count, where the
  loop passes them (rec.step(loss_sum=..., tokens=...)).

One all_gather of every rank's numbers a step; every rank then applies the
same rule to the same numbers, so every rank reaches the same decision (what
`stop_on_fail` acts on, without a collective of its own). Reading k elements
costs O(k) per tensor and accumulation: the check's cost does not grow with
the model (the checksum, one float32 sum per tensor a step, is the part that
does)."""

from __future__ import annotations

import torch

from dormouse.gate.artifacts import layout as A
from dormouse.gate.artifacts import selfcheck as rule


class Watch:
    """Local-gradient sketches of one rank's parameters, step by step."""

    def __init__(self, module, *, k: int, seed: int, rank: int, world: int, placements: dict, wire: str,
                 reduction: str, dist: bool, step: int = 1):
        self.k, self.seed, self.rank, self.world, self.wire, self.reduction, self.dist = (
            k, seed, rank, world, wire, reduction, dist)
        self.placements = placements
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.numel = {n: (int(torch.Size(placements[n]["shape"]).numel()) if n in placements else p.numel())
                      for n, p in self.named}
        self.dtype = {n: str(p.dtype).removeprefix("torch.") for n, p in self.named}
        self.step = 1
        self.index: dict[str, torch.Tensor] = {}
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.u_vec: torch.Tensor | None = None
        self.hooks = []
        self.watched: set[int] = set()
        if placements:  # FSDP2: autograd accumulates into each FSDPParam's unsharded parameter (made at its
            self._fsdp = self._fsdp_params(module)  # first all-gather): hooked once it exists
            self.hooks.append(module.register_forward_hook(lambda *a: self._watch_fsdp()))
        else:
            self._fsdp = []
            for n, p in self.named:
                self._watch(n, p)
        self.begin(step)

    def begin(self, step: int) -> None:
        """The elements step `step` reads (every rank alike)."""
        self.step = step
        self.index = rule.sample_indices([n for n, _ in self.named], self.numel, self.k, self.seed, step)

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

    def _at(self, name: str, x: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """x's (a flat piece from global element lo on) values at the step's elements, float64 (0 outside it)."""
        idx = self.index[name]
        flat = x.detach().reshape(-1)
        if idx.device != flat.device:
            idx = self.index[name] = idx.to(flat.device)
        if lo == 0 and flat.numel() == self.numel[name]:
            return flat[idx].double()
        inside = (idx >= lo) & (idx < lo + flat.numel())
        out = torch.zeros(idx.numel(), dtype=torch.float64, device=flat.device)
        out[inside] = flat[(idx[inside] - lo)].double()
        return out

    def _add(self, name: str, leaf: torch.Tensor, grad: torch.Tensor):
        """One contribution autograd is about to accumulate into `leaf`: its k elements, kept (a copy) to be
        summed in float64 at rec.step; at the step's first, what .grad held before (a loop that never zeroes
        it: the reduce receives that too)."""
        parts = self.parts.get(name)
        if parts is None:
            held = leaf.grad
            parts = self.parts[name] = ([self._at(name, held)] if held is not None and not hasattr(held, "to_local")
                                        else [])
        idx = self.index[name]
        if idx.device != grad.device:
            idx = self.index[name] = idx.to(grad.device)
        parts.append(grad.detach().reshape(-1)[idx])
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
        """The step's numbers (this rank's, for its step file) and the findings
        every rank reaches alike from every rank's numbers (one all_gather)."""
        if self._fsdp:
            self._watch_fsdp()
        parts, self.parts = self.parts, {}
        local, mag = {}, {}
        for n, xs in parts.items():  # the contributions' elements summed in float64, and their magnitudes
            x = torch.stack([v.double() for v in xs])
            local[n], mag[n] = x.sum(0), x.abs().sum(0)
        names = [n for n, _ in self.named]
        params = dict(module_named)
        sync, psk, present = {}, {}, []
        for n in names:
            g = params[n].grad
            present.append(g is not None)
            if g is not None:
                piece = g.detach().to_local() if hasattr(g, "to_local") else g.detach()
                sync[n] = self._at(n, piece, self._shard_lo(n, piece))
            if not self.placements:
                p = params[n].detach()
                psk[n] = torch.cat([self._at(n, p), p.sum().double().reshape(1)])
        sizes = [self.index[n].numel() for n in names]
        dev = self.named[0][1].device if self.named else torch.device("cpu")
        zeros = {n: torch.zeros(m, dtype=torch.float64, device=dev) for n, m in zip(names, sizes)}
        flags = [float(x + 2 * (n in local)) for x, n in zip(present, names)]
        nan = float("nan")
        tail = torch.tensor(flags + [nan if loss_sum is None else loss_sum, nan if tokens is None else tokens,
                                     nan if loss is None else loss, nan if clip is None else clip],
                            dtype=torch.float64, device=dev)
        vec = torch.cat([*(local.get(n, zeros[n]).to(dev) for n in names), *(mag.get(n, zeros[n]).to(dev) for n in names),
                         *(sync.get(n, zeros[n]).to(dev) for n in names),
                         *(psk.get(n, torch.zeros(m + 1, dtype=torch.float64, device=dev)).to(dev)
                           for n, m in zip(names, sizes)), tail])
        rows = self._gather(vec)
        P, W, S = len(names), self.world, sum(sizes)
        R = torch.stack(rows)  # (W, L): every rank's elements, tensors end to end, as rule.all_within reads them
        tails = R[:, 4 * S + P:].tolist()
        flags_r = [[int(x) for x in t[:P]] for t in tails]
        num = lambda x: float(x) if x == x else None  # noqa: E731  (NaN: not passed)
        losses = [(num(t[P + 2]), num(t[P]), num(t[P + 1])) for t in tails]
        clips = [num(t[P + 3]) for t in tails]
        sharded = bool(self.placements)
        implied = None
        if clip is None and clip_unknown:  # the one factor <= 1 over every tensor (rule.implied_clip's)
            want = R[:, :S].sum(0) / (W if self.reduction == "mean" else 1)
            got = R[:, 2 * S:3 * S].sum(0) if sharded else R[0, 2 * S:3 * S]
            den = float((want * want).sum())
            c = float((got * want).sum()) / den if den > 0 else None
            implied = c if c is not None and 0 < c <= 1 else None
            clips = [implied if implied is not None else x for x in clips]
        if self.u_vec is None or self.u_vec.numel() != S:
            self.u_vec = torch.repeat_interleave(
                torch.tensor([rule.UNIT.get(self.dtype[n], 2.0**-24) for n in names], dtype=torch.float64),
                torch.tensor(sizes))
        pblock = None if sharded else [R[r, 3 * S:4 * S + P] for r in range(W)]
        within = (all(f == flags_r[0] for f in flags_r) or sharded) and rule.all_within(
            R[:, :S], R[:, S:2 * S], R[:, 2 * S:3 * S], pblock, u=self.u_vec, micro=micro, clips=clips, wire=self.wire,
            reduction=self.reduction, sharded=sharded)
        if within:  # the usual step: no pass tensor by tensor (the loss alone is left to check)
            findings = rule.step_findings([], [], [], [], names=[], dtype=self.dtype, micro=micro, clips=clips,
                                          wire=self.wire, reduction=self.reduction, sharded=sharded, losses=losses,
                                          within=True)
        else:  # every tensor by name, to name the causes
            cuts = sizes * 3 + [m + 1 for m in sizes] + [P + 4]
            parts = [list(row.split(cuts)) for row in rows]
            present_r = [[x & 1 for x in f] for f in flags_r]
            local_r = [[x & 2 for x in f] for f in flags_r]
            loc = [{n: parts[r][j] for j, n in enumerate(names) if local_r[r][j]} for r in range(W)]
            mags = [{n: parts[r][P + j] for j, n in enumerate(names) if local_r[r][j]} for r in range(W)]
            syn = [{n: parts[r][2 * P + j] for j, n in enumerate(names) if present_r[r][j]} for r in range(W)]
            par = [] if sharded else [{n: parts[r][3 * P + j] for j, n in enumerate(names)} for r in range(W)]
            findings = rule.step_findings(loc, mags, syn, par, names=names, dtype=self.dtype, micro=micro,
                                          clips=clips, wire=self.wire, reduction=self.reduction, sharded=sharded,
                                          losses=losses, within=False)
        cpu = lambda d: {n: (v if v.device.type == "cpu" else v.detach().cpu()) for n, v in d.items()}  # noqa: E731
        tensors = {**{A.LOCAL_SKETCH + n: v for n, v in cpu(local).items()},
                   **{A.ABS_SKETCH + n: v for n, v in cpu(mag).items()},
                   **{A.SYNC_SKETCH + n: v for n, v in cpu(sync).items()},
                   **{A.PARAM_SKETCH + n: v for n, v in cpu(psk).items()}}
        meta = {"k": self.k, "seed": self.seed, "reduction": self.reduction, "wire": self.wire, "loss_sum": loss_sum,
                "tokens": tokens, "clip_implied": implied, "findings": findings}
        self.begin(self.step + 1)
        return tensors, meta

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
