"""The made-up fill's effect on the parameters (raw files, no gate code): the faulted fleet's final embed.weight
against a clean fleet's of the same settings, and a clean fleet against its own single process (the floor)."""
import sys
from safetensors.torch import load_file
a = load_file(f"{sys.argv[1]}/rank0/final.safetensors")["p/embed.weight"]
b = load_file(f"{sys.argv[2]}/rank0/final.safetensors")["p/embed.weight"]
s = load_file(f"{sys.argv[2]}/reference/single/rank0/final.safetensors")["p/embed.weight"]
print("faulted vs clean fleet: max |d|", f"{float((a-b).abs().max()):.2e}", "rel L2", f"{float((a-b).norm()/b.norm()):.2e}")
print("clean fleet vs its single: max |d|", f"{float((s-b).abs().max()):.2e}", "rel L2", f"{float((s-b).norm()/b.norm()):.2e}")
