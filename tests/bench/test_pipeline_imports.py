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


CAPTURE = """
import sys, torch
from dormouse.gate.record.capture import Capture
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
c = Capture(m, ("input",), "token_mean")
c.hook()
m(torch.ones(1, 4)).sum().backward()  # a forward is a micro-batch where a backward reaches it
print(len(c.take()[0]), 'torch._dynamo' in sys.modules, [hasattr(h, '_torchdynamo_orig_callable') for h in m._forward_pre_hooks.values()])
import torch._dynamo  # a torch.compile after the hooks went on: the next take() puts them on again, eager
print(len(c.take()[0]), [hasattr(h, '_torchdynamo_orig_callable') for h in m._forward_pre_hooks.values()])
m(torch.ones(1, 4)).sum().backward()
print(len(c.take()[0]))
"""


def test_the_capture_hooks_plain_until_dynamo_is_imported_then_eager_under_it():
    env = {**os.environ, "DORMOUSE_TEST_WARM": "0"}
    done = subprocess.run([sys.executable, "-c", CAPTURE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["1 False [False]", "0 [True]", "1"]
