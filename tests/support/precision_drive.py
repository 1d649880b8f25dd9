"""Reviewer 2's driver: `python precision_drive.py ROOT PLAN.json` with PLAN a dict
name -> ddp_loop RUN overrides; launches them in one torchrun and prints each
verdict: passed, and per check passed / worst / bound / reason (shortened)."""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import looprec  # noqa: E402

from dormouse.gate import artifacts as A  # noqa: E402
from dormouse.gate.artifacts import ReferenceSet
from dormouse.gate.judge.precision import precision_floor

root, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
root.mkdir(parents=True, exist_ok=True)
t = time.time()
todo = {n: c for n, c in runs.items() if not (root / n / "DONE").exists()}
if todo:
    looprec.launch([{"steps": 3, **c, "out": str(root / n)} for n, c in todo.items()], root)
    for n in todo:
        (root / n / "DONE").write_text("")
print(f"launch {time.time() - t:.0f}s", flush=True)
for name in runs:
    out = root / name
    v = looprec.verdict(out)
    rec, ref = A.RecordingSet(out), ReferenceSet(out)
    fl = precision_floor(rec, ref)
    lf = [ref.info(k).get("loss_floor") for k in rec.steps]
    print(f"== {name}: passed={v.passed} floor={fl} loss_floor={lf} ac={rec.autocast_dtypes()}")
    for c in v.checks:
        w = f" worst={c.worst:.3g} bound={c.bound:.3g}" if hasattr(c, "worst") else ""
        print(f"   {c.name:12s} {'ok  ' if c.passed else 'FAIL'}{w} :: {c.reason[:260]}")
    sys.stdout.flush()
