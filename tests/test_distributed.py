"""The seed's distributed gate, through the public API exactly as the seed's
driver (`tools/dist_gate.py`) uses it: `ModelConfig(**TINY)`, `TrainConfig` /
`RunConfig` with the driver's fields and otherwise the DEFAULTS, `train(model,
run, log=...)` for one process at the global batch, `train_dist(run, log=...,
device_type="cpu", model=model, close=False)` on each of two ranks under
`python -m torch.distributed.run --standalone --nproc_per_node=2`, and the
hand-computed step: `parse_capacity`, `rank_byte_offset`, `_windows`,
`model(x, y) -> (logits, loss, aux)`, `MixOptimizer(...)` with the driver's
keywords. The three comparisons the seed makes:

1. the ranks hold the same parameters and log the same losses, bitwise;
2. the fleet's loss curve is the single process's at the global batch within
   round-off: the bound is 10x the spread of the single process's own curve
   when its first gradient is nudged by one float32 ulp per element (the
   reference's sensitivity to round-off, never a run that splits the batch);
3. the fleet's parameters after step 1 are the hand-computed token-weighted
   step g = sum_r t_r g_r / sum_r t_r over the ranks' OWN bytes, read at
   step 1's span from the corpus's start (the data rule the seed states:
   TrainConfig's default order), applied by the same MixOptimizer. The fleet
   and the hand sum differ only in the float32 rounding of that sum; the
   default Muon runs Newton-Schulz in bfloat16 (ns_dtype), whose output is
   rounded to 2^-8 relative, so that rounding can flip a few of its output's
   roundings: per tensor, the two UPDATES (parameters after minus before)
   agree within UPDATE_ULPS bfloat16 ulps of the update's norm (3 seen on the
   expert weights with the fp32 kernel, 1e-6 of a ulp on the AdamW tensors).
   Reading another span (the shuffled order at step 1) moves the update by
   O(1): the test after it shows the comparison failing there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dormouse.config import TrainConfig
from dormouse.train.data import _windows
from dormouse.train.distributed import parse_capacity, rank_byte_offset
from dormouse.train.loop import train
from dormouse.train.optim import MixOptimizer
from seed_fleet import build, make_run

SUPPORT = Path(__file__).resolve().parent / "support"
STEPS = 20
CAPACITY = "4,2"  # rank 0 four windows, rank 1 two: unequal token counts, so the weighting matters
WORLD = 2
BF16_ULP = 2.0 ** -8  # bfloat16's unit round-off (8 significand bits)
UPDATE_ULPS = 8  # the bound of comparison 3, in bfloat16 ulps of each tensor's update
FLOOR_MULTIPLE = 10  # comparison 2's bound: this many times the nudged single runs' spread


def _losses(lines: list[str]) -> list[float]:
    out = []
    for line in lines:
        if line.startswith("eval ") or " loss=" not in line:
            continue
        out.append(float(line.split(" loss=")[1].split()[0]))
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The seed's `--mode rank` on two ranks, profile 4,2, STEPS steps."""
    out = tmp_path_factory.mktemp("seed")
    path = os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
         str(SUPPORT / "seed_rank.py"), str(out), str(STEPS), CAPACITY],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _single(out: Path, *, nudge: int = 0) -> list[float]:
    """The seed's `--mode single` at the global batch (the profile's 4 + 2
    windows); with `nudge`, step 1's gradient is multiplied element-wise by
    (1 +- 2^-23) (signs seeded by `nudge`) before the optimizer reads it."""
    run = make_run(out / f"single{nudge}", steps=STEPS, batch=sum(int(b) for b in CAPACITY.split(",")))
    gen = torch.Generator().manual_seed(nudge)

    def nudge_first(step: int, model) -> None:
        for p in model.parameters():
            if nudge and step == 1 and p.grad is not None:
                sign = torch.randint(0, 2, p.grad.shape, generator=gen) * 2 - 1
                p.grad.mul_(1 + 2.0 ** -23 * sign)

    lines: list[str] = []
    train(build(), run, log=lines.append, on_grads=nudge_first)
    return _losses(lines)


