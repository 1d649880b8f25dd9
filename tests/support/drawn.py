"""The tests' own one-process gradient of a recorded step of loopmodel's TinyLM with torch's dropout, each
forward's masks drawn from an RNG state the test chooses (the rank's recorded one, or a seed): plain
autograd on the global token mean, nothing of the gate's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loopmodel import VOCAB, build_model

from dormouse.gate import artifacts as A


def recorded_state(rec: A.RecordingSet, step: int):
    """draw(r, m): the CPU RNG put back to the state rank r's forward of micro-batch m started from."""
    return lambda r, m: torch.set_rng_state(rec.step_tensors(r, step)[A.rng_key(m, "cpu")])


def one_process(rec: A.RecordingSet, step: int, draw, scale=lambda r: 1.0,
                train: bool = True) -> dict[str, torch.Tensor]:
    """Every rank's micro-batches of `step` differentiated in one process at the initial model (float64
    copies), draw(r, m) called before each forward, rank r's losses times scale(r); the model in eval
    mode (its dropout off) where not `train`."""
    net = build_model(**rec.spec.build_kwargs)
    assert net.drop is not None and net.drop.p > 0
    net.train(train)
    mbs = rec.micro_batches(step)
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for _, _, b in mbs)
    for r, m, b in mbs:
        draw(r, m)
        z = net(b["input_ids"])[:, :-1]
        (F.cross_entropy(z.reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), ignore_index=-100,
                         reduction="sum") / n * scale(r)).backward()
    return {k: p.grad.detach().double().clone() for k, p in net.named_parameters()}


def fleet(out, rec: A.RecordingSet, step: int = 1) -> dict[str, torch.Tensor]:
    """Rank 0's recorded gradient at `step` (float64), over its clip coefficient where the loop clipped."""
    import looprec

    meta = rec.step_meta(0, step)
    return {k: v.double() / (meta["clip_coef"] if meta["clipped"] else 1.0)
            for k, v in looprec.recorded_gradients(out, 0, step).items()}
