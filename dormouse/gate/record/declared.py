"""A declared sharding, for layouts whose shards are plain tensors (no
DTensor says how they assemble): hand-written (Megatron-style) tensor
parallelism and expert parallelism.

    sharding = {"moe.w1": shard(0, ep_ranks, "expert"),   # pattern -> how its parameters assemble
                "moe.w2": shard(0, ep_ranks, "expert"),
                "attn.wq.weight": shard(0, tp_group),      # "tensor" by default
                "norm.*": "replicated"}
    Recorder(..., sharding=sharding)

A pattern is an fnmatch pattern on the parameter names (`named_parameters`
of the module the Recorder records); a parameter no pattern matches is
replicated (each rank holds all of it). shard(dim, group, parallel):
  dim       the dimension the ranks' pieces are concatenated along
  group     the ranks holding the pieces, in concatenation order: a list of
            global ranks or a ProcessGroup (its ranks, in its order)
  parallel  "tensor": the group's ranks compute one replica's forward
            together and are fed the same rows (Megatron's TP);
            "expert": the group's ranks are data-parallel ranks, each fed its
            own rows, which hold different experts and exchange tokens
            (all_to_all): the experts' gradients gather every rank's tokens.

Validated when the Recorder is built, every rank together (one line on the
first problem): a malformed entry, a pattern matching no parameter, a
parameter matched by two patterns, a group that does not hold this rank or
that its ranks declare differently, pieces whose other dimensions differ,
and assembled shapes that are not build_model's (build_model called on the
meta device, the training process's random state put back: nothing is
allocated and the run is not changed).

At every recorded step each rank assembles the full tensor of each sharded
parameter (and its gradient) from its group's pieces: one all_gather over
every rank per tensor, padded to the largest piece (a collective: every rank
records the same tensors in the same order, which named_parameters' order
gives). Like a DTensor layout (layouts.py), a recording of full tensors: the
judge reads the sharding from recording.json's "layout" ("declared") and
judges each class of parameters (split, replicated) against one process."""

from __future__ import annotations

import fnmatch
import random

import torch

from dormouse.errors import DormouseError
from dormouse.gate.record.userfns import import_path

PARALLEL = ("tensor", "expert")


class ShardingError(DormouseError):
    """The declared sharding does not describe the model the Recorder records."""


def shard(dim: int, group, parallel: str = "tensor") -> dict:
    """One pattern's declaration: pieces concatenated along `dim` over `group`'s ranks (see the docstring)."""
    return {"dim": dim, "group": group, "parallel": parallel}


def _ranks(group, world: int, pattern: str) -> list[int]:
    if isinstance(group, (list, tuple)):
        ranks = list(group)
    else:  # a ProcessGroup: its global ranks in its own order
        try:
            import torch.distributed as dist

            ranks = list(dist.get_process_group_ranks(group))
        except Exception:
            raise ShardingError(f"sharding[{pattern!r}]: group {group!r} is neither a list of ranks nor a "
                                "process group of this run") from None
    if not ranks or any(type(r) is not int or not 0 <= r < world for r in ranks) or len(set(ranks)) != len(ranks):
        raise ShardingError(f"sharding[{pattern!r}]: group {ranks} is not a list of distinct ranks of this run "
                            f"(world {world})")
    return ranks


def _spec(pattern, spec, world: int) -> dict:
    """One entry, checked: {"dim", "ranks", "parallel"} or None (replicated)."""
    if not isinstance(pattern, str) or not pattern:
        raise ShardingError(f"sharding: key {pattern!r} is not a parameter-name pattern (a string such as "
                            "'layers.*.experts.w1')")
    if spec == "replicated":
        return None
    if not isinstance(spec, dict) or set(spec) != {"dim", "group", "parallel"}:
        raise ShardingError(f"sharding[{pattern!r}] = {spec!r}: write 'replicated' or shard(dim, group, parallel) "
                            "(a dict with the keys dim, group and parallel)")
    if type(spec["dim"]) is not int or spec["dim"] < 0:
        raise ShardingError(f"sharding[{pattern!r}]: dim {spec['dim']!r} is not a dimension (an int >= 0)")
    if spec["parallel"] not in PARALLEL:
        raise ShardingError(f"sharding[{pattern!r}]: parallel {spec['parallel']!r} is none of {', '.join(PARALLEL)}")
    return {"dim": spec["dim"], "ranks": _ranks(spec["group"], world, pattern), "parallel": spec["parallel"]}


