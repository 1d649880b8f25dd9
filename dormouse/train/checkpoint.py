"""Checkpoints: atomic to write, exact to resume.

A checkpoint holds the model's state_dict (parameters and the routing bias),
the optimizer's name-keyed state, the number of steps done, and the run's
configuration. Nothing else is needed to continue bit for bit: the data a step
reads and its learning rate are functions of the step number, and training
draws no random numbers.

Replicated runs (one process, or a fleet whose ranks all hold the same
parameters) write one file, `<out_dir>/<ckpt_name>.pt`, from the main process
only, through a temporary file and an atomic rename; it loads with
`torch.load(weights_only=True)`. Sharded runs (FSDP2) write a
torch.distributed.checkpoint directory, `<ckpt_name>.dcp`, each rank its own
shards, into a temporary directory that the main rank renames into place once
every rank has finished.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Protocol

import torch

from dormouse import atomic
from dormouse.config import RunConfig
from dormouse.errors import CheckpointError

FORMAT = 1


class Peers(Protocol):
    """What checkpointing needs to know of the processes around it."""

    is_main: bool  # the one process that writes shared files
    sharded: bool  # parameters are FSDP2 shards

    def barrier(self) -> None: ...


def checkpoint_path(run: RunConfig, sharded: bool) -> Path:
    suffix = ".dcp" if sharded else ".pt"
    return Path(run.train.out_dir) / f"{run.train.ckpt_name}{suffix}"


def save_checkpoint(path: Path, *, model, opt, step: int, run: RunConfig, peers: Peers) -> Path:
    meta = {"format": FORMAT, "step": step, "config": run.to_dict()}
    if not peers.sharded:
        if peers.is_main:
            payload = {"meta": json.dumps(meta), "model": model.state_dict(), "optim": opt.state_dict()}
            atomic.torch_save(payload, path)
        peers.barrier()
        return path

    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(f".{path.name}.tmp")
    if peers.is_main and tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed mid-save
    peers.barrier()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp))
    peers.barrier()
    if peers.is_main:
        atomic.write_text(tmp / "meta.json", json.dumps(meta))
        # Swap in the new directory: the old one is kept as .old until the new
        # one is in place, and find_checkpoint falls back to .old, so a kill
        # between the two renames loses nothing.
        old = _previous(path)
        shutil.rmtree(old, ignore_errors=True)  # a leftover of a run killed mid-swap
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    peers.barrier()
    return path


def find_checkpoint(run: RunConfig, sharded: bool) -> Path | None:
    """The checkpoint a resuming run starts from: train.resume_from if set
    (it must exist), else this run's own checkpoint in either format (a fleet
    may resume what one process wrote, and the other way round), else None."""
    if run.train.resume_from:
        path = Path(run.train.resume_from)
        if not path.exists():
            raise CheckpointError(f"resume_from {str(path)!r} does not exist: point it at a .pt file or .dcp directory")
        return path
    native, other = checkpoint_path(run, sharded), checkpoint_path(run, not sharded)
    for candidate in (native, other, _previous(checkpoint_path(run, True))):
        if candidate.exists():
            return candidate
    return None


def _previous(path: Path) -> Path:
    """Where a sharded checkpoint waits while its successor is swapped in."""
    return path.with_name(f".{path.name}.old")


def load_checkpoint(path: Path, *, model, opt, run: RunConfig, peers: Peers) -> int:
    """Restore model and optimizer from `path`; returns the number of steps done.

    Any checkpoint fits any topology: a .pt file holds whole tensors, which a
    sharded model takes its own rows of; a .dcp directory is resharded by
    torch.distributed.checkpoint into whatever tensors it is loaded into
    (whole ones in a single process, shards under FSDP2)."""
    if path.is_dir():
        return _load_dcp(path, model=model, opt=opt, run=run)
    payload, meta = _read_pt(path)
    _check_same_network(meta, run, path)
    if peers.sharded:
        _copy_whole_into(model.state_dict(), payload["model"], path)
        _copy_whole_into(_flat(opt.state_dict()), _flat(payload["optim"]), path)
    else:
        _load_model(model, payload["model"], path)
        _load_optim(opt, payload["optim"], path)
    return int(meta["step"])


def load_model_weights(path: Path, *, build) -> tuple[object, RunConfig, int]:
    """The trained model alone (for sampling and evaluation): the RunConfig is
    read from the checkpoint, `build(run)` makes the model, whose weights are
    then loaded (whole tensors, whichever topology wrote them). Returns
    (model, run, steps done)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist: point at a .pt file or a .dcp directory")
    if path.is_dir():
        meta = _read_dcp_meta(path)
        run = RunConfig.from_dict(meta["config"])
        model = build(run)
        state = {"model": model.state_dict()}
        _dcp_load(state, path)
        _load_model(model, state["model"], path)
        return model, run, int(meta["step"])
    payload, meta = _read_pt(path)
    run = RunConfig.from_dict(meta["config"])
    model = build(run)
    _load_model(model, payload["model"], path)
    return model, run, int(meta["step"])


