"""A gate rank with a fault injected, for tests only: torchrun runs this file
instead of `-m dormouse.gate`; it monkeypatches the library inside the rank
process, then hands over to dormouse.gate's own main. The production path has
no fault switches.

The fault is named by DORMOUSE_TEST_FAULT:

  kill_rank1    rank 1 SIGKILLs itself after step 3 (checkpoints every 2 steps)
  plain_mean    the reduce averages gradients (1/W each) instead of weighting
                them by tokens
  skip_param    head.weight keeps its local gradient: left out of the reduce
  seeds         each rank builds its model from seed + rank, and the start-up
                identity check is switched off
  seeds_checked each rank builds from seed + rank; the identity check stays
  capacity_moe  the MoE drops by capacity (factor 0.5) and the refusal of that
                configuration is bypassed

To add a fault: add a function here that patches what it needs (module
attributes the rank process looks up at call time) and name it in FAULTS.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import dormouse.gate.fixtures as fixtures
import dormouse.gate.modes as modes
import dormouse.gate.trace as trace
import dormouse.train.distributed as distributed


def kill_rank1() -> None:
    make_run = modes.make_run
    modes.make_run = lambda *a, **k: _with_ckpt_every(make_run(*a, **k), 2)
    record = trace.Trace.__call__

    def call(self, step, model, info):
        record(self, step, model, info)
        if step == 3 and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)

    trace.Trace.__call__ = call


def _with_ckpt_every(run, every):
    return dataclasses.replace(run, train=dataclasses.replace(run.train, ckpt_every=every))


def plain_mean() -> None:
    flatten = distributed.FleetSync._flatten

    def mean_flatten(self, bucket):
        # The loop scaled this rank's loss by t_r / T; undo that and apply 1 / W.
        total = sum(s.tokens for s in self.shapes)
        return flatten(self, bucket) * (total / (self.world_size * self.shapes[self.rank].tokens))

    distributed.FleetSync._flatten = mean_flatten


def skip_param() -> None:
    reduce = distributed.FleetSync.reduce

    def leaky_reduce(self, model, loss_share, loads):
        p = dict(model.named_parameters())["head.weight"]
        local = p.grad.clone()
        out = reduce(self, model, loss_share, loads)
        p.grad.copy_(local)  # as if head.weight had been left out of the buckets
        return out

    distributed.FleetSync.reduce = leaky_reduce


def seeds_checked() -> None:
    build = modes.build
    modes.build = lambda seed: build(seed + int(os.environ.get("RANK", "0")))


def seeds() -> None:
    seeds_checked()
    distributed._check_identical = lambda model, rank: None


def capacity_moe() -> None:
    fixtures.TINY["moe_capacity"] = 0.5
    refuse = distributed.refuse_incompatible

    def lenient(run, *, world_size, model=None):
        # Every other refusal still applies, to a dropless copy of the run.
        dropless = dataclasses.replace(run, model=dataclasses.replace(run.model, moe_capacity=0.0))
        return refuse(dropless, world_size=world_size)

    distributed.refuse_incompatible = lenient


FAULTS = {f.__name__: f for f in (kill_rank1, plain_mean, skip_param, seeds, seeds_checked, capacity_moe)}

if __name__ == "__main__":
    FAULTS[os.environ["DORMOUSE_TEST_FAULT"]]()
    from dormouse.gate.__main__ import main

    sys.exit(main())
