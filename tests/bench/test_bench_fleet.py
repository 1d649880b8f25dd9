"""dormouse.bench.fleet drives THE loop: its DDP synchroniser trains the same
network as FleetSync, and its ring and exact kinds train through train_dist.
Timings are never asserted (a shared machine); what the kinds computed is."""

from __future__ import annotations

import json
import os
import subprocess

from dormouse.gate.record.launcher import torchrun


def test_bench_fleet_ddp_equals_fleetsync_and_two_slice_ring_equals_exact_at_two_ranks(tmp_path):
    out = tmp_path / "fleet.json"
    cmd = torchrun(["-m", "dormouse.bench.fleet", "--out", str(out), "--preset", "tiny", "--batch", "4", "--seq-len", "64",
                    "--kinds", "ours,ddp,ring,exact", "--micro-batch", "2", "--rounds", "2", "--steps", "1"], world=2)
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    res = json.loads(out.read_text())
    # DDP (SUM comm hook, loss/loads all-reduced by DDPSync) and FleetSync: the same bits.
    assert res["ours_vs_ddp_max_abs_param_diff"] == 0.0
    # Two slices per rank at two ranks: the ring computes (s0 + s1) + (s2 + s3), the tree itself.
    assert res["exact_vs_ring_max_abs_param_diff"] == 0.0
    assert set(res["ratios"]) == {"fleet_vs_ddp", "exact_vs_ring"}
    assert all(len(r) == 1 for rounds in res["step_s_rounds"].values() for r in rounds)  # steps per round
