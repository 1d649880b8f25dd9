"""The Recorder: what any training loop calls so the gate can judge it.

    rec = Recorder(out_dir, model, build_model="pkg.mod:fn", build_optimizer="pkg.mod:fn",
                   objective="causal_lm")
    for each optimizer step:
        ... forwards and backwards (gradient accumulation, DDP/FSDP2 synchronisation) ...
        rec.step(loss=reported_loss, lr=current_lr, optimizer=opt)   # after the LAST backward, before opt.step()
        opt.step(); ...
    rec.close()

Construction registers a forward PRE-hook on the model (on `model.module` under
DDP): every forward in training mode appends its batch (positional tensor
arguments as "arg0", "arg1", ..., and the keyword tensors named in `inputs`,
plus "idx"/"example_id" when the loop passes them) to the current step's
micro-batch list, detached, on the CPU, with the autocast its forward runs
under (read there and, for a wrapper that enters autocast inside the call,
in pre-hooks on the submodules: the reference computes each micro-batch
under the same autocast), and the dtype its parameters were cast to for the
forward where they were (FSDP2's MixedPrecisionPolicy: the submodules'
pre-hooks see the unsharded, cast parameters). The loop's data code is
untouched.
Eval-mode forwards, and forwards with gradients disabled (torch.no_grad(),
inference_mode: a metric or a logged probe loss), are ignored. Beyond its
tensors, each forward's non-tensor arguments of plain types (a bool keyword)
and the modules' public plain attributes that differ from their values when
the Recorder started (a flag the loop set) go into the step's JSON ("call",
"attrs"; the start's into recording.json); `rec.labels(labels)` after a
forward adds the labels the loop's loss reads and the model is not given.
The hooks sit on the module under any DDP and torch.compile wrappers and run
eagerly under torch.compile (a graph break, not a dynamo trace of them).

Per step and rank it writes (names: dormouse.gate.artifacts) the micro-batches,
the parameters before the step, the gradient on the parameters at rec.step()
(synchronised; before clipping unless the loop says it clipped, by passing
`clip_coef` or `grad_norm` with max_grad_norm > 0: then the gradient is the
clipped one the optimizer applies and `clip_coef` says by how much), the lr,
the loop's reported loss, the parameters with no gradient, a sha256 of the
parameters (ranks equal), and (full-tensor steps) the module's persistent
buffers before the step ("b/": state outside the optimizer, e.g. a routing
bias, which the reference loads with the parameters; after the last step
too, in final.safetensors). Every file is written atomically, the JSON last.

State outside the optimizer that moves by a rule of its own (dormouse's MoE
routing bias, moved after each step by that step's expert loads) is judged
when the loop declares the rule, `buffer_update="pkg.mod:fn"`:
fn(model, batches, **build_kwargs) gets the model holding the recorded
parameters and buffers before a step and every rank's micro-batches of that
step (rank then micro order) and returns {buffer name: its value after the
step}; the reference writes that, and the judge compares it bitwise with the
buffers recorded before the next step (full-tensor recordings).

Scale: `sketch=k > 0` stores, instead of each tensor x, its CountSketch
S x in R^k: each element i goes to bucket h(i) in [0, k) with sign s(i), both
seeded by (seed, tensor name, global index), so (S x)_j = sum_{h(i)=j} s(i) x_i.
It is linear (FSDP2 shards sketch to partial sums that add up to the full
tensor's sketch) and E||S d||^2 = ||d||^2 with Var <= 2 ||d||^4 / k, so a
relative difference r between two tensors shows in their sketches as about r.
`every=k` stores tensors at steps 1, 1+k, 1+2k, ... (the micro-batches and
the step's JSON at every step, so the reference can train the run itself).

Under FSDP2 (DTensor parameters, Shard(0)) each rank stores its local shard
and the placement (dim, global shape) in init.safetensors' metadata; the
reference assembles full tensors.

A tensor-parallel or 2-D (FSDP2 x TP) model is recorded through its DTensor
layout, and a pipeline stage through `pipeline_stage` (record/layouts.py); the
probe (record/probe.py, `probe_steps`) records every module's output and output
gradient on a probed step's first micro-batch.

A loop that resumes from a checkpoint records into the same directory with
`resume=True` (continue after the last recorded step) or `resume=K` (the
checkpoint holds the state after step K): a new segment.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from dormouse import atomic
from dormouse.clip import clip_coef as clip
from dormouse.digest import fingerprint
from dormouse.gate import artifacts as A
from dormouse.gate.record import declared, layouts, probe
from dormouse.gate.record.options import (
    EXAMPLE_ID_KEYS,
    INPUTS,
    LOSS_LABELS,
    NEUTRAL_ATTRS,
    OBJECTIVES,
    PLAIN,
    RecorderError,
    check_options,
)
from dormouse.gate.record.provenance import provenance
from dormouse.gate.record.sketch import Sketcher, sketch_buckets
from dormouse.gate.record.userfns import code_hashes
from dormouse.gate.record.writer import Writer


def _local(t: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """This rank's part of t on the CPU, always a copy: the digest's .numpy()
    marks a storage non-resizable, and FSDP2 resizes the storage of its
    unsharded parameters (a live one, after a no-grad forward at world 1)."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    out = t.cpu().contiguous()
    return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t as it is (a view: a DTensor's local shard), for
    sketching, which reads it once into a copy of its own."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _placement(t) -> dict | None:
    """Shard(dim) and the global shape of a DTensor (None for a plain tensor)."""
    if not hasattr(t, "placements"):
        return None
    from torch.distributed.tensor import Replicate, Shard

    shards = [p for p in t.placements if isinstance(p, Shard)]
    if any(not isinstance(p, (Shard, Replicate)) for p in t.placements) or len(shards) > 1:
        raise RecorderError(f"placements {t.placements} are not supported: the Recorder records FSDP2's Shard(0)")
    if not shards:
        return None
    return {"dim": shards[0].dim, "shape": list(t.shape)}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    return fingerprint(tensors)  # the judge recomputes it from the recorded tensors



def _autocast_state(device_type: str) -> dict | None:
    """The autocast a forward on `device_type` runs under now: {"device_type",
    "dtype"} (e.g. "cpu", "bfloat16"), or None when autocast is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return {"device_type": device_type, "dtype": str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")}


def _hf_config(model) -> dict | None:
    """A transformers model's config (PretrainedConfig) as its scalar fields, else None."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    try:
        d = cfg.to_dict()
    except Exception:  # not a config we can read: nothing to rebuild from it
        return None
    return {k: v for k, v in d.items() if v is None or isinstance(v, (bool, int, float, str))}


def plain_attrs(model) -> dict[str, dict]:
    """Each module's public attributes of plain types (bool, int, float, str,
    None): {module path ("" the model): {name: value}}. A flag a loop sets on
    the model (a branch switch) is a value the forward reads."""
    out = {}
    for path, m in model.named_modules():
        d = {k: v for k, v in vars(m).items()
             if not k.startswith("_") and k not in NEUTRAL_ATTRS and type(v) in PLAIN}
        if d:
            out[path] = d
    return out


def attr_changes(now: dict, then: dict) -> dict | None:
    """The attributes of `now` whose value (or type) differs from `then`'s; None when none."""
    out = {}
    for path, d in now.items():
        old = then.get(path, {})
        diff = {k: v for k, v in d.items() if k not in old or type(old[k]) is not type(v) or old[k] != v}
        if diff:
            out[path] = diff
    return out or None


def core_module(model):
    """The module a wrapper runs: under DDP its .module, under torch.compile
    its _orig_mod (in any order: compile(DDP(m)), DDP(compile(m)))."""
    ddp = torch.nn.parallel.DistributedDataParallel
    while True:
        if isinstance(model, ddp):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _eager(fn):
    """fn run as plain Python under torch.compile (the Recorder's hooks copy
    tensors to the CPU and keep lists: nothing for dynamo to trace; a graph
    break there, not a crash of the run)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _number(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        return float(x.detach().float().item())
    return float(x)


class Recorder:
    """Records a training loop's steps for the gate (see the module docstring).

    out_dir          where the recording goes (one run per directory)
    model            the model the loop trains (a DDP wrapper is unwrapped; FSDP2 modules as they are)
    build_model      "pkg.mod:fn": fn(**build_kwargs) returns the same initial model in a fresh process
    build_optimizer  "pkg.mod:fn": fn(model, **build_kwargs) returns the optimizer, or (optimizer, lr_scheduler)
    objective        causal_lm | token_mean | example_mean | "pkg.mod:fn" with fn(model, batch) -> (loss_sum, count)
    max_grad_norm    the loop's clipping threshold (0 = no clipping)
    dataset_len      examples in the dataset (0 = unknown: the epoch check is skipped, and says so)
    sketch           0 = full tensors; k > 0 = a CountSketch of k numbers per tensor
    every            tensors at every `every`-th step (micro-batches at every step)
    inputs           which forward keyword arguments are the batch
    build_kwargs     JSON-able keyword arguments for build_model and build_optimizer (a configured run)
    resume           False = a fresh recording; True = a new segment after the last recorded step;
                     an int K = a new segment after step K (the checkpoint's step)
    seed             the sketches' seed
    buffer_update    None, or "pkg.mod:fn": the rule that moves persistent buffers after a step,
                     fn(model, batches, **build_kwargs) -> {name: buffer after the step} (module docstring)
    pipeline_stage   None, or this rank's torch.distributed.pipelining PipelineStage (model: its module):
                     stage 0's forwards are the data, each stage records its own parameters (layouts.py)
    probe_steps      the steps whose first micro-batch is probed module by module (record/probe.py):
                     None = the first recorded step (none under pipeline_stage or sharding), () = none
    sharding         None, or a declared sharding of plain-tensor shards (record/declared.py: hand-written
                     tensor parallelism, expert parallelism): {pattern: "replicated" | shard(dim, group, parallel)}
    example_corpus   None, or a file of bytes whose byte offsets the loop's example ids are (each row
                     its input tokens read from that offset, as dormouse's loop reads its windows):
                     the data check then requires every recorded row to be those bytes
    objective_scope  what the objective is a function of (SCOPES): "example" (each row alone, the
                     default), "forward" (each forward's own statistics, declared), "step"
                     (objective fn(model, batches) over every rank's micro-batches of the step)
    wire             how the gradient's reduce rounds (WIRES): "fp32", or "bf16" when every summand is
                     rounded to bfloat16 on the wire (DDP's bf16_compress_hook): the gradient is then
                     judged element by element against that rounding's bound, and for bias
    start            a fresh recording's first step is start + 1 (a run continued from a checkpoint of
                     another run: build_model and build_optimizer must then rebuild the state after
                     step `start`, and the scheduler its lr from there)
    context_parallel None, or dict(group=<the CP process group>, seq_dim=1, order="contiguous" | "load_balanced"):
                     each rank's inputs are a shard of its CP group's rows along seq_dim; the leader records
                     the group's global rows, assembled in the declared order (record/layouts.py)
    selfcheck        0 = off; k > 0 = the reference-free checks inside the run, every step (record/selfcheck.py):
                     each rank's local gradient read at k elements of each tensor before the reduce and the
                     synchronised gradient against their reduction, replicas' parameters equal, the logged
                     loss against rec.step(loss_sum=, tokens=); written with the step ("selfcheck", sl/ ss/ sp/)
    stop_on_fail     raise one RecorderError on every rank at the first step those checks mark wrong (they
                     run at k = 64 unless selfcheck says otherwise); the recording is closed before that step
    reduction        "mean" (DDP's and FSDP2's default) or "sum": how the loop reduces the gradients
    reports          the loop calls rec.report() after every step (the HF callback): the step's marker for a
                     follower (`gate check --follow`) is written after the report, not at rec.step()
    extra            None, or a JSON object kept in recording.json as "extra" (rec.extra, until close;
                     a resumed segment starts from the earlier one's): what a client keeps beside the
                     run (dormouse's own gate: its settings, provenance and evals); no fact reads it
                     but a client's own
    """

    def __init__(self, out_dir, model, *, build_model: str, build_optimizer: str, objective: str = "causal_lm",
                 max_grad_norm: float = 0.0, dataset_len: int = 0, sketch: int = 0, every: int = 1,
                 inputs=INPUTS, build_kwargs: dict | None = None, resume: bool | int = False, seed: int = 0,
                 buffer_update: str | None = None, example_corpus: str | None = None,
                 objective_scope: str = "example", probe_steps=None, pipeline_stage=None, sharding=None,
                 selfcheck: int = 0, stop_on_fail: bool = False, reduction: str = "mean", reports: bool = False,
                 wire: str = "fp32", extra: dict | None = None, start: int = 0, context_parallel=None):
        self.spec = check_options(
            build_model=build_model, build_optimizer=build_optimizer, objective=objective,
            max_grad_norm=max_grad_norm, dataset_len=dataset_len, sketch=sketch, every=every, inputs=inputs,
            build_kwargs=build_kwargs, seed=seed, buffer_update=buffer_update, example_corpus=example_corpus,
            objective_scope=objective_scope, probe_steps=probe_steps, selfcheck=selfcheck, stop_on_fail=stop_on_fail,
            reduction=reduction, reports=reports, wire=wire, extra=extra, start=start)
        if pipeline_stage is not None and int(sketch):  # each stage's sketches would need summing by name
            raise RecorderError(f"sketch={sketch} with pipeline_stage: a pipeline is recorded in full tensors "
                                "(sketch=0)")
        if sharding is not None and (int(sketch) or pipeline_stage is not None or probe_steps):
            raise RecorderError(f"sharding with sketch={sketch}, pipeline_stage or probe_steps: a declared sharding is "
                                "recorded in full tensors (sketch=0), without a pipeline, and not probed")
        self.out = Path(out_dir)
        self.module = core_module(model)  # under DDP and torch.compile wrappers, in any order
        import torch.distributed as dist

        self._dist = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self._dist else (0, 1)
        self.sketch_k, self.every, self.seed = int(sketch), int(every), int(seed)
        self.max_grad_norm = float(max_grad_norm)
        self.inputs = tuple(inputs) + tuple(k for k in EXAMPLE_ID_KEYS if k not in inputs)
        self.batches: list[dict[str, torch.Tensor]] = []
        # each micro-batch's autocast ({"device_type", "dtype"} or None), read in the pre-hook:
        # the reference computes the micro-batch under the same one
        self.autocasts: list[dict | None] = []
        # each micro-batch's compute dtype where the forward ran on parameters cast from the
        # stored ones (FSDP2's MixedPrecisionPolicy(param_dtype=...)), else None: the reference
        # computes that micro-batch on a copy of the model cast the same way
        self.casts: list[str | None] = []
        # each micro-batch's submodules in eval mode (a frozen BatchNorm, a dropout switched off),
        # None when none is: the reference sets the same modes, not model.train()'s all-training
        self.evals: list[list[str] | None] = []
        # each micro-batch's non-tensor forward arguments (a bool keyword that switches a branch) and the
        # model's plain attributes that differ from the Recorder's start (a flag the loop set), or None
        self.calls: list[dict | None] = []
        self.attrs: list[dict | None] = []
        self._submodules = [(n, m) for n, m in self.module.named_modules() if n]
        p = next(self.module.parameters(), None)
        self._device_type = p.device.type if p is not None else "cpu"
        self._sketcher = Sketcher(int(sketch))
        self.closed = False

        prior = self._prior(resume)
        if prior is None:
            run = uuid.uuid4().hex if self.rank == 0 else None
            run = self._broadcast(run)
            if not isinstance(start, int) or isinstance(start, bool) or start < 0:
                raise RecorderError(f"start={start!r}: the number of steps done before this recording (an int >= 0)")
            self.k = start
            segments = []
            self._clear()
        else:
            run = prior["run"]
            last = max(A.recording_steps(prior), default=0)
            self.k = last if resume is True else int(resume)
            if resume is not True and self.k > last:
                raise RecorderError(f"resume={resume} but the recording in {self.out} ends at step {last}")
            segments = prior["segments"]
        self.run = run
        self.segment = len(segments)
        self.extra = {**((prior or {}).get("extra") or {}), **(extra or {})}  # recording.json's "extra"
        params = {n for n, _ in self.module.named_parameters()}
        # persistent buffers (state outside the optimizer, e.g. a routing bias): "b/" at tensor steps
        self._buffers = [n for n in self.module.state_dict() if n not in params]
        # a tensor-parallel (or 2-D) layout: full tensors, each DP replica's micro-batches once (layouts.py)
        if context_parallel is not None and (pipeline_stage is not None or sharding is not None):
            raise RecorderError("context_parallel with pipeline_stage or sharding: a context-parallel run is "
                                "recorded with its parameters replicated (no pipeline, no declared sharding)")
        self.layout, layout_meta = (layouts.pipeline(pipeline_stage, self.module, self.rank, self._gather)
                                    if pipeline_stage is not None else
                                    layouts.context_parallel(context_parallel, self.module, self.rank, self._gather)
                                    if context_parallel is not None else
                                    declared.of(self.module, sharding, self.rank, self.world, self._gather,
                                                build_model, build_kwargs) if sharding is not None else
                                    layouts.of(self.module, self.rank, self.world, self._gather))
        self._full = (self.layout.full if sharding is not None else layouts.full if self.layout is not None
                      else _local)  # _full(tensor, name): a declared sharding assembles by parameter name
        placements = {} if self.layout is not None else {n: _placement(t) for n, t in self.module.state_dict().items()}
        self.placements = {n: p for n, p in placements.items() if p}
        self.meta = {
            "schema": A.RECORDING_SCHEMA, "kind": "recording", "run": run, "world": self.world,
            "segments": segments + [{"start": self.k + 1, "end": None, "world": self.world,
                                     "resumed": prior is not None}],
            "build_model": build_model, "build_optimizer": build_optimizer, "build_kwargs": build_kwargs or {},
            "objective": objective, "objective_scope": objective_scope, "wire": wire, "buffer_update": buffer_update, "max_grad_norm": self.max_grad_norm, "dataset_len": int(dataset_len),
            "example_corpus": str(Path(example_corpus).resolve()) if example_corpus else None,
            "example_corpus_sha256": A.file_hash(example_corpus) if example_corpus else None,
            "sketch": self.sketch_k, "every": self.every, "seed": self.seed, "inputs": list(self.inputs),
            "fsdp": bool(self.placements), "closed": False, "layout": layout_meta,
            # the model as the loop runs it, beyond its tensors: the parameters it froze, and a
            # Hugging Face config's runtime fields (the Trainer sets use_cache = False, which
            # decides how GPT-2 masks packed sequences): the reference rebuilds the same
            "frozen": [n for n, q in self.module.named_parameters() if not q.requires_grad],
            "hf_config": _hf_config(self.module),
            # the modules' plain attributes at the start (the reference sets those build_model's differ in)
            "attrs": plain_attrs(self.module),
            "provenance": provenance(device=self._device_type,
                                     code=code_hashes([build_model, build_optimizer, objective, buffer_update])),
            "extra": self.extra,
        }
        if prior is None:
            # clone: tied weights (GPT-2's lm_head and wte) are one tensor under two names,
            # which safetensors refuses to store as shared memory
            state = {n: self._full(t, n).clone() for n, t in self.module.state_dict().items()}
            atomic.write_bytes(A.init_path(self.out, self.rank),
                               st_save(state, metadata={"placements": json.dumps(self.placements)}))
        self._write_recording()
        if self.sketch_k:  # the buckets once, here, so that no step pays for them
            named = list(self.module.named_parameters())
            self._sketch_all({n: self._piece(p) for n, p in named}, {n: p.numel() for n, p in named})
        self._writer = Writer()
        self._attrs0 = self.meta["attrs"]
        # the probe's steps (record/probe.py): its hooks go before the Recorder's own pre-hook
        self._probe_steps = ({self.k + 1} if pipeline_stage is None and sharding is None else set()) \
            if probe_steps is None else {int(x) for x in probe_steps}  # a pipeline's stages, a declared
        # sharding's pieces are not probed (docs/parallelisms.md)
        self._probe = probe.Probe(self.module) if self._probe_steps else None
        # the hooks run eagerly under torch.compile (a graph break, in any placement of the compile)
        self._hook = self.module.register_forward_pre_hook(_eager(self._pre), with_kwargs=True)
        if isinstance(self.layout, layouts.PipelineLayout):  # a stage's forwards no backward reaches: not data
            self.layout.watch(self.module, lambda: len(self.batches))
        # autocast is read inside the forward too: a wrapper may enter it after the model's
        # pre-hook ran (accelerate, and so HF's Trainer with bf16=True, wraps model.forward)
        inner = _eager(self._inner)
        self._inner_hooks = [m.register_forward_pre_hook(inner)
                             for m in self.module.modules() if m is not self.module]
        # each module's own parameters' stored dtypes (under FSDP2 the sharded ones): a forward that
        # sees another dtype runs on a cast copy
        self._stored = {m: {n: p.dtype for n, p in m._parameters.items() if p is not None}
                        for m in self.module.modules()}
        # the reference-free checks inside the run (record/selfcheck.py) and the follower's step markers
        self.stop_on_fail, self._reports, self._marked = bool(stop_on_fail), bool(reports), self.k
        self._watch = None
        if selfcheck or stop_on_fail:
            if isinstance(selfcheck, bool) or not isinstance(selfcheck, int) or selfcheck < 0:
                raise RecorderError(f"selfcheck={selfcheck!r}: the sketch size of the in-run checks (an int >= 0)")
            if reduction not in ("mean", "sum"):
                raise RecorderError(f"reduction={reduction!r}: 'mean' (DDP's and FSDP2's default) or 'sum'")
            if self.layout is not None:
                raise RecorderError("selfcheck / stop_on_fail with a tensor-parallel, pipeline or declared layout: "
                                    "the in-run checks cover DDP and FSDP2 (Shard(0)); record this run without them")
            from dormouse.gate.record.selfcheck import Watch

            self._watch = Watch(self.module, k=int(selfcheck) or 64, seed=self.seed, rank=self.rank,
                                world=self.world, placements=self.placements, wire=wire, reduction=reduction,
                                dist=self._dist, step=self.k + 1)

    # ------------------------------------------------------------------ plumbing

    def _broadcast(self, obj):
        if not self._dist:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj) -> list:
        if not self._dist:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def _piece(self, t):
        """What a sketch reads of t: this rank's shard, or (a layout) the full tensor."""
        return self._full(t) if self.layout is not None else _shard(t)

    def _barrier(self):
        if self._dist:
            import torch.distributed as dist

            dist.barrier()

    def _prior(self, resume) -> dict | None:
        if resume is False or resume is None:
            return None
        path = A.recording_path(self.out)
        if not path.exists():
            raise RecorderError(f"resume={resume} but {self.out} holds no recording.json: record the first "
                                "segment there (resume=False)")
        prior = A.read_json(path, "recording")
        segs = prior["segments"]
        if segs and segs[-1].get("end") is None:  # that segment crashed: its steps are the files it left
            done = [json.loads(p.read_text()) for p in A.step_files(self.out, 0)]
            ends = [m["step"] for m in done if m.get("segment") == len(segs) - 1]
            segs[-1]["end"] = max(ends, default=segs[-1]["start"] - 1)
        return prior

    def _clear(self):
        """A fresh recording: this rank's earlier files (and rank 0: the recording's) go."""
        d = A.rank_dir(self.out, self.rank)
        if d.exists():
            for p in list(d.glob("step*")) + list(d.glob("final.*")):
                p.unlink()
        if self.rank == 0:
            A.recording_path(self.out).unlink(missing_ok=True)
        self._barrier()

    def _write_recording(self):
        self.meta["steps"] = A.recording_steps(self.meta)
        if self.rank == 0:
            atomic.write_text(A.recording_path(self.out), json.dumps(self.meta, indent=1))

    def _pre(self, module, args, kwargs):
        # eval-mode forwards and forwards under torch.no_grad()/inference_mode (a metric, a probe
        # loss) are not the step's micro-batches: no gradient can come of them
        if not module.training or not torch.is_grad_enabled():
            return None
        batch = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                batch[f"arg{i}"] = a.detach().cpu().clone()
        for key in self.inputs:
            v = kwargs.get(key)
            if isinstance(v, torch.Tensor):
                batch[key] = v.detach().cpu().clone()
        # every other tensor argument with the batch's rows (position_ids of packed sequences,
        # token_type_ids, ...): the forward is a function of it, so the reference passes it too
        rows = next((t.shape[0] for t in batch.values() if t.dim()), None)
        for key, v in kwargs.items():
            if key not in batch and isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows:
                batch[key] = v.detach().cpu().clone()
        # non-tensor arguments of plain types (a bool keyword that switches a branch): the reference passes them
        call = {f"arg{i}": a for i, a in enumerate(args) if type(a) in PLAIN}
        call.update({key: v for key, v in kwargs.items() if type(v) in PLAIN})
        self.calls.append(call or None)
        self.attrs.append(attr_changes(plain_attrs(module), self._attrs0))
        self.batches.append(batch)
        if self._probe is not None:  # the probe step's first micro-batch alone
            self._probe.armed = len(self.batches) == 1 and self.k + 1 in self._probe_steps
        self.autocasts.append(_autocast_state(self._device_type))
        self.casts.append(None)
        self.evals.append([n for n, m in self._submodules if not m.training] or None)
        return None

    def _inner(self, module, args):
        if not self.autocasts or not module.training or not torch.is_grad_enabled():
            return None
        if self.autocasts[-1] is None:
            self.autocasts[-1] = _autocast_state(self._device_type)
        if self.casts[-1] is None:  # this module's parameters as its forward sees them (after FSDP2's unshard)
            stored = self._stored.get(module, {})
            for n, p in module._parameters.items():
                if p is not None and n in stored and p.dtype != stored[n]:
                    self.casts[-1] = str(p.dtype).removeprefix("torch.")
                    break
        return None

    def _buffered(self):
        """copy(key, t): this rank's t (as _local gives it) copied into a CPU buffer of the Recorder's own,
        the same one each step (a copy into memory already touched costs a tenth of a fresh one's: at 124M
        parameters 0.3 s against 3 s a step), once the writer has written the step before from it."""
        import threading

        pool = self.__dict__.setdefault("_pool", {})
        free = self.__dict__.setdefault("_buffers_free", threading.Event())
        if pool:
            while not free.wait(1.0):
                self._writer._raise()  # the writer failed: its error, not a wait
        free.clear()

        def copy(key: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if hasattr(t, "to_local"):
                t = t.to_local()
            buf = pool.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = pool[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            return buf.copy_(t)

        return copy

    def _sketch_all(self, tensors: dict[str, torch.Tensor], full_numel: dict[str, int]) -> dict[str, torch.Tensor]:
        buckets = self._sketcher.buckets
        for name, t in tensors.items():
            if name not in buckets:
                n, lo = full_numel[name], 0
                pl = self.placements.get(name)
                if pl:  # this rank's rows of the global tensor: torch.chunk's split along dim 0
                    row = n // pl["shape"][0] if pl["shape"][0] else 0
                    rows = -(-pl["shape"][0] // self.world)
                    lo = min(self.rank * rows, pl["shape"][0]) * row
                buckets[name] = sketch_buckets(name, n, self.sketch_k, self.seed, lo, t.numel())
        return self._sketcher(tensors)

    def _reshard(self) -> None:
        """Every FSDP2 module back to its shards. A module sharded with
        reshard_after_forward=False stays unsharded after a forward, and a
        no-grad forward after the backward (a metric, a probe loss) leaves it
        so at rec.step: its parameters are then the gathered plain tensors,
        without the gradients, which live on the shards. Resharding is what
        the next forward undoes anyway (it gathers again)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _tensor_step(self, k: int) -> bool:
        return (k - 1) % self.every == 0

    # ------------------------------------------------------------------ the loop's calls

    def step(self, *, loss=None, lr=None, optimizer=None, clip_coef=None, grad_norm=None, example_ids=None,
             epoch=None, extra: dict | None = None, loss_sum=None, tokens=None) -> None:
        """Record the step about to be taken: call after the last backward
        (gradients synchronised), before optimizer.step(). `clip_coef` or
        `grad_norm` (with max_grad_norm > 0) say the gradients were already
        clipped, by clip_coef = min(1, max_grad_norm / (grad_norm + 1e-6)).
        `example_ids` (this rank's examples in this step, e.g. the sampler's
        indices) make the data check exact; `epoch` (the loop's epoch, e.g.
        what it passed to sampler.set_epoch) gives the data check the loop's
        own epochs instead of ones inferred from dataset_len. `extra`: tensors
        of this rank's own kept with the step as x/<name> (not assembled, not
        judged but by a client's own facts). `loss_sum`, `tokens`: this rank's own
        loss sum and token count of the step, for the in-run check of the logged
        loss (selfcheck > 0)."""
        if self.closed:
            raise RecorderError("rec.step() after rec.close()")
        self.k += 1
        k = self.k
        self._mark(k - 1)  # the step before, where no report came for it
        batches, self.batches = self.batches, []
        autocasts, self.autocasts = self.autocasts, []
        casts, self.casts = self.casts, []
        evals, self.evals = self.evals, []
        calls, self.calls = self.calls, []
        attrs, self.attrs = self.attrs, []
        if isinstance(self.layout, layouts.PipelineLayout):  # the forwards a backward reached (layouts.py)
            keep = self.layout.kept(len(batches))
            batches, autocasts, casts, evals, calls, attrs = (
                [x[i] for i in keep] for x in (batches, autocasts, casts, evals, calls, attrs))
        if isinstance(self.layout, layouts.ContextParallelLayout):  # the CP group's global rows (a collective)
            batches = self.layout.assemble(batches)
        if lr is None and optimizer is not None:
            lr = optimizer.param_groups[0]["lr"]
        grad_norm = _number(grad_norm)
        if clip_coef is None and grad_norm is not None and self.max_grad_norm > 0:
            clip_coef = clip(self.max_grad_norm, grad_norm)
        clip_coef = _number(clip_coef)
        tensors: dict[str, torch.Tensor] = {}
        for m, b in enumerate(batches):
            for key, t in b.items():
                tensors[f"in/{m}/{key}"] = t
        if example_ids is not None:
            tensors["ids"] = torch.as_tensor(example_ids).detach().cpu().reshape(-1).clone()
        for name, t in (extra or {}).items():
            tensors[f"{A.EXTRA}{name}"] = torch.as_tensor(t).detach().cpu().clone()
        if self.placements or self.layout is not None:  # FSDP2: the sharded parameters, which hold the
            self._reshard()  # reduced gradients (see _reshard)
        if self.layout is not None and self.rank != self.layout.leader:  # a TP peer's inputs: kept apart
            tensors = {("tp/" + n[3:] if n.startswith("in/") else "tp_ids" if n == "ids" else n): t
                       for n, t in tensors.items()}
        probed = {}
        if self._probe is not None and k in self._probe_steps:  # every rank: full_tensor() is a collective
            self._probe.armed = False
            got, probed = self._probe.take(self._full, self._gather if self.layout is not None else None)
            tensors.update(got)
            if k >= max(self._probe_steps):  # no step left to probe: its hooks go
                self._probe.remove()
                self._probe = None
        named = list(self.module.named_parameters())
        no_grad = [n for n, p in named if p.grad is None]
        param_hash = grad_hash = hashed = None
        if self._tensor_step(k) and self.sketch_k:  # read in place: the sketches are the copies
            numel = {n: p.numel() for n, p in named}
            ps = self._sketch_all({n: self._piece(p) for n, p in named}, numel)
            gs = self._sketch_all({n: self._piece(p.grad) for n, p in named if p.grad is not None}, numel)
            tensors.update({f"ps/{n}": v for n, v in ps.items()})
            tensors.update({f"gs/{n}": v for n, v in gs.items()})
            param_hash = _digest(ps)
            grad_hash = _digest(gs)  # each rank's copy of the synchronised gradient (the ranks fact compares them)
        elif self._tensor_step(k):
            if self._full is _local:  # into the step buffers the writer has finished with (no fresh memory)
                copy = self._buffered()
                params = {n: copy("p/" + n, p) for n, p in named}
                grads = {n: copy("g/" + n, p.grad) for n, p in named if p.grad is not None}
            else:
                params = {n: self._full(p, n) for n, p in named}
                grads = {n: self._full(p.grad, n) for n, p in named if p.grad is not None}
            tensors.update({f"p/{n}": v for n, v in params.items()})
            tensors.update({f"g/{n}": v for n, v in grads.items()})
            # named_buffers, not state_dict(): under FSDP2 a state_dict mid-step reshards (its hook)
            named_bufs = dict(self.module.named_buffers())
            bufs = {f"b/{n}": self._full(named_bufs[n]).clone() for n in self._buffers if n in named_bufs}
            tensors.update(bufs)
            # the ranks' state (parameters and persistent buffers) and each rank's copy of the synchronised gradient
            # (the ranks fact compares them), hashed on the writer's thread, off the loop's (the copies are ours)
            hashed = ({**params, **bufs}, grads)
        meta = {"step": k, "run": self.run, "segment": self.segment, "rank": self.rank, "world": self.world,
                "lr": _number(lr), "loss": _number(loss), "clip_coef": clip_coef, "grad_norm": grad_norm,
                "clipped": clip_coef is not None, "no_grad": no_grad, "micro_batches": len(batches),
                **(layouts.peer_counts(len(batches)) if self.layout is not None and self.rank != self.layout.leader
                   else {}),
                "autocast": autocasts, "compute_dtype": casts, "eval_modules": evals, "call": calls,
                "attrs": attrs,
                "tensors": self._tensor_step(k), "param_hash": param_hash, "grad_hash": grad_hash,
                "epoch": None if epoch is None else int(epoch), **probed}
        found = self._selfcheck(named, len(batches), clip_coef, loss, loss_sum, tokens, tensors, meta)
        # serialised on the writer's thread: every tensor here is the Recorder's own copy (inputs cloned
        # by the pre-hook, parameters and gradients by _local or the sketches, ids below)
        if hashed is not None:
            self._writer.call(lambda: meta.update(param_hash=_digest(hashed[0]), grad_hash=_digest(hashed[1])))
        self._writer.write(A.step_tensors_path(self.out, self.rank, k), tensors)
        if hashed is not None and self._full is _local:  # the step buffers are free again once written
            self._writer.call(self._buffers_free.set)
        self._writer.write(A.step_meta_path(self.out, self.rank, k), lambda: json.dumps(meta, indent=1).encode())
        self._last_meta = meta
        if not self._reports:
            self._mark(k)
        if self.stop_on_fail and found:
            self._stop(k, found)

    def labels(self, labels) -> None:
        """The labels the loop's loss compares the LAST forward's outputs with,
        where the model is not given them (the loop passes only input_ids to
        the model and calls its loss on logits and labels): call once per
        micro-batch, after its forward. The built-in objectives read them
        instead of the input ids; a declared fn finds them as
        batch["loss_labels"] (never passed to the forward)."""
        if self.closed:
            raise RecorderError("rec.labels() after rec.close()")
        if not self.batches:
            raise RecorderError("rec.labels() with no forward recorded since the last rec.step(): call it after "
                                "the micro-batch's forward in training mode, with the labels its loss reads")
        if not isinstance(labels, torch.Tensor):
            raise RecorderError(f"rec.labels() takes a tensor of labels, not a {type(labels).__name__}")
        batch = self.batches[-1]
        rows = next((t.shape[0] for t in batch.values() if t.dim()), None)
        if labels.dim() == 0 or (rows is not None and labels.shape[0] != rows):
            raise RecorderError(f"rec.labels() got labels of shape {tuple(labels.shape)} for a forward of {rows} "
                                "rows: pass the micro-batch's own labels, one row per row")
        batch[LOSS_LABELS] = labels.detach().cpu().clone()

    def beside(self, **tensors) -> None:
        """What the loop's loss reads beside the LAST forward's inputs, one row per
        row (an RL loss's advantages, old log-probabilities): kept with that
        micro-batch under the names given, never passed to the forward, for a
        declared objective fn(model, batch) to read as batch[name]. Call once per
        micro-batch, after its forward. The rows go with the batch's rows (fact 1's
        rows alone, the merged forward), so a per-position tensor must have the
        forward's length (its second dimension), aligned with its input ids."""
        if self.closed:
            raise RecorderError("rec.beside() after rec.close()")
        if self.meta["objective"] in OBJECTIVES:
            raise RecorderError(f"rec.beside() with the built-in objective {self.meta['objective']!r}, which reads "
                                "only the batch's labels: declare objective='pkg.mod:fn' reading batch[name]")
        if not self.batches:
            raise RecorderError("rec.beside() with no forward recorded since the last rec.step(): call it after "
                                "the micro-batch's forward in training mode")
        batch = self.batches[-1]
        rows = next((t.shape[0] for t in batch.values() if t.dim()), None)
        for name, t in tensors.items():
            if name in batch or name.startswith("arg") or "/" in name:
                raise RecorderError(f"rec.beside({name}=...): the name is taken by the forward's inputs (or starts "
                                    "with 'arg', or holds '/'): give it a name of its own")
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or (rows is not None and t.shape[0] != rows):
                raise RecorderError(f"rec.beside({name}=...) takes a tensor with the forward's {rows} rows, not "
                                    f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            batch[name] = t.detach().cpu().clone()

    def report(self, *, loss=None, grad_norm=None, clip_coef=None) -> None:
        """The loss and the clipping of the step just recorded, where the loop
        learns them only after optimizer.step() (HF's Trainer clips before its
        callbacks see the gradient and logs the loss and the pre-clip norm after
        the step): they replace the step's values, by step()'s rule."""
        meta = getattr(self, "_last_meta", None)
        if self.closed or meta is None:
            raise RecorderError("rec.report() with no recorded step to report on: call it after rec.step()")
        grad_norm = _number(grad_norm)
        if clip_coef is None and grad_norm is not None and self.max_grad_norm > 0:
            clip_coef = clip(self.max_grad_norm, grad_norm)
        clip_coef = _number(clip_coef)
        if loss is not None:
            meta["loss"] = _number(loss)
        if grad_norm is not None:
            meta["grad_norm"] = grad_norm
        if clip_coef is not None:
            meta["clip_coef"], meta["clipped"] = clip_coef, True
        # through the writer, after the step's own JSON (its queue keeps the order), serialised there (after
        # the step's hashes)
        self._writer.write(A.step_meta_path(self.out, self.rank, meta["step"]),
                           lambda: json.dumps(meta, indent=1).encode())
        self._mark(meta["step"])

    def _mark(self, k: int) -> None:
        """Step k's marker (A.step_done_path), once, after everything written for it (the writer keeps order)."""
        if k > self._marked:
            self._marked = k
            self._writer.write(A.step_done_path(self.out, self.rank, k),
                               json.dumps({"step": k, "run": self.run}).encode())

    def _selfcheck(self, named, micro, clip_coef, loss, loss_sum, tokens, tensors, meta) -> list[str]:
        """The in-run checks of the step (record/selfcheck.py) into its tensors and JSON; their findings."""
        if self._watch is None:
            return []
        sk, found = self._watch.finish(named, micro=micro, clip=clip_coef, loss=_number(loss),
                                       loss_sum=_number(loss_sum), tokens=_number(tokens),
                                       clip_unknown=clip_coef is None and self.max_grad_norm > 0)
        tensors.update(sk)
        meta["selfcheck"] = found
        return found["findings"]

    def _stop(self, k: int, findings: list[str]):
        """stop_on_fail: every rank reached the same findings from the same gathered sketches, so every rank
        stops here, without a collective of its own; the recording closes before step k (all complete)."""
        self._mark(k)
        self.k = k - 1
        self.meta["stopped"] = {"step": k, "findings": findings[:8]}
        self.close()
        raise RecorderError(f"step {k}: the in-run checks failed ({findings[0]}{'; ...' if len(findings) > 1 else ''})"
                            ": the run stopped itself on every rank (stop_on_fail); the recording holds the steps "
                            "before it: judge it with `dormouse gate check --out DIR`")

    def close(self) -> None:
        """The parameters after the last step, then (rank 0, once every rank is
        done: a barrier, so every rank must call it) the recording's JSON."""
        if self.closed:
            return
        self._hook.remove()
        if getattr(self, "_watch", None) is not None:
            self._watch.remove()
        self._mark(self.k)
        for h in self._inner_hooks:
            h.remove()
        self._writer.flush()
        self._writer.stop()
        named = list(self.module.named_parameters())
        params = {n: self._full(p, n) for n, p in named}
        if self.sketch_k:
            params = {f"ps/{n}": v for n, v in self._sketch_all(params, {n: p.numel() for n, p in named}).items()}
            bufs = {}
        else:
            params = {f"p/{n}": v for n, v in params.items()}
            named_bufs = dict(self.module.named_buffers())
            bufs = {f"b/{n}": self._full(named_bufs[n]).clone() for n in self._buffers if n in named_bufs}
        atomic.write_bytes(A.final_tensors_path(self.out, self.rank), st_save({**params, **bufs}))
        atomic.write_text(A.final_meta_path(self.out, self.rank),
                          json.dumps({"step": self.k, "run": self.run, "segment": self.segment,
                                      "param_hash": _digest({**params, **bufs})}, indent=1))
        self._barrier()
        self.meta["segments"][-1]["end"] = self.k
        self.meta["closed"] = True
        self._write_recording()
        if self._probe is not None:
            self._probe.remove()
        self.closed = True
