"""Attack 6: --resume-from a checkpoint whose optimizer state is wrong (AdamW moments scaled x3, momentum
buffers x3), in fp32 / exact / fsdp. The gate claims the fleet continues from THIS checkpoint as one process
would: expected PASS. Truth, independently of the gate: dormouse's own trainer in one process from the same
checkpoint (train(), no gate code), its parameters after the last step against the fleet's recorded final ones."""
import dataclasses, json, sys, time
sys.path.insert(0, "tests/support")
import torch
from dormouse.gate.judge.entry import judge
from dormouse.gate.record.fixtures import build, make_run
from dormouse.train.loop import train
from dormouse.gate.settings import GateSettings
from gatekit import QUIET, fleets, references
from safetensors.torch import load_file
case = sys.argv[1]
kw = {"fp32": dict(reduce="fp32"), "exact": dict(reduce="exact", profile="3,3"),
      "fsdp": dict(reduce="fp32", shard="fsdp", profile="3,3")}[case]
import shutil; shutil.rmtree(f"/tmp/rv/rf_{case}", ignore_errors=True)
s = GateSettings(out=f"/tmp/rv/rf_{case}", steps=4, resume_world=0, opt="adamw", **kw).validate()
run = make_run(s, name="first", dist=False)
run.train.stop_at, run.train.ckpt_every = 2, 2
train(build(run), run, log=QUIET)
ckpt = s.out_dir / "ckpts" / "first.pt"
c = torch.load(ckpt, weights_only=False)
n = 0
def scale(o):
    global n
    if isinstance(o, dict):
        for k, v in o.items():
            if torch.is_tensor(v) and v.is_floating_point() and k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                o[k] = v * 3; n += 1
            else:
                scale(v)
    elif isinstance(o, (list, tuple)):
        for v in o: scale(v)
scale({k: v for k, v in c.items() if k != "model"})
print("optimizer tensors scaled:", n, "ckpt keys", list(c)[:8])
torch.save(c, ckpt)
s2 = dataclasses.replace(s, resume_from=str(ckpt)).validate()
fleets([s2]); references(s2)
v = judge(s2.out_dir)
print(case, "PASS" if v.passed else "FAIL", [(x.name, x.reason[:200]) for x in v.checks if not x.passed])
# truth: one process continuing from the same (corrupted) checkpoint through dormouse's trainer
alone = make_run(s2, name="truth", dist=False, resume_from=str(ckpt))
m = build(alone)
train(m, alone, log=QUIET)
fin = load_file(str(s2.out_dir / "rank0" / "final.safetensors"))
sd = {k: v.float() for k, v in m.state_dict().items()}
worst = max(float((fin["p/" + k] - sd[k]).norm() / sd[k].norm().clamp_min(1e-30)) for k in sd if "p/" + k in fin)
print("truth: fleet final vs one process from the same checkpoint, worst rel L2:", f"{worst:.2e}")
