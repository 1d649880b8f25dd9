"""The independent truth of one review loop: plain autograd on the unparallelised model, one
process, over the global batch the loop was meant to read (every replica, every micro-batch),
at the parameters the fleet itself saved before each step; against the gradients and losses the
fleet saved itself (runs/NAME_truth/rankR_stepK.pt). Imports nothing from dormouse.

python truth.py runs/NAME [the run's own arguments]"""
import argparse
import glob
import re
import sys

import torch
import torch.nn.functional as F

import common

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--dp", type=int, default=1)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--vocab", type=int, default=64)
ap.add_argument("--micro", type=int, default=2)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--mask", type=int, default=1)
ap.add_argument("--init", default="build_model")
ap.add_argument("--clip", type=float, default=0.0)
ap.add_argument("--build", default="")   # module:function of a framework client
a, _ = ap.parse_known_args()

files = glob.glob(f"{a.dir}_truth/rank*_step*.pt")
ranks = sorted({int(re.search(r"rank(\d+)", f).group(1)) for f in files})
steps = sorted({int(re.search(r"step(\d+)", f).group(1)) for f in files})
build = getattr(common, a.init)
if a.build:
    import importlib
    mod, fn = a.build.split(":")
    build = getattr(importlib.import_module(mod), fn)
if not files:
    sys.exit(print('TRUTH: NO DATA (the run saved nothing)'))


def load(r, k):
    return torch.load(f"{a.dir}_truth/rank{r}_step{k}.pt")


def rel(x, y):
    return float((x.detach() - y.detach()).norm() / y.detach().norm().clamp_min(1e-30))


lines, right, loss_right = [], True, True
for k in steps:
    per_rank = [load(r, k) for r in ranks]
    params, grads = {}, {}
    for d in per_rank:                               # pipeline stages: merged by name
        for n, p in d["params"].items():
            params.setdefault(n, p)
        for n, g in d["grads"].items():
            grads.setdefault(n, g)
    # do the ranks hold the same gradient for every name they share?
    split = [n for n in grads if any(n in d["grads"] and not torch.equal(d["grads"][n], grads[n]) for d in per_rank)]
    model = build(vocab=a.vocab, seed=a.seed) if not a.build else build()
    if k == steps[0]:
        init_diff = max(rel(params[n], p.detach()) for n, p in model.named_parameters() if n in params)
        if init_diff > 0:
            lines.append(f"initial parameters differ from {a.init}'s by {init_diff:.3g} (relative, worst tensor)")
            right = False
    missing = model.load_state_dict(params, strict=False)
    ce, n = 0.0, 0
    if "batches" in per_rank[0]:                      # what every rank read (framework clients)
        data = [(b["input_ids"], b["labels"], {k: v for k, v in b.items() if k in ("attention_mask", "position_ids")})
                for d in per_rank for b in d["batches"]]
    else:
        data = [common.batch(k, r, m, a.vocab, mask=bool(a.mask)) + (None,)
                for r in range(a.dp) for m in range(a.micro)]
    seqs = []
    for x, y, am in data:                            # a packed, padding-free row: each sequence alone
        if am and "position_ids" in am:
            pos = am["position_ids"][0]
            starts = (pos == 0).nonzero().flatten().tolist() + [x.shape[1]]
            seqs += [(x[:, a:e], y[:, a:e], None) for a, e in zip(starts[:-1], starts[1:])]
        else:
            seqs.append((x, y, am))
    for x, y, am in seqs:
        out = model(x) if am is None else model(input_ids=x, **am)
        logits = out.logits if hasattr(out, "logits") else out
        lab = common.shifted(y)
        ce = ce + F.cross_entropy(logits.float().flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
        n += int((lab != -100).sum())
    (ce / n).backward()
    if a.clip:                                       # the one-process rule: clip by the global norm
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
    g1 = {nm: p.grad for nm, p in model.named_parameters() if p.grad is not None}
    gf = torch.cat([grads[nm].flatten() for nm in g1])
    gt = torch.cat([g1[nm].flatten() for nm in g1])
    err = rel(gf, gt)
    c = float(gf @ gt / (gt @ gt))
    worst = sorted(((rel(grads[nm], g1[nm]), nm) for nm in g1), reverse=True)[:3]
    lerr = abs(per_rank[0]["loss"] - float(ce.detach() / n)) / float(ce.detach() / n)
    lerr = 0.0 if lerr != lerr else lerr            # a client that saved no loss (nan): not compared
    ok = err < 1e-5 and not split
    right &= ok
    lines.append(f"step {k}: fleet gradient vs one process: rel {err:.3g}, fitted scalar {c:.4g}, "
                 f"worst tensors {[(f'{e:.2g}', nm) for e, nm in worst]}; ranks disagree on {split[:4]}; "
                 f"logged loss rel {lerr:.3g}")
    if lerr > 1e-5:
        loss_right = False
        lines.append(f"  logged loss wrong: {per_rank[0]['loss']:.6g} vs {float(ce / n):.6g}")
print("TRUTH: training", "RIGHT" if right else "WRONG", "; logged loss", "RIGHT" if loss_right else "WRONG")
print("\n".join(lines))
