"""Independent truth for the made-up fill: from the raw safetensors files (no gate code), the fleet's
reduced embed.weight gradient on the rows of bytes no window of the step read (their gradient is exactly
zero in any arithmetic: no token looks them up), relative to the tensor's max."""
import sys, glob
from safetensors.torch import load_file
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/rank0/step*.safetensors")):
    t = load_file(f)
    g = t["g/embed.weight"]
    read = set()
    for r in glob.glob(f"{out}/rank*/" + f.split('/')[-1]):
        tt = load_file(r)
        for k, v in tt.items():
            if k.startswith("in/") and k.endswith("arg0"):
                read |= set(v.reshape(-1).tolist())
    unread = [b for b in range(g.shape[0]) if b not in read]
    rel = float(g[unread].abs().max() / g.abs().max()) if unread else 0.0
    print(f.split('/')[-1], "unread bytes", len(unread), "max |g| there / max|g|", f"{rel:.3g}")
