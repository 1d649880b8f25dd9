"""Attack 4: a gate out dir whose recording.json lost extra.settings, judged as `dormouse gate check DIR`
does (judge(out), no settings) and as the pipeline does (judge(out, settings))."""
import json, shutil, sys
sys.path.insert(0, "tests/support")
from pathlib import Path
from dormouse.gate.judge.entry import judge
from dormouse.gate.settings import check
src, dst, kw = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
p = dst / "recording.json"; m = json.loads(p.read_text())
print("extra keys before:", sorted(m.get("extra", {})))
m["extra"].pop("settings")
p.write_text(json.dumps(m))
v = judge(dst)
print("judge(out) no settings:", "PASS" if v.passed else "FAIL", [c.name for c in v.checks if not c.passed], v.references)
try:
    v2 = judge(dst, check(out=str(dst), steps=kw.pop("steps", 4), **kw))
    print("judge(out, settings):", "PASS" if v2.passed else "FAIL", [(c.name, c.reason[:200]) for c in v2.checks if not c.passed])
except Exception as e:
    print("judge(out, settings) raised", type(e).__name__, e)