def _model_shapes(build_model: str, build_kwargs: dict) -> dict[str, list[int]] | None:
    """build_model's parameter shapes, built on the meta device with the process's random state put
    back; None when it cannot be built so (the reference's rebuild then compares the shapes)."""
    try:
        fn = import_path(build_model, "build_model")
        py = random.getstate()
        try:
            import numpy as np
            npst = np.random.get_state()
        except Exception:
            np, npst = None, None
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                model = fn(**(build_kwargs or {}))
        finally:
            random.setstate(py)
            if np is not None:
                np.random.set_state(npst)
        return {n: list(p.shape) for n, p in model.named_parameters()}
    except Exception:
        return None


def validate(sharding, shapes: dict[str, list[int]], rank: int, world: int) -> dict[str, dict]:
    """This rank's parameters that are sharded: {name: {"dim", "ranks", "parallel", "pattern"}}
    (one line on a bad declaration; `shapes`: this rank's parameter shapes)."""
    if not isinstance(sharding, dict) or not sharding:
        raise ShardingError(f"sharding={sharding!r}: declare a dict of parameter-name pattern -> 'replicated' or "
                            "shard(dim, group, parallel)")
    specs = {p: _spec(p, s, world) for p, s in sharding.items()}
    out: dict[str, dict] = {}
    seen: dict[str, str] = {}
    for pattern, spec in specs.items():
        hits = [n for n in shapes if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ShardingError(f"sharding[{pattern!r}] matches no parameter of the recorded model (its names: "
                                f"{', '.join(list(shapes)[:4])}{', ...' if len(shapes) > 4 else ''})")
        for n in hits:
            if n in seen:
                raise ShardingError(f"parameter {n} is matched by two patterns of the sharding, {seen[n]!r} and "
                                    f"{pattern!r}: declare each parameter once")
            seen[n] = pattern
            if spec is None:
                continue
            if rank not in spec["ranks"]:
                raise ShardingError(f"sharding[{pattern!r}]: rank {rank} holds {n} but is not in its group "
                                    f"{spec['ranks']}: each rank declares the group its own piece belongs to")
            if spec["dim"] >= len(shapes[n]):
                raise ShardingError(f"sharding[{pattern!r}]: {n} has {len(shapes[n])} dimension(s), no dim "
                                    f"{spec['dim']}")
            out[n] = {**spec, "pattern": pattern}
    return out


def assembled_shapes(mine: list[dict], shapes: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Every parameter's full shape from every rank's sharded entries (`mine[r]`, validate's) and local
    shapes (`shapes[r]`), checked alike on every rank (one line on the first inconsistency)."""
    names = list(shapes[0])
    for r, s in enumerate(shapes):
        if list(s) != names:
            raise ShardingError(f"rank {r}'s model has other parameters than rank 0's: every rank records the same "
                                "model, each holding its own pieces")
        if set(mine[r]) != set(mine[0]):
            odd = min(set(mine[r]) ^ set(mine[0]))
            on, off = (0, r) if odd in mine[0] else (r, 0)
            raise ShardingError(f"{odd} is declared sharded on rank {on} but not on rank {off}: every rank "
                                "declares the same sharding")
    full: dict[str, list[int]] = {}
    for n in names:
        if n not in mine[0]:
            full[n] = list(shapes[0][n])
            continue
        for r in range(len(shapes)):
            spec = mine[r][n]
            for q in spec["ranks"]:
                if mine[q][n]["ranks"] != spec["ranks"] or mine[q][n]["dim"] != spec["dim"] \
                        or mine[q][n]["parallel"] != spec["parallel"]:
                    raise ShardingError(f"{n}: rank {r} declares it over {spec['ranks']} along dim {spec['dim']} "
                                        f"({spec['parallel']}), rank {q} over {mine[q][n]['ranks']} along dim "
                                        f"{mine[q][n]['dim']} ({mine[q][n]['parallel']}): a group's ranks declare "
                                        "it alike")
        for r in range(len(shapes)):
            spec = mine[r][n]
            d, pieces = spec["dim"], [shapes[q][n] for q in spec["ranks"]]
            if any(len(p) != len(pieces[0]) or p[:d] + p[d + 1:] != pieces[0][:d] + pieces[0][d + 1:] for p in pieces):
                raise ShardingError(f"{n}: the pieces of ranks {spec['ranks']} have shapes {pieces}, which do not "
                                    f"concatenate along dim {d}")
            shape = list(pieces[0])
            shape[d] = sum(p[d] for p in pieces)
            if n in full and full[n] != shape:
                raise ShardingError(f"{n} assembles to {full[n]} on one group and {shape} on another: every group "
                                    "holds the whole parameter")
            full[n] = shape
    return full


class DeclaredLayout:
    """This rank's view of a declared sharding (see the module docstring)."""

    def __init__(self, module, sharding, rank: int, world: int, gather, build_model: str, build_kwargs: dict):
        self.rank, self.world = rank, world
        shapes = {n: list(p.shape) for n, p in module.named_parameters()}
        mine = validate(sharding, shapes, rank, world)
        every = gather({"mine": mine, "shapes": shapes})
        full = assembled_shapes([e["mine"] for e in every], [e["shapes"] for e in every])
        built = _model_shapes(build_model, build_kwargs)
        if built is not None:
            for n, shape in full.items():
                if n in built and built[n] != shape:
                    how = (f"assembled by the sharding ({mine[n]['pattern']!r}: dim {mine[n]['dim']} over ranks "
                           f"{mine[n]['ranks']}) to" if n in mine else
                           "held whole (replicated: no pattern shards it) as")
                    raise ShardingError(f"{n} is {how} shape {shape}, but build_model's is {built[n]}: declare the "
                                        "dimension and group its pieces concatenate along")
        self.sharded = mine
        self.numel = {n: [int(torch.Size(e["shapes"][n]).numel()) for e in every] for n in mine}
        self.shapes = [e["shapes"] for e in every]
        # the ranks fed the same rows as this one: its tensor-parallel groups (an expert group's ranks read their own)
        group = {rank}
        for spec in mine.values():
            if spec["parallel"] == "tensor":
                group |= set(spec["ranks"])
        self.group = sorted(group)
        self.leader = self.group[0]
        self._every_mine = [e["mine"] for e in every]
        self._full_shapes = full

    def full(self, t: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """The whole tensor on the CPU, a copy of its own: a sharded parameter's (or its gradient's) pieces
        gathered from its group (a collective: every rank, same order), anything else as it is."""
        t = t.detach()
        spec = self.sharded.get(name) if name is not None else None
        if spec is None:
            out = t.cpu().contiguous()
            return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out
        import torch.distributed as dist

        size = max(self.numel[name])
        flat = torch.zeros(size, dtype=t.dtype, device=t.device)
        flat[:t.numel()] = t.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(parts, flat)
        pieces = [parts[q][:self.numel[name][q]].reshape(self.shapes[q][name]) for q in spec["ranks"]]
        return torch.cat(pieces, dim=spec["dim"]).cpu()

    def meta(self, groups: list[list[int]]) -> dict:
        """recording.json's "layout": the declaration, each parameter's placement, every rank's group."""
        decl: dict[str, dict] = {}
        for r, mine in enumerate(self._every_mine):
            for n, s in mine.items():
                d = decl.setdefault(s["pattern"], {"dim": s["dim"], "parallel": s["parallel"], "groups": []})
                if s["ranks"] not in d["groups"]:
                    d["groups"].append(s["ranks"])
        params = {}
        for n in self._full_shapes:
            s = self.sharded.get(n)
            params[n] = ({"mesh": None, "placements": ["plain"], "model_parallel": False} if s is None else
                         {"mesh": None, "placements": [f"declared: dim {s['dim']} over ranks {s['ranks']}"],
                          "model_parallel": True, "parallel": s["parallel"], "pattern": s["pattern"]})
        return {"declared": decl, "meshes": [], "data_dims": [], "groups": groups, "params": params}


def of(module, sharding, rank: int, world: int, gather, build_model: str,
       build_kwargs: dict | None) -> tuple[DeclaredLayout, dict]:
    """The DeclaredLayout of `module` and its recording.json entry (`gather(obj)`: every rank's obj)."""
    lay = DeclaredLayout(module, sharding, rank, world, gather, build_model, build_kwargs or {})
    groups = sorted({tuple(g) for g in gather(lay.group)})
    return lay, lay.meta([list(g) for g in groups])
