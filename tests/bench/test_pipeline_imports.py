"""The tiny pipeline's verdict path takes no import it does not need: a Recorder on a plain
module (no FSDP2, no DTensor) does not import torch.distributed.fsdp / .tensor (seconds per
rank and per one-process run, where bytecode is not cached), and its answer is unchanged."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import sys, torch
from dormouse.gate.record.layouts import needs_layout
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
print(needs_layout(m, 2), 'torch.distributed.fsdp' in sys.modules, 'torch.distributed.tensor' in sys.modules)
import torch.distributed.fsdp
print(needs_layout(m, 2))
"""


def test_a_plain_model_is_laid_out_plainly_without_importing_fsdp_or_dtensor():
    env = {**os.environ, "DORMOUSE_TEST_WARM": "0"}  # a fresh interpreter: the suite's warm one holds FSDP2 already
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "False", "False"]
