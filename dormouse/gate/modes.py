"""The gate's three modes. Each writes its artifacts into `settings.out`.

single  - one process at the GLOBAL batch: the reference loss curve. It also
          measures the round-off floor of that reference (see `measure_floor`).
rank    - one process per rank under torchrun: the fleet (rank<r> artifacts).
gradref - the hand-computed token-weighted gradient of ONE step over the ranks'
          own batches, g = sum_r t_r g_r / sum_r t_r, applied by the same
          optimizer construction the trainer uses: the reference the fleet's
          post-step parameters must equal. It reads the bytes by hand (with
          rank_byte_offset) and weights the gradients by hand, so a bug in the
          fleet's data split or reduce cannot hide in a shared code path.

Artifacts (see artifacts.py): `<name>` holds the tensors after the run,
`<name>_grad` the gradients of its last step, `<name>_trace` per-step routing
and snapshots (trace.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dormouse.errors import DormouseError
from dormouse.gate.artifacts import load_meta, save_artifact
from dormouse.gate.fixtures import LR, STEPS, WORLD, build, make_run, rank_shapes, single_batch
from dormouse.gate.trace import Trace, rel_per_step
from dormouse.train.data import RankShape, _windows, rank_byte_offset
from dormouse.train.distributed import close_fleet, fleet_env, train_dist
from dormouse.train.loop import LocalSync, make_optimizer, train
from dormouse.train.tensors import named_grads, named_state


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
    device: str = "cpu"  # cpu (gloo) | cuda (nccl); single and gradref run there too
    opt: str = "mix"  # mix | adamw
    reduce: str = "fp32"  # gradient all-reduce dtype on the wire: fp32 | bf16
    world: int = WORLD  # ranks (gradref's profile; a fleet reads torchrun's)
    resume_from: str = ""  # continue from this checkpoint (relative to out, or absolute)
    bucket_mb: float = 4.0  # size of one flattened gradient all-reduce bucket

    def record(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("out")
        return d


def run_single(s: GateSettings, log=print) -> dict:
    """One process at the global batch: s.batch, or the sum of s.capacity's
    batches when a profile is given (then every rank must use seq_len SEQ)."""
    batch = global_batch(s)
    run = make_run(Path(s.out), steps=s.steps, batch=batch, lr=s.lr, opt=s.opt, name="single",
                   resume_from=_resume_path(s))
    model = build(s.seed).to(_device(s))
    trace = Trace(snapshots=True)
    report = train(model, run, log=log, on_step=trace)
    trace.save(Path(s.out), "single")
    save_artifact(Path(s.out), "single_grad", named_grads(model), [], settings=s.record(), mode="grad")
    floor = measure_floor(s, run, trace) if not s.resume_from else {}
    return _save(s, "single", named_state(model), report["losses"], mode="single",
                 global_batch=batch, config=run.to_dict(), wall_s=report["wall_s"], floor=floor,
                 start_step=report["start_step"])


def global_batch(s: GateSettings) -> int:
    if not s.capacity:
        return s.batch
    batch = single_batch(rank_shapes(s.capacity, world=len(s.capacity.split(",")), batch=s.batch))
    if batch is None:
        raise DormouseError(
            f"capacity {s.capacity!r} mixes window lengths: one process cannot hold that "
            "global batch as one batch; compare such a fleet against gradref instead"
        )
    return batch


def measure_floor(s: GateSettings, run, reference: Trace) -> dict:
    """The round-off floor of the single-process reference: two runs of the
    SAME mathematics, each compared step by step with the reference.

    microbatch - the same global batch as one-window micro-batches whose
                 gradients are accumulated with token weights: a different
                 summation order every step, as a fleet's reduce is (skipped
                 for a capacity-dropping MoE, for which it is another network).
    ulp        - the reference started from parameters nudged by one ulp
                 (each element moved to its next float32 neighbour, up or
                 down at random): how round-off-sized differences grow.

    For each: per-step relative loss difference and per-tensor per-step
    relative difference (max |a - b| / max |b|).
    """
    quiet = dataclasses.replace(run.train, ckpt_every=0, log_every=max(1, run.train.steps))
    runs = {}
    # Micro-batching is the same mathematics only for a network that does not
    # depend on which windows share a batch: a capacity-dropping MoE drops by
    # the batch's composition, so its micro-batched run is another network.
    if not (run.model.moe_on and run.model.moe_capacity > 0):
        micro = build(s.seed).to(_device(s))
        t_micro = Trace(snapshots=True)
        shapes = [RankShape(1, run.train.seq_len)] * run.train.batch
        r_micro = train(micro, dataclasses.replace(run, train=dataclasses.replace(quiet, ckpt_name="floor_micro")),
                        log=lambda _: None, sync=LocalSync(run, shapes), on_step=t_micro)
        runs["microbatch"] = (r_micro["losses"], t_micro)

    nudged = build(s.seed).to(_device(s))
    gen = torch.Generator().manual_seed(s.seed)
    with torch.no_grad():
        for p in nudged.parameters():
            up = (torch.rand(p.shape, generator=gen) < 0.5).to(p.device)
            p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf)))
    t_ulp = Trace(snapshots=True)
    r_ulp = train(nudged, dataclasses.replace(run, train=dataclasses.replace(quiet, ckpt_name="floor_ulp")),
                  log=lambda _: None, on_step=t_ulp)
    runs["ulp"] = (r_ulp["losses"], t_ulp)

    ref_params = reference.tensors()
    out = {}
    for name, (losses, trace) in runs.items():
        tensors = trace.tensors()
        out[name] = {
            "losses": losses,
            "param_rel": {k[2:]: rel_per_step(tensors[k], ref_params[k]) for k in ref_params if k.startswith("p/")},
        }
    return out


def run_rank(s: GateSettings, log=print) -> dict:
    """One rank of the fleet (run it under torchrun)."""
    return run_rank_plan([s], log=log)[-1]


def run_rank_plan(plan: list[GateSettings], log=print) -> list[dict]:
    """Several fleet runs in one process group, one after another (each into
    its own out dir): the same code path as one run per launch, without paying
    interpreter start-up and rendezvous for each."""
    metas = []
    try:
        for s in plan:
            metas.append(_one_rank_run(s, log))
    finally:
        close_fleet()
    return metas


def _one_rank_run(s: GateSettings, log) -> dict:
    run = make_run(Path(s.out), steps=s.steps, batch=s.batch, capacity=s.capacity, dist=True,
                   lr=s.lr, shard=s.shard, opt=s.opt, reduce=s.reduce, name="fleet",
                   resume_from=_resume_path(s), bucket_mb=s.bucket_mb)
    # Seeded BEFORE joining the fleet, so every rank builds the same model (and
    # the single-process reference can build it too); train_dist checks it.
    model = build(s.seed)
    gather = s.shard == "fsdp"  # FSDP2 shards: compare the GATHERED tensors (a collective)
    # Ranks end bitwise equal (the verdict checks it), so rank 0's snapshots
    # stand for the fleet; every rank keeps its own tokens' routing.
    trace = Trace(snapshots=fleet_env()[0] == 0, gather=gather)
    report = train_dist(run, log=log, device_type=s.device, model=model, close=False, on_step=trace)
    rank, world = report["rank"], report["world_size"]
    state = named_state(report["model"], gather=gather)
    grads = named_grads(report["model"], gather=gather)
    trace.save(Path(s.out), f"rank{rank}")
    save_artifact(Path(s.out), f"rank{rank}_grad", grads, [], settings=s.record(), mode="grad")
    meta = _save(s, f"rank{rank}", state, report["losses"], mode="rank", rank=rank, world_size=world,
                 **_shape_record(_shapes(run, world)), config=run.to_dict(), start_step=report["start_step"],
                 wall_s=report["wall_s"])
    del report, model
    return meta


def run_gradref(s: GateSettings, log=print) -> dict:
    """One hand-computed token-weighted step over the profile's rank batches
    (its artifacts record steps=1, whatever s.steps asked)."""
    s = dataclasses.replace(s, steps=1)
    out = Path(s.out)
    run = make_run(out, steps=1, batch=s.batch, capacity=s.capacity, lr=s.lr, opt=s.opt, name="gradref")
    device = _device(s)
    model = build(s.seed).to(device)
    # The starting point too, so the verdict can compare the fleet's STEP
    # (after - before) with the reference step, not just the parameters.
    save_artifact(out, "init", named_state(model), [], settings=s.record(), mode="init")
    shapes = _shapes(run, s.world)
    corpus = (out / "corpus.bin").read_bytes()
    total = sum(sh.tokens for sh in shapes)
    acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    # sum_r |t_r g_r| / T per element: bounds what rounding on the wire can do
    # to the reduced gradient (see verdict.compare_gradref).
    abs_acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    local, loads = [], None
    for r, sh in enumerate(shapes):
        off = rank_byte_offset(shapes, r)  # step 0's span starts at byte 0
        x, y = _windows(corpus[off: off + sh.nbytes], sh.batch, sh.seq_len)
        model.zero_grad(set_to_none=True)
        _, loss, aux = model(x.to(device), y.to(device))
        loss.backward()
        local.append(float(loss.detach()))
        loads = aux["loads"] if loads is None else loads + aux["loads"]
        for n, p in model.named_parameters():
            if p.grad is not None:  # a missing gradient is a zero
                acc[n].add_(p.grad, alpha=sh.tokens / total)
                abs_acc[n].add_(p.grad.abs(), alpha=sh.tokens / total)
    for n, p in model.named_parameters():
        p.grad = acc[n]
    make_optimizer(model, run).step()  # the trainer's optimizer construction
    model.balance_experts(loads)
    loss = sum(sh.tokens / total * l for sh, l in zip(shapes, local))
    log(f"gradref: {len(shapes)} ranks, {total} tokens, loss={loss:.7f} local={local}")
    save_artifact(out, "gradref_grad", acc, [], settings=s.record(), mode="grad")
    save_artifact(out, "gradref_gradabs", abs_acc, [], settings=s.record(), mode="grad")
    return _save(s, "gradref", named_state(model), [loss], mode="gradref", local_losses=local,
                 **_shape_record(shapes), tokens=total, config=run.to_dict())


def replay_fleet_step(out: Path) -> dict[str, torch.Tensor]:
    """The single-process optimizer step applied to the fleet's OWN reduced
    gradient, from the common start: what the fleet's tensors must equal
    bitwise if its optimizer step is the same map (FSDP's gathered Newton-
    Schulz and sharded AdamW included). Needs init, rank0_grad, rank0_trace."""
    from dormouse.config import RunConfig
    from dormouse.gate.artifacts import load_tensors
    from dormouse.gate.trace import load_trace

    out = Path(out)
    meta = load_meta(out, "rank0")
    run = RunConfig.from_dict(meta["config"])
    # On the fleet's device: another device's kernels round differently.
    device = _device(GateSettings(out=str(out), device=meta["settings"]["device"]))
    model = build(meta["settings"]["seed"])
    model.load_state_dict(load_tensors(out, "init"))
    model.to(device)
    grads = load_tensors(out, "rank0_grad")
    for n, p in model.named_parameters():
        p.grad = grads[n].to(device)
    make_optimizer(model, run).step()
    trace = load_trace(out, "rank0")
    if trace is not None and "loads" in trace:
        model.balance_experts(trace["loads"][0].to(device))
    return named_state(model)


def _device(s: GateSettings) -> torch.device:
    """The settings' device for the in-process modes (a rank's is its local GPU)."""
    if s.device == "cuda" and not torch.cuda.is_available():
        raise DormouseError("device 'cuda' asked for but CUDA is not available: use --device cpu")
    return torch.device(s.device)


def _resume_path(s: GateSettings) -> str:
    if not s.resume_from:
        return ""
    p = Path(s.resume_from)
    return str(p if p.is_absolute() else Path(s.out) / p)


def _shapes(run, world: int) -> list[RankShape]:
    return rank_shapes(run.train.dist_capacity, world=world, batch=run.train.batch)


def _shape_record(shapes: list[RankShape]) -> dict:
    """The ranks' shapes for an artifact: lines to read, pairs to compute with."""
    return {"shapes": [sh.line() for sh in shapes], "rank_shapes": [[sh.batch, sh.seq_len] for sh in shapes]}


def _save(s: GateSettings, name: str, state, losses, **extra) -> dict:
    save_artifact(Path(s.out), name, state, losses, settings=s.record(), **extra)
    return load_meta(Path(s.out), name)


def load_plan(path: str) -> list[GateSettings]:
    """A JSON list of GateSettings fields, one fleet run each."""
    try:
        items = json.loads(Path(path).read_text())
        return [GateSettings(**item) for item in items]
    except (OSError, ValueError, TypeError) as e:
        raise DormouseError(f"plan {path!r} is not a JSON list of gate settings ({e})") from e


MODES = {"single": run_single, "rank": run_rank, "gradref": run_gradref}
