"""The ranks check of a recording compares each rank's parameters AND
persistent buffers (state outside the optimizer, e.g. a routing bias): the
Recorder's param_hash covers both, at every full-tensor step and after the
last. (A skeptical review found a rank's bias edited after the last step, or
drifting, passing: the buffers were read from rank 0 alone.)"""

from __future__ import annotations

import json

import torch

from dormouse.gate import artifacts as A
from dormouse.gate.record.recorder import Recorder, RecordingSpec


class WithBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("bias_state", torch.zeros(4))

    def forward(self, x):
        return self.lin(x) + self.bias_state


def _record(out, bump: float) -> tuple[str, str]:
    """Two steps of a one-process loop; the buffer moved by `bump` after step 1
    and after the last; returns (step 2's hash, the final hash)."""
    model = WithBias()
    rec = Recorder(out, model, RecordingSpec(build_model="x.y:build", build_optimizer="x.y:opt",
                                             objective="token_mean"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        rec.step(loss=0.0, optimizer=opt)
        opt.step()
        opt.zero_grad()
        model.bias_state += bump
    rec.close()
    step2 = json.loads(A.step_meta_path(out, 0, 2).read_text())["param_hash"]
    return step2, json.loads(A.final_meta_path(out, 0).read_text())["param_hash"]


def test_a_buffer_that_differs_changes_the_state_hash_the_ranks_check_compares(tmp_path):
    same = _record(tmp_path / "a", 0.0)
    assert _record(tmp_path / "b", 0.0) == same  # deterministic: equal state, equal hash
    moved = _record(tmp_path / "c", 1e-6)  # the parameters are the same; only the buffer moved
    assert moved[0] != same[0] and moved[1] != same[1]
