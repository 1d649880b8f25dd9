"""Faulted fleets (tests/support/review_faults.py) through the gate's own launch, references and judge.
usage: faulted.py NAME FAULT 'json settings'"""
import json, sys, time
sys.path.insert(0, "tests/support")
from pathlib import Path
from dormouse.gate.settings import check
from dormouse.gate.record.launcher import launch_plan
from dormouse.gate.judge.entry import judge
import gatekit
name, fault, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
s = check(out=f"/tmp/rv/{name}", steps=kw.pop("steps", 4), **kw)
import shutil; shutil.rmtree(s.out_dir, ignore_errors=True)
t = time.time()
launch_plan([s], timeout_s=600, stream=gatekit.QUIET, entry=["tests/support/review_faults.py"],
            env={"DORMOUSE_TEST_FAULTS": json.dumps({str(s.out_dir): None if fault == "none" else fault})},
            fork_ranks=True)
gatekit.references(s)
v = judge(s.out_dir, s)
print(name, fault, "PASS" if v.passed else "FAIL", f"{time.time()-t:.0f}s")
for c in v.checks:
    if not c.passed or c.name in ("gradient", "curve", "gradref"):
        print(" ", "ok " if c.passed else "BAD", c.name, c.reason[:400])
