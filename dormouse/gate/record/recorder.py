"""The Recorder: what any training loop calls so the gate can judge it.

    rec = Recorder(out_dir, model, RecordingSpec(build_model="pkg.mod:fn", build_optimizer="pkg.mod:fn",
                                                 objective="causal_lm"))
    for each optimizer step:
        ... forwards and backwards (gradient accumulation, DDP/FSDP2 synchronisation) ...
        rec.step(loss=reported_loss, lr=current_lr, optimizer=opt)   # after the LAST backward, before opt.step()
        opt.step(); ...
    rec.close()

What to record is a RecordingSpec (dormouse.gate.artifacts.spec: every option,
its default and its check; docs/recording.md). Construction registers a
forward PRE-hook on the model (on `model.module` under DDP; record/capture.py):
every forward with gradients on in training mode (in eval mode: where a backward reaches its
output, capture.Capture._post) appends its batch (positional tensor
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

Per step and rank it writes (names: dormouse.gate.artifacts) the micro-batches
and the RNG state each one's forward started from (a dropout's masks are drawn
again from it), the parameters before the step, the gradient on the parameters at rec.step()
(synchronised; before clipping unless the loop says it clipped, by passing
`clip_coef` or `grad_norm` with max_grad_norm > 0: then the gradient is the
clipped one the optimizer applies and `clip_coef` says by how much), the lr,
the loop's reported loss, the parameters with no gradient, a sha256 of the
parameters (ranks equal), and (full-tensor steps) the module's persistent
buffers before the step (A.BUFFER: state outside the optimizer, e.g. a routing
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

A loop that resumes from a checkpoint holding the state after step K records
into the same directory with `start=K`: a new segment (a run continued from
another run's checkpoint records `start=K` into an empty directory: a fresh
recording whose first step is K + 1).
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
from dormouse.gate.artifacts.spec import RecordedRun, RecordingSpec, read_recording, to_json
from dormouse.gate.record import declared, layouts, probe
from dormouse.gate.record.capture import Capture, attr_changes, core_module, plain_attrs, rng_tensors  # noqa: F401
from dormouse.gate.record.options import RecorderError, check_runtime, effective_spec
from dormouse.gate.record.pieces import local, placement, shard
from dormouse.gate.record.provenance import provenance
from dormouse.gate.record.sketch import Sketcher, sketch_buckets
from dormouse.gate.record.userfns import code_hashes
from dormouse.gate.record.writer import Writer


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    return fingerprint(tensors)  # the judge recomputes it from the recorded tensors



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
    spec             a RecordingSpec: what to record (its fields: docs/recording.md)
    pipeline_stage   None, or this rank's torch.distributed.pipelining PipelineStage (model: its module):
                     stage 0's forwards are the data, each stage records its own parameters (layouts.py)
    sharding         None, or a declared sharding of plain-tensor shards (record/declared.py: hand-written
                     tensor parallelism, expert parallelism): {pattern: "replicated" | shard(dim, group, parallel)}
    context_parallel None, or dict(group=<the CP process group>, seq_dim=1, order="contiguous" | "load_balanced"):
                     each rank's inputs are a shard of its CP group's rows along seq_dim; the leader records
                     the group's global rows, assembled in the declared order (record/layouts.py)
    """

    def __init__(self, out_dir, model, spec: RecordingSpec, *, pipeline_stage=None, sharding=None,
                 context_parallel=None):
        check_runtime(spec, pipeline_stage, sharding, context_parallel)
        self.out = Path(out_dir)
        self.module = core_module(model)  # under DDP and torch.compile wrappers, in any order
        import torch.distributed as dist

        self._dist = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self._dist else (0, 1)
        self.closed = False
        prior = self._prior(spec.start)
        segments = self._open(spec.start, prior)  # self.k, self.run
        self.spec = effective_spec(spec, prior[0] if prior else None, segments)
        self.sketch_k, self.every, self.seed = self.spec.sketch, self.spec.every, self.spec.seed
        self.max_grad_norm, self.inputs = self.spec.max_grad_norm, self.spec.inputs
        self.extra = self.spec.extra  # recording.json's "extra": a client may add to it until close
        self.capture = Capture(self.module, self.inputs, self.spec.objective, arm=self._arm)
        self._sketcher = Sketcher(self.sketch_k)
        self.segment = len(segments)
        self._first = self.k + 1  # this segment's first step: its meta keeps the start's attributes
        params = {n for n, _ in self.module.named_parameters()}
        # persistent buffers (state outside the optimizer, e.g. a routing bias): A.BUFFER at tensor steps
        self._buffers = [n for n in self.module.state_dict() if n not in params]
        layout_meta = self._lay_out(pipeline_stage, sharding, context_parallel)
        self.recorded = self._recorded(segments + [{"start": self.k + 1, "end": None, "world": self.world,
                                                    "resumed": prior is not None}], layout_meta)
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
        self._hook_up(pipeline_stage is not None or sharding is not None)
        # the reference-free checks inside the run (record/selfcheck.py) and the follower's step markers
        self.stop_on_fail, self._reports, self._marked = self.spec.stop_on_fail, self.spec.reports, self.k
        self._watch = self._watcher()

    # ------------------------------------------------------------------ the start, in steps

    def _open(self, start: int, prior: tuple[RecordingSpec, RecordedRun] | None) -> list[dict]:
        """The run's id and the step before its first (self.run, self.k); the earlier segments."""
        if prior is None:
            self.run = self._broadcast(uuid.uuid4().hex if self.rank == 0 else None)
            self.k = start
            self._clear()
            return []
        self.run = prior[1].run
        last = max(A.recording_steps({"segments": prior[1].segments}), default=0)
        if start > last:
            raise RecorderError(f"start={start} but the recording in {self.out} ends at step {last}: continue "
                                "from a checkpoint it reached, or record into an empty directory")
        self.k = start
        return prior[1].segments

    def _lay_out(self, pipeline_stage, sharding, context_parallel) -> dict | None:
        """self.layout (a tensor-parallel or 2-D layout: full tensors, each DP replica's micro-batches once;
        a pipeline stage; a context-parallel group; a declared sharding), self._full, self.placements;
        the layout's recording.json entry."""
        spec = self.spec
        self.layout, layout_meta = (layouts.pipeline(pipeline_stage, self.module, self.rank, self._gather)
                                    if pipeline_stage is not None else
                                    layouts.context_parallel(context_parallel, self.module, self.rank, self._gather)
                                    if context_parallel is not None else
                                    declared.of(self.module, sharding, self.rank, self.world, self._gather,
                                                spec.build_model, spec.build_kwargs) if sharding is not None else
                                    layouts.of(self.module, self.rank, self.world, self._gather))
        self._full = (self.layout.full if sharding is not None else layouts.full if self.layout is not None
                      else local)  # _full(tensor, name): a declared sharding assembles by parameter name
        placements = {} if self.layout is not None else {n: placement(t) for n, t in self.module.state_dict().items()}
        self.placements = {n: p for n, p in placements.items() if p}
        return layout_meta

    def _recorded(self, segments: list[dict], layout_meta: dict | None) -> RecordedRun:
        """What recording.json says about the run beside the spec."""
        spec = self.spec
        return RecordedRun(
            run=self.run, world=self.world, segments=segments, fsdp=bool(self.placements), layout=layout_meta,
            # the model as the loop runs it, beyond its tensors: the parameters it froze, and a
            # Hugging Face config's runtime fields (the Trainer sets use_cache = False, which
            # decides how GPT-2 masks packed sequences): the reference rebuilds the same
            frozen=[n for n, q in self.module.named_parameters() if not q.requires_grad],
            hf_config=_hf_config(self.module),
            # the modules' plain attributes at the start (the reference sets those build_model's differ in)
            attrs=self.capture.attrs0,
            provenance=provenance(device=self.capture.device_type, code=code_hashes(
                [spec.build_model, spec.build_optimizer, spec.objective, spec.buffer_update])),
            example_corpus_sha256=A.file_hash(spec.example_corpus) if spec.example_corpus else None)

    def _hook_up(self, laid_out: bool) -> None:
        """The probe's hooks (record/probe.py: they go before the capture's own pre-hook), the capture's,
        a pipeline stage's watch on the forwards a backward reaches."""
        probe_steps = self.spec.probe_steps
        # a pipeline's stages, a declared sharding's pieces are not probed (docs/parallelisms.md)
        self._probe_steps = ({self.k + 1} if not laid_out else set()) if probe_steps is None else set(probe_steps)
        self._probe = probe.Probe(self.module) if self._probe_steps else None
        self.capture.hook()
        if isinstance(self.layout, layouts.PipelineLayout):  # a stage's forwards no backward reaches: not data
            self.capture.every_forward = False  # the stage's watch tells them (its schedule's own forward)
            self.layout.watch(self.module, lambda: len(self.capture.batches))

    def _arm(self, n: int) -> None:
        """The probe watches the probed step's first micro-batch alone."""
        if self._probe is not None:
            self._probe.armed = n == 1 and self.k + 1 in self._probe_steps

    def _watcher(self):
        """The in-run checks (record/selfcheck.py), or None when the spec asks for none."""
        spec = self.spec
        if not (spec.selfcheck or spec.stop_on_fail):
            return None
        if self.layout is not None:
            raise RecorderError("selfcheck / stop_on_fail with a tensor-parallel, pipeline or declared layout: "
                                "the in-run checks cover DDP and FSDP2 (Shard(0)); record this run without them")
        from dormouse.gate.record.selfcheck import Watch

        return Watch(self.module, k=spec.selfcheck or 64, seed=self.seed, rank=self.rank, world=self.world,
                     placements=self.placements, wire=spec.wire, reduction=spec.reduction, dist=self._dist,
                     step=self.k + 1)

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
        return self._full(t) if self.layout is not None else shard(t)

    def _barrier(self):
        if self._dist:
            import torch.distributed as dist

            dist.barrier()

    def _prior(self, start: int) -> tuple[RecordingSpec, RecordedRun] | None:
        """The recording in out_dir that a start after step 0 continues (None: a fresh recording)."""
        path = A.recording_path(self.out)
        if start == 0 or not path.exists():
            return None
        spec, run = read_recording(A.read_json(path, "recording"), path)
        segs = [dict(sg) for sg in run.segments]
        if segs and segs[-1].get("end") is None:  # that segment crashed: its steps are the files it left
            done = [json.loads(p.read_text()) for p in A.step_files(self.out, 0)]
            ends = [m["step"] for m in done if m.get("segment") == len(segs) - 1]
            segs[-1]["end"] = max(ends, default=segs[-1]["start"] - 1)
        return spec, run.replace(segments=segs)

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
        """recording.json (rank 0): the spec and the run as they stand, written from their types only."""
        self.recorded = self.recorded.replace(steps=A.recording_steps({"segments": self.recorded.segments}))
        if self.rank == 0:
            atomic.write_text(A.recording_path(self.out), json.dumps(to_json(self.spec, self.recorded), indent=1))

    def _buffered(self):
        """copy(key, t): this rank's t (as local gives it) copied into a CPU buffer of the Recorder's own,
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
        batches, autocasts, casts, evals, calls, attrs, rngs = self.capture.take()
        # the parameters an optimizer step moved since the step's first forward (a DTensor layout: not compared)
        moved = self.capture.moved() if not (self.placements or self.layout is not None) else []
        scalings = []
        if isinstance(self.layout, layouts.PipelineLayout):  # the forwards a backward reached (layouts.py)
            keep = self.layout.kept(len(batches))
            scalings = self.layout.take_scalings()
            batches, autocasts, casts, evals, calls, attrs, rngs = (
                [x[i] for i in keep] for x in (batches, autocasts, casts, evals, calls, attrs, rngs))
        if isinstance(self.layout, layouts.ContextParallelLayout):  # the CP group's global rows (a collective)
            batches = self.layout.assemble(batches)
        if lr is None and optimizer is not None:
            lr = optimizer.param_groups[0]["lr"]
        grad_norm = _number(grad_norm)
        if clip_coef is None and grad_norm is not None and self.max_grad_norm > 0:
            clip_coef = clip(self.max_grad_norm, grad_norm)
        clip_coef = _number(clip_coef)
        tensors: dict[str, torch.Tensor] = rng_tensors(rngs)  # where each forward's random draws began
        for m, b in enumerate(batches):
            for key, t in b.items():
                tensors[A.micro_input(m) + key] = t
        if example_ids is not None:
            tensors["ids"] = torch.as_tensor(example_ids).detach().cpu().reshape(-1).clone()
        for name, t in (extra or {}).items():
            tensors[f"{A.EXTRA}{name}"] = torch.as_tensor(t).detach().cpu().clone()
        if self.placements or self.layout is not None:  # FSDP2: the sharded parameters, which hold the
            self._reshard()  # reduced gradients (see _reshard)
        if self.layout is not None and self.rank != self.layout.leader:  # a TP peer's inputs: kept apart
            tensors = {(A.TP_INPUT + n[len(A.INPUT):] if n.startswith(A.INPUT) else "tp_ids" if n == "ids" else n): t
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
            tensors.update({A.SKETCHED_PARAM + n: v for n, v in ps.items()})
            tensors.update({A.SKETCHED_GRAD + n: v for n, v in gs.items()})
            param_hash = _digest(ps)
            grad_hash = _digest(gs)  # each rank's copy of the synchronised gradient (the ranks fact compares them)
        elif self._tensor_step(k):
            if self._full is local:  # into the step buffers the writer has finished with (no fresh memory)
                copy = self._buffered()
                params = {n: copy(A.PARAM + n, p) for n, p in named}
                grads = {n: copy(A.GRAD + n, p.grad) for n, p in named if p.grad is not None}
            else:
                params = {n: self._full(p, n) for n, p in named}
                grads = {n: self._full(p.grad, n) for n, p in named if p.grad is not None}
            tensors.update({A.PARAM + n: v for n, v in params.items()})
            tensors.update({A.GRAD + n: v for n, v in grads.items()})
            # named_buffers, not state_dict(): under FSDP2 a state_dict mid-step reshards (its hook)
            named_bufs = dict(self.module.named_buffers())
            bufs = {A.BUFFER + n: self._full(named_bufs[n]).clone() for n in self._buffers if n in named_bufs}
            tensors.update(bufs)
            # the ranks' state (parameters and persistent buffers) and each rank's copy of the synchronised gradient
            # (the ranks fact compares them), hashed on the writer's thread, off the loop's (the copies are ours)
            hashed = ({**params, **bufs}, grads)
        meta = {"step": k, "run": self.run, "segment": self.segment, "rank": self.rank, "world": self.world,
                "lr": _number(lr), "loss": _number(loss), "clip_coef": clip_coef, "grad_norm": grad_norm,
                "clipped": clip_coef is not None, "no_grad": no_grad, "micro_batches": len(batches),
                # forwards with gradients on whose output no backward reached (metrics): no micro-batches
                **({"unreached_forwards": self.capture.unreached, "unreached_untrained": self.capture.untrained,
                    "probed_forward_dropped": self.capture.first_dropped} if self.capture.unreached else {}),
                **(layouts.peer_counts(len(batches)) if self.layout is not None and self.rank != self.layout.leader
                   else {}),
                "autocast": autocasts, "compute_dtype": casts, "eval_modules": evals, "call": calls,
                "attrs": attrs,
                # this rank's own attributes at the start (per-step "attrs" are changes from them): the ranks
                # fact compares them, so an attribute one rank set before the Recorder is named
                **({"attrs_start": self.capture.attrs0} if k == self._first else {}),
                "tensors": self._tensor_step(k), "param_hash": param_hash, "grad_hash": grad_hash,
                "epoch": None if epoch is None else int(epoch), **probed,
                **({"moved_before_step": moved[:8]} if moved else {}),
                **({"grad_scalings": scalings} if scalings else {})}
        found = self._selfcheck(named, len(batches), clip_coef, loss, loss_sum, tokens, tensors, meta)
        # serialised on the writer's thread: every tensor here is the Recorder's own copy (inputs cloned
        # by the pre-hook, parameters and gradients by local or the sketches, ids below)
        if hashed is not None:
            self._writer.call(lambda: meta.update(param_hash=_digest(hashed[0]), grad_hash=_digest(hashed[1])))
        self._writer.write(A.step_tensors_path(self.out, self.rank, k), tensors)
        if hashed is not None and self._full is local:  # the step buffers are free again once written
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
        self.capture.labels(labels)

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
        self.capture.beside(**tensors)

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
        self.recorded = self.recorded.replace(stopped={"step": k, "findings": findings[:8]})
        self.close()
        raise RecorderError(f"step {k}: the in-run checks failed ({findings[0]}{'; ...' if len(findings) > 1 else ''})"
                            ": the run stopped itself on every rank (stop_on_fail); the recording holds the steps "
                            "before it: judge it with `dormouse gate check --out DIR`")

    def close(self) -> None:
        """The parameters after the last step, then (rank 0, once every rank is
        done: a barrier, so every rank must call it) the recording's JSON."""
        if self.closed:
            return
        self.capture.remove()
        if getattr(self, "_watch", None) is not None:
            self._watch.remove()
        self._mark(self.k)
        self._writer.flush()
        self._writer.stop()
        named = list(self.module.named_parameters())
        params = {n: self._full(p, n) for n, p in named}
        if self.sketch_k:
            sketched = self._sketch_all(params, {n: p.numel() for n, p in named})
            params = {A.SKETCHED_PARAM + n: v for n, v in sketched.items()}
            bufs = {}
        else:
            params = {A.PARAM + n: v for n, v in params.items()}
            named_bufs = dict(self.module.named_buffers())
            bufs = {A.BUFFER + n: self._full(named_bufs[n]).clone() for n in self._buffers if n in named_bufs}
        atomic.write_bytes(A.final_tensors_path(self.out, self.rank), st_save({**params, **bufs}))
        atomic.write_text(A.final_meta_path(self.out, self.rank),
                          json.dumps({"step": self.k, "run": self.run, "segment": self.segment,
                                      "param_hash": _digest({**params, **bufs})}, indent=1))
        self._barrier()
        segs = self.recorded.segments
        self.recorded = self.recorded.replace(segments=[*segs[:-1], {**segs[-1], "end": self.k}], closed=True)
        self._write_recording()
        if self._probe is not None:
            self._probe.remove()
        self.closed = True