def _read_pt(path: Path) -> tuple[dict, dict]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        meta = json.loads(payload["meta"])
    except Exception as e:  # a torn or foreign file: say so, not a traceback
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({e.__class__.__name__}: {first})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {meta.get('format')}, expected {FORMAT}")
    return payload, meta


def _read_dcp_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"sharded checkpoint {str(path)!r} has no readable meta.json ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {meta.get('format')}, expected {FORMAT}")
    return meta


def _dcp_load(state: dict, path: Path) -> None:
    """Load `state` in place from a DCP directory, resharded to its tensors
    (whole ones in a single process, which DCP announces with a warning even
    when asked for explicitly)."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def _load_dcp(path: Path, *, model, opt, run: RunConfig) -> int:
    meta = _read_dcp_meta(path)
    _check_same_network(meta, run, path)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    _dcp_load(state, path)
    _load_model(model, state["model"], path)
    return int(meta["step"])


def _flat(optim_sd: dict) -> dict:
    return {f"{n}.{k}": t for n, s in optim_sd.items() for k, t in s.items()}


def _copy_whole_into(targets: dict, whole: dict, path: Path) -> None:
    """Copy whole tensors into (possibly sharded) targets: a DTensor keeps its
    own rows (Replicate -> Shard is a local slice, no communication)."""
    missing = sorted(set(targets) - set(whole))
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks {missing[:3]}: it does not fit this model")
    with torch.no_grad():
        for name, t in targets.items():
            src = whole[name]
            if hasattr(t, "placements"):
                from torch.distributed.tensor import DTensor, Replicate

                src = DTensor.from_local(src.to(t.device, t.dtype), t.device_mesh, [Replicate()],
                                         run_check=False).redistribute(t.device_mesh, t.placements)
                t.to_local().copy_(src.to_local())
            else:
                t.copy_(src)


def _check_same_network(meta: dict, run: RunConfig, path: Path) -> None:
    saved = RunConfig.from_dict(meta["config"])
    ours = run.model
    diffs = [f"model.{k}: saved {v!r}, now {getattr(ours, k)!r}"
             for k, v in vars(saved.model).items() if getattr(ours, k) != v]
    if saved.train.opt != run.train.opt:
        diffs.append(f"train.opt: saved {saved.train.opt!r}, now {run.train.opt!r}")
    if saved.train.muon_variant != run.train.muon_variant:
        diffs.append(f"train.muon_variant: saved {saved.train.muon_variant!r}, now {run.train.muon_variant!r}")
    # Checkpoints from before data_order existed were written by sequential runs.
    order = meta["config"].get("train", {}).get("data_order", "sequential")
    if order != run.train.data_order:
        diffs.append(f"train.data_order: saved {order!r}, now {run.train.data_order!r} (the run would read other bytes)")
    if diffs:
        raise CheckpointError(
            f"checkpoint {str(path)!r} belongs to another configuration ({'; '.join(diffs[:3])}): "
            "resume with the configuration that made it, or use a fresh out_dir/ckpt_name"
        )


def _load_model(model, sd: dict, path: Path) -> None:
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: {e}") from e


def _load_optim(opt, sd: dict, path: Path) -> None:
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from e
