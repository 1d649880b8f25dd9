"""Attack 3: the exact reference (and single) remade with another profile of the same global batch,
judged against the fleet's settings: provenance compares one-process references through global_batch only."""
import json, shutil, sys
from pathlib import Path
from dormouse.gate.settings import check
from dormouse.gate.record import modes
from dormouse.gate.judge.entry import judge
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
fleet_kw, ref_kw = json.loads(sys.argv[3]), json.loads(sys.argv[4])
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
s = check(out=str(dst), steps=4, **fleet_kw)
r = check(out=str(dst), steps=4, **ref_kw)
print("fleet record:", {k: s.record()[k] for k in ("profile", "world", "micro_batch", "global_batch")},
      "ref:", {k: r.record()[k] for k in ("profile", "world", "micro_batch", "global_batch")})
modes.MODES["single"](r, log=lambda *a, **k: None)
v = judge(dst, s)
print("PASS" if v.passed else "FAIL")
for c in v.checks:
    if not c.passed or c.name in ("provenance", "exact", "curve"):
        print(" ", "ok " if c.passed else "BAD", c.name, c.reason[:300])