def hand_step(out: Path, *, shift: int = 0) -> list[torch.Tensor]:
    """The seed's `--mode gradref`: each rank's own bytes of step 1 (read
    `shift` bytes past where the data rule says), its mean loss's gradient
    weighted by its share of the tokens, summed, one MixOptimizer step."""
    run = make_run(out / "gradref", steps=1, batch=2, capacity=CAPACITY)
    cfg = run.train
    model = build()
    shapes = parse_capacity(CAPACITY, world_size=WORLD, cfg=cfg, max_seq_len=model.cfg.max_seq_len)
    corpus = Path(cfg.data).read_bytes()
    total = sum(s.tokens for s in shapes)
    acc = [torch.zeros_like(p) for p in model.parameters()]
    for r, shape in enumerate(shapes):
        off = rank_byte_offset(shapes, r) + shift
        x, y = _windows(corpus[off: off + shape.batch * (shape.seq_len + 1)], shape.batch, shape.seq_len)
        model.zero_grad()
        _, loss, _ = model(x, y)
        loss.backward()
        for a, p in zip(acc, model.parameters(), strict=True):
            if p.grad is not None:  # a disabled arm's parameters see no gradient
                a.add_(p.grad.detach(), alpha=shape.tokens / total)
    for p, a in zip(model.parameters(), acc, strict=True):
        if p.grad is not None:
            p.grad = a
    MixOptimizer(model, lr=cfg.lr, wd=cfg.wd, opt=cfg.opt, ns_steps=cfg.ns_steps, ns_kind=cfg.ns_kind,
                 colrow_3d=cfg.muon_colrow_3d, muon_state_dtype=cfg.muon_state_dtype, ns_dtype=cfg.ns_dtype,
                 muon_variant=cfg.muon_variant, muon_sf=cfg.muon_sf).step()
    return [p.detach().clone() for p in model.parameters()]


def update_ulps(fleet_after: list[torch.Tensor], ref_after: list[torch.Tensor]) -> float:
    """The worst tensor's difference of the two updates, in bfloat16 ulps of
    the reference's update norm."""
    before = [p.detach() for p in build().parameters()]
    worst = 0.0
    for p0, f, r in zip(before, fleet_after, ref_after, strict=True):
        step = (r - p0).norm()
        if step > 0:
            worst = max(worst, float((f - r).norm() / step) / BF16_ULP)
        else:
            assert torch.equal(f, r)  # a parameter the step does not move stays put in both
    return worst


def test_every_rank_holds_the_same_parameters_and_logs_the_same_losses(fleet):
    _, ranks = fleet
    assert ranks[0]["world_size"] == WORLD and [r["rank"] for r in ranks] == list(range(WORLD))
    assert len(ranks[0]["losses"]) == STEPS and ranks[0]["losses"] == ranks[1]["losses"]
    for key in ("step1", "final"):
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][key], ranks[1][key], strict=True))


def test_the_fleets_loss_curve_is_the_single_process_curve_at_the_global_batch_within_round_off(fleet):
    out, ranks = fleet
    single = _single(out)
    nudged = [_single(out, nudge=k) for k in (1, 2)]
    rel = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))  # noqa: E731
    floor = max(rel(n, single) for n in nudged)
    assert 0 < floor < 1e-3  # the reference's own round-off sensitivity: measurable, and small
    off = rel(ranks[0]["losses"], single)
    print(f"fleet vs single: {off:.3g}; nudged floor {floor:.3g}")
    assert off <= FLOOR_MULTIPLE * floor, (off, floor)


def test_the_fleets_first_step_is_the_hand_computed_token_weighted_step(fleet):
    out, ranks = fleet
    ulps = update_ulps(ranks[0]["step1"], hand_step(out))
    print(f"fleet vs hand step: {ulps:.3g} bf16 ulps")
    assert ulps <= UPDATE_ULPS, (f"the fleet's first update is {ulps:.3g} bf16 ulps off the hand-computed step "
                                 f"(TrainConfig's default data_order: {TrainConfig().data_order!r})")


def test_the_first_step_comparison_fails_when_the_hand_step_reads_other_bytes(fleet):
    """The same comparison against a hand step that reads one window further
    on: the check is not blind to which bytes were read."""
    out, ranks = fleet
    ulps = update_ulps(ranks[0]["step1"], hand_step(out, shift=make_run(out, steps=1, batch=2).train.seq_len + 1))
    print(f"fleet vs a hand step one window off: {ulps:.3g} bf16 ulps")
    assert ulps > 10 * UPDATE_ULPS
