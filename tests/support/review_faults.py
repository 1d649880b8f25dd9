"""Review faults (modeled on fleet_faults.py): planted through the loop's hooks
only, added to fleet_faults.FAULTS and run by its own main (DORMOUSE_TEST_FAULTS).

  fill_above   after the reduce, every exactly-zero gradient element gets
               2^-19 max|g| sign(p) (twice the exact-zero rule's 2^-20)
  fill_below   the same at 2^-22 (a quarter of it: a made-up value the rule allows)
  fill_below_late  fill_below from step REVIEW_FILL_AFTER+1 on (default 5): after routing flips
  swap_ranks   rank r reads rank W-1-r's windows (the global batch's bytes, in another rank order)
  opt_reset    at its first step the fleet's optimizer state is cleared (a resume that drops it)
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import fleet_faults  # noqa: E402
from dormouse.train.hooks import Hooks, install  # noqa: E402


def _fill(c, after=0):
    def filled(state):
        if state.step <= after:
            return
        with torch.no_grad():
            for p in state.model.parameters():
                if p.grad is not None:
                    g = p.grad
                    g.add_(torch.where(g == 0, c * g.abs().max() * torch.sign(p), torch.zeros_like(g)))

    install(Hooks(on_reduced=[filled]))


def fill_above() -> None:
    _fill(2.0 ** -19)


def fill_below() -> None:
    _fill(2.0 ** -22)


def fill_below_late() -> None:
    _fill(2.0 ** -22, after=int(os.environ.get("REVIEW_FILL_AFTER", "4")))


def swap_ranks() -> None:
    import torch.distributed as dist

    def swapped(batch):
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return
        w, r = dist.get_world_size(), dist.get_rank()
        mine = [torch.stack([x, y]) for x, y in batch.batches]
        # exchange with the mirror rank (equal shapes: profile B,B)
        other = [torch.empty_like(t) for t in mine]
        peer = w - 1 - r
        if peer == r:
            return
        for t, o in zip(mine, other):
            reqs = [dist.isend(t.contiguous(), peer), dist.irecv(o, peer)]
            for q in reqs:
                q.wait()
        batch.batches = [(o[0], o[1]) for o in other]

    install(Hooks(on_batch=[swapped]))


fleet_faults.FAULTS.update({f.__name__: f for f in (fill_above, fill_below, fill_below_late, swap_ranks)})

if __name__ == "__main__":
    sys.argv[0] = fleet_faults.__file__
    import json
    if "DORMOUSE_TEST_FAULTS" in os.environ:
        fleet_faults.per_run(json.loads(os.environ["DORMOUSE_TEST_FAULTS"]))
    else:
        fleet_faults.FAULTS[os.environ["DORMOUSE_TEST_FAULT"]]()
    from dormouse.gate.__main__ import main
    if "," in sys.argv[1]:
        for mode in sys.argv[1].split(","):
            if main([mode, *sys.argv[2:]]):
                sys.exit(f"{mode} failed")
        sys.exit(0)
    sys.exit(main())
