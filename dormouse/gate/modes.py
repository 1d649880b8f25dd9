"""The gate's three modes. Each writes its artifacts into `settings.out`.

single  - one process at the GLOBAL batch: the reference loss curve.
rank    - one process per rank under torchrun: the fleet (rank<r> artifacts).
gradref - the hand-computed token-weighted gradient of ONE step over the ranks'
          own batches, g = sum_r t_r g_r / sum_r t_r, applied by the same
          optimizer construction the trainer uses: the reference the fleet's
          post-step parameters must equal. It reads the bytes by hand (with
          rank_byte_offset) and weights the gradients by hand, so a bug in the
          fleet's data split or reduce cannot hide in a shared code path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from dormouse.errors import DormouseError
from dormouse.gate.artifacts import load_meta, save_artifact
from dormouse.gate.fixtures import LR, SEQ, STEPS, WORLD, build, make_run
from dormouse.train.data import _windows, rank_byte_offset
from dormouse.train.distributed import close_fleet, parse_capacity, train_dist
from dormouse.train.loop import make_optimizer, train
from dormouse.train.tensors import named_state


@dataclass
class GateSettings:
    """What one gate run was asked to do; recorded in every artifact it writes."""

    out: str  # the artifact directory
    steps: int = STEPS  # optimizer steps
    batch: int = 2  # the config's batch: global for single, per rank for rank
    capacity: str = ""  # per-rank profile, e.g. "4,2" ("" = batch on every rank)
    seed: int = 7  # model initialisation seed, the same in every mode
    lr: float = LR  # learning rate
    shard: str = "none"  # none | fsdp
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    opt: str = "mix"  # mix | adamw
    reduce: str = "fp32"  # gradient all-reduce dtype on the wire: fp32 | bf16
    world: int = WORLD  # ranks (gradref's profile; a fleet reads torchrun's)

    def record(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("out")
        return d


def run_single(s: GateSettings, log=print) -> dict:
    """One process at the global batch: s.batch, or the sum of s.capacity's
    batches when a profile is given (then every rank must use seq_len SEQ)."""
    batch = s.batch
    if s.capacity:
        probe = make_run(Path(s.out), steps=s.steps, batch=s.batch)
        shapes = parse_capacity(s.capacity, world_size=len(s.capacity.split(",")), cfg=probe.train,
                                max_seq_len=probe.model.max_seq_len)
        if any(sh.seq_len != SEQ for sh in shapes):
            raise DormouseError(
                f"capacity {s.capacity!r} mixes window lengths: one process cannot hold that "
                "global batch as one batch; compare such a fleet against gradref instead"
            )
        batch = sum(sh.batch for sh in shapes)
    run = make_run(Path(s.out), steps=s.steps, batch=batch, lr=s.lr, opt=s.opt, name="single")
    model = build(s.seed)
    report = train(model, run, log=log)
    return _save(s, "single", named_state(model), report["losses"], mode="single",
                 global_batch=batch, config=run.to_dict(), wall_s=report["wall_s"])


def run_rank(s: GateSettings, log=print) -> dict:
    """One rank of the fleet (run it under torchrun)."""
    run = make_run(Path(s.out), steps=s.steps, batch=s.batch, capacity=s.capacity, dist=True,
                   lr=s.lr, shard=s.shard, opt=s.opt, reduce=s.reduce, name="fleet")
    # Seeded BEFORE joining the fleet, so every rank builds the same model (and
    # the single-process reference can build it too); train_dist checks it.
    model = build(s.seed)
    report = train_dist(run, log=log, device_type=s.device, model=model, close=False)
    try:
        # FSDP2 shards the parameters: equality across ranks needs the GATHERED
        # tensors (a collective every rank runs in the same order).
        state = named_state(report["model"], gather=s.shard == "fsdp")
        rank, world = report["rank"], report["world_size"]
        meta = _save(s, f"rank{rank}", state, report["losses"], mode="rank", rank=rank,
                     world_size=world, shapes=[sh.line() for sh in _shapes(run, world)],
                     config=run.to_dict(), wall_s=report["wall_s"])
    finally:
        del report, model
        close_fleet()
    return meta


def run_gradref(s: GateSettings, log=print) -> dict:
    """One hand-computed token-weighted step over the profile's rank batches."""
    out = Path(s.out)
    run = make_run(out, steps=1, batch=s.batch, capacity=s.capacity, lr=s.lr, opt=s.opt, name="gradref")
    model = build(s.seed)
    # The starting point too, so the verdict can compare the fleet's STEP
    # (after - before) with the reference step, not just the parameters.
    save_artifact(out, "init", named_state(model), [], settings=s.record(), mode="init")
    shapes = _shapes(run, s.world)
    corpus = (out / "corpus.bin").read_bytes()
    total = sum(sh.tokens for sh in shapes)
    acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    seen = set()
    local, loads = [], None
    for r, sh in enumerate(shapes):
        off = rank_byte_offset(shapes, r)  # step 0's span starts at byte 0
        x, y = _windows(corpus[off: off + sh.nbytes], sh.batch, sh.seq_len)
        model.zero_grad(set_to_none=True)
        _, loss, aux = model(x, y)
        loss.backward()
        local.append(float(loss.detach()))
        loads = aux["loads"] if loads is None else loads + aux["loads"]
        for n, p in model.named_parameters():
            if p.grad is not None:  # a missing gradient is a zero
                acc[n].add_(p.grad, alpha=sh.tokens / total)
                seen.add(n)
    for n, p in model.named_parameters():
        p.grad = acc[n] if n in seen else None
    make_optimizer(model, run).step()  # the trainer's optimizer construction
    model.balance_experts(loads)
    loss = sum(sh.tokens / total * l for sh, l in zip(shapes, local))
    log(f"gradref: {len(shapes)} ranks, {total} tokens, loss={loss:.7f} local={local}")
    return _save(s, "gradref", named_state(model), [loss], mode="gradref", local_losses=local,
                 shapes=[sh.line() for sh in shapes], tokens=total, config=run.to_dict())


def _shapes(run, world: int):
    return parse_capacity(run.train.dist_capacity, world_size=world, cfg=run.train,
                          max_seq_len=run.model.max_seq_len)


def _save(s: GateSettings, name: str, state, losses, **extra) -> dict:
    save_artifact(Path(s.out), name, state, losses, settings=s.record(), **extra)
    return load_meta(Path(s.out), name)


MODES = {"single": run_single, "rank": run_rank, "gradref": run_gradref}
