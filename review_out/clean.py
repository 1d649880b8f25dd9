import sys, time, json
from dormouse.gate.settings import check
from dormouse.gate import pipeline
kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
t = time.time()
v = pipeline.gate(check(out=sys.argv[1], steps=kw.pop("steps", 4), **kw), log=lambda *a, **k: None)
print("PASS" if v.passed else "FAIL", f"{time.time()-t:.0f}s")
for c in v.checks:
    print(" ", "ok " if c.passed else "BAD", c.name, c.reason[:300])
