"""`python -m dormouse.gate.record.soak --launches 30`: launch short gate fleets back
to back (every other one sharded with FSDP2) and count the launches that fail
or abort at exit. The gate must never flake; this is how that is shown.

The hazard it watches for: a gloo process that reaches interpreter shutdown
with a live process group aborts with "terminate called without an active
exception" (seen in a backtrace: ProcessGroupGloo's `pt_gloo_runloop` worker
thread is unwound during Py_FinalizeEx's final garbage collection, through a
frame that may not throw, and std::terminate follows). dormouse's
close_fleet() releases every holder of the group (FSDP state, DTensors, the
device mesh: gc.collect() breaks FSDP's reference cycles) and destroys it while
the interpreter is still whole.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from dormouse.errors import FleetError
from dormouse.gate.record.launcher import launch_fleet
from dormouse.gate.settings import GateSettings

ABORT = "terminate called"


def soak(launches: int, root: Path, *, world: int = 2, steps: int = 3, log=print) -> dict:
    failures = []
    t0 = time.monotonic()
    for i in range(launches):
        shard = "fsdp" if i % 2 else "none"
        lines: list[str] = []
        try:
            launch_fleet(GateSettings(out=str(root / f"launch{i}"), steps=steps, world=world, profile="", shard=shard,
                                      resume_world=0),
                         timeout_s=120, stream=lines.append)
            error = next((l for l in lines if ABORT in l), None)
        except FleetError as e:
            error = str(e)
        if error:
            failures.append({"launch": i, "shard": shard, "error": error})
        log(f"launch {i + 1}/{launches} shard={shard}: {'FAIL ' + error if error else 'ok'}")
    return {"launches": launches, "sharded": launches // 2, "failures": failures,
            "wall_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    from dormouse.errors import OneLineParser

    p = OneLineParser(prog="python -m dormouse.gate.record.soak", description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=30)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = soak(args.launches, Path(tmp), world=args.world)
    print(f"{len(result['failures'])} of {result['launches']} launches failed "
          f"({result['sharded']} sharded) in {result['wall_s']:.0f} s")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
