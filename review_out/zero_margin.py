"""How close clean fleets come to the exact-zero rule (raw files, plain torch): at elements where the
reference's per-micro-batch |g| sum (wa/) and merged gradient (gm/) are exactly zero, the fleet's applied
gradient (rank 0's g/, the clip scale cancels in the ratio) over the tensor's max |g|."""
import glob, sys, os
from safetensors.torch import load_file
for out in sys.argv[1:]:
    worst, n = 0.0, 0
    for f in sorted(glob.glob(f"{out}/reference/step*.safetensors")):
        ref = load_file(f)
        fl = f"{out}/rank0/" + os.path.basename(f)
        if not os.path.exists(fl):
            continue
        g = load_file(fl)
        for k, wa in ref.items():
            if not k.startswith("wa/"):
                continue
            name = k[3:]
            gm, gf = ref.get("gm/" + name), g.get("g/" + name)
            if gm is None or gf is None or gf.shape != wa.shape:
                continue
            mask = (wa == 0) & (gm == 0)
            n += int(mask.sum())
            if mask.any():
                worst = max(worst, float(gf[mask].abs().max() / gf.abs().max().clamp_min(1e-30)))
    print(f"{os.path.basename(out):16s} zero elements {n:7d}  worst fleet |g| there / max|g| {worst:.2e}")
