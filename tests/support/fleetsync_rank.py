"""One rank of a tiny fleet that exercises FleetSync directly (run under
torchrun by tests/train/test_fleet.py): three one-matrix buckets, a parameter
only rank 0 uses, and a check that the reduce is the exact sum of the ranks'
own gradients, in the same collectives on every rank."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dormouse.train.data import FleetPlan
from dormouse.train.distributed import FleetSync

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.ModuleDict({n: torch.nn.Linear(8, 8, bias=False) for n in ("a", "b", "c")})
sync = FleetSync(FleetPlan.make("", world=world, batch=1, seq_len=4), rank, reduce="fp32", sharded=False, bucket_mb=1e-6)
sync.attach(model)  # one parameter per bucket, reversed: [c], [b], [a]

x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
h = model["c"](model["a"](x))
if rank == 0:  # only rank 0's tokens reach b
    h = model["b"](h)
h.square().mean().backward()
launched_in_backward = len(sync._launched)
local = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
sync.reduce(model, torch.zeros((), dtype=torch.float64), torch.zeros(1, 1))

# Only now (every bucket's collective is done) gather the local gradients.
exact = True
for n, p in model.named_parameters():
    parts = [torch.empty_like(local[n]) for _ in range(world)]
    dist.all_gather(parts, local[n])
    exact &= torch.equal(p.grad, sum(parts))
sync.detach()
dist.barrier()
dist.destroy_process_group()
json.dump({"rank": rank, "launched_in_backward": launched_in_backward, "exact_sum": bool(exact)},
          open(f"{sys.argv[1]}/rank{rank}.json", "w"))
