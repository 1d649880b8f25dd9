"""One rank of a 3-rank fleet that exercises FleetSync's exact reduce directly
(run under torchrun by tests/train/test_exact.py): ranks hold 2, 1 and 2 slices of
one window (N = 5 global slices), three one-matrix buckets, and a parameter
that only some slices reach (b: rank 0's second slice and rank 2's first).
Checks that the reduced gradient, loss and loads are bitwise the fixed tree
over the 5 slices' own values in global order, every bucket going out in the
same order on every rank."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dormouse.train.data import FleetPlan
from dormouse.train.distributed import FleetSync
from dormouse.train.exact import tree_sum

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.ModuleDict({n: torch.nn.Linear(8, 8, bias=False) for n in ("a", "b", "c")})
plan = FleetPlan.make("2,1,2", world=world, batch=1, seq_len=4, micro_batch=1)
sync = FleetSync(plan, rank, reduce="exact", sharded=False, bucket_mb=1e-6)
sync.attach(model)  # one parameter per bucket, reversed: [c], [b], [a]
first = [0, 2, 3][rank]
assert plan.first_slice(rank) == first and plan.counts == (2, 1, 2)
reaches_b = {1, 3}  # global slices whose tokens reach b

mine = []  # (global index, {name: grad}, loss part, loads)
for j in range(sync.n_local):
    g = first + j
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(100 + g)) * (1 + 1e-3 * g)
    h = model["c"](model["a"](x))
    if g in reaches_b:
        h = model["b"](h)
    h.square().mean().backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    part, loads = torch.tensor(0.1 * (g + 1), dtype=torch.float64), torch.full((1, 2), float(g) / 3)
    mine.append((g, grads, part, loads))
    launched_in_last_backward = len(sync._launched)
    sync.slice_done(model, g, part, loads)
loss, loads = sync.reduce(model, torch.zeros((), dtype=torch.float64), torch.zeros(1, 2))

everyone: list = [None] * world
dist.all_gather_object(everyone, mine)
slices = sorted((s for r in everyone for s in r), key=lambda s: s[0])
exact = all(torch.equal(p.grad, tree_sum(torch.stack([s[1][n] for s in slices])))
            for n, p in model.named_parameters())
exact &= loss == float(tree_sum(torch.stack([s[2] for s in slices])))
exact &= torch.equal(loads, tree_sum(torch.stack([s[3].double() for s in slices])).float())
sync.detach()
dist.barrier()
dist.destroy_process_group()
json.dump({"rank": rank, "slices": [s[0] for s in slices], "launched_in_last_backward": launched_in_last_backward,
           "exact": bool(exact)}, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
