"""The RNG state each micro-batch's forward started from on its rank (the Recorder keeps it with the
micro-batch, A.rng_key), put back before one process runs that micro-batch's forward: a dropout
draws the masks the rank drew, so a run with torch's own dropout is judged against the gradient
its ranks' masks give. A recording made before the states were kept, or a draw the reference
cannot repeat (the masks of a forward on CUDA, drawn by CUDA's generator; the CPU reference
draws its own), falls back to a fixed seed, as every forward did before: `kind` says which."""

from __future__ import annotations

import torch

from dormouse.gate import artifacts as A

REPLAYED, ON_CUDA = "replayed", "cuda"  # kind(): every forward's CPU state put back; or drawn on CUDA


def recorded(rec: A.RecordingSet, r: int, step: int, m: int, device: str = "cpu") -> torch.Tensor | None:
    """The `device` RNG state rank r's micro-batch m at `step` started its forward from, None when not kept."""
    t = rec.step_tensors(r, step)
    key = A.rng_key(m, device)
    return t[key] if key in t else None


def restore(rec: A.RecordingSet, r: int, step: int, m: int, *, other: bool = False) -> None:
    """The CPU RNG as rank r's forward of micro-batch m found it (seed 0 where the recording keeps no
    state). other=True: another state than that one (the check that the gradient depends on the draws:
    the recorded state advanced by one draw; seed 1 where none is kept)."""
    state = recorded(rec, r, step, m)
    if state is None:
        torch.random.default_generator.manual_seed(1 if other else 0)
        return
    torch.random.set_rng_state(state)
    if other:
        torch.rand(1)


def kind(rec: A.RecordingSet, step: int, mbs) -> str | None:
    """How the step's forwards' draws were put back: ON_CUDA where a forward ran on CUDA (its masks are
    CUDA's draws), REPLAYED where every micro-batch's CPU state was kept, else None (seed 0)."""
    keys = [(A.rng_key(m, "cpu"), A.rng_key(m, "cuda"), rec.step_tensors(r, step)) for r, m, _ in mbs]
    if any(cuda in t for _, cuda, t in keys):
        return ON_CUDA
    return REPLAYED if keys and all(cpu in t for cpu, _, t in keys) else None
