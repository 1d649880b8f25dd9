"""The micro-batches of the step being taken, read where the model runs them:
a forward PRE-hook on the core module (under any DDP and torch.compile
wrappers) copies each training forward's batch to the CPU, with the autocast
and the parameters' compute dtype it runs under (read again in pre-hooks on
the submodules: a wrapper may enter autocast inside the call), the submodules
in eval mode, its plain non-tensor arguments, the modules' attributes that
changed since the start, and the RNG state the forward starts from (CPU, and
the device's on CUDA: the reference draws a dropout's masks from it again).
rec.labels() and rec.beside() add to the last one. The Recorder (record/recorder.py) takes them at each rec.step()."""

from __future__ import annotations

import dataclasses
import inspect
import sys

import torch

from dormouse.gate.record.options import LOSS_LABELS, NEUTRAL_ATTRS, OBJECTIVES, PLAIN, RecorderError
from dormouse.numerics import same_value


def _autocast_state(device_type: str) -> dict | None:
    """The autocast a forward on `device_type` runs under now: {"device_type",
    "dtype"} (e.g. "cpu", "bfloat16"), or None when autocast is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return {"device_type": device_type, "dtype": str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")}


def rng_states(device_type: str, device) -> dict[str, torch.Tensor]:
    """The RNG states a forward starting now draws from: {"cpu": torch.get_rng_state()} (~5 KB), and on
    CUDA {"cuda": that device's state} too. A copy each (uint8)."""
    out = {"cpu": torch.get_rng_state()}
    if device_type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def rng_tensors(rngs: list[dict]) -> dict[str, torch.Tensor]:
    """Each micro-batch's recorded RNG states as a step's tensors (A.rng_key)."""
    from dormouse.gate import artifacts as A

    return {A.rng_key(m, dev): t for m, states in enumerate(rngs) for dev, t in (states or {}).items()}


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
        diff = {k: v for k, v in d.items() if k not in old or not same_value(old[k], v)}
        if diff:
            out[path] = diff
    return out or None


def _tensors(x, depth: int = 4):
    """The tensors in a forward's output: a tensor, or tuples, lists and dicts of them (a ModelOutput is a
    dict), a dataclass's fields, or an object's attributes (a model's own output class), `depth` levels down."""
    if isinstance(x, torch.Tensor):
        yield x
    elif depth <= 0:
        return
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v, depth - 1)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v, depth - 1)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name, None), depth - 1)
    elif not isinstance(x, (type, torch.nn.Module, str, bytes, int, float, bool)) and x is not None:
        for v in list(getattr(x, "__dict__", {}).values()) + [getattr(x, n, None) for n in _slots(type(x))]:
            yield from _tensors(v, depth - 1)


def _positional_names(forward) -> list[str]:
    """The names of a forward's parameters that take positional arguments, in order ([] where it takes
    *args first, or has no signature to read)."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return []
    out = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        out.append(p.name)
    return out


def _slots(cls) -> list[str]:
    """The __slots__ names of a class and its bases (an output class without a __dict__)."""
    names = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def _rows(batch: dict) -> list[bytes]:
    """A micro-batch's rows as bytes of its first row-wise tensor (input_ids, arg0, or the first there is)."""
    t = next((batch[k] for k in ("input_ids", "arg0") if k in batch), next(iter(batch.values()), None))
    if t is None or not t.dim():
        return []
    return [r.contiguous().numpy().tobytes() for r in t.detach().cpu()]


def _untrained(batches: list[dict], dropped: set[int]) -> int:
    """The dropped forwards (no backward reached them) holding a row that no kept micro-batch of the step
    holds, whole or as its start: rows the rank read and did not train on (a metric forward over rows it
    trained on, or over their first positions, re-reads them; a loss left out of the backward, or a metric
    over other rows, reads rows of its own)."""
    if not dropped:
        return 0
    kept = [r for m, b in enumerate(batches) if m not in dropped for r in _rows(b)]
    return sum(1 for m in dropped if not all(any(k.startswith(r) for k in kept) for r in _rows(batches[m])))


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
    break there, not a crash of the run). Before torch._dynamo is imported
    nothing can have been compiled: fn as it is (dynamo's import, with sympy
    and FSDP2, is seconds a process: most of a small run's recording start);
    Capture.take puts the hooks on again, eager, once it is imported."""
    if "torch._dynamo" not in sys.modules:
        return fn
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


class Capture:
    """The forwards' micro-batches of the step being taken (see the module docstring).

    module     the core module (core_module(model)): its pre-hook reads the batch
    inputs     the forward keyword arguments that are the batch
    objective  the spec's objective (rec.beside() is for a declared one)
    arm        None, or arm(n) called after the step's n-th micro-batch was read (the probe's trigger)
    """

    def __init__(self, module, inputs: tuple, objective: str, arm=None):
        self.module, self.inputs, self.objective, self.arm = module, tuple(inputs), objective, arm
        # whether a training-mode forward, too, is a micro-batch only where a backward reaches its output
        # (False on a pipeline stage, whose layout tells its own: layouts.PipelineLayout.watch)
        self.every_forward = True
        self._named: tuple = (None, [])  # (the forward function, its positional parameters' names)
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
        # each micro-batch's RNG states at its forward's start (rng_states): the reference restores them
        self.rngs: list[dict] = []
        self._submodules = [(n, m) for n, m in module.named_modules() if n]
        p = next(module.parameters(), None)
        self.device_type = p.device.type if p is not None else "cpu"
        self._device = p.device if p is not None else None
        self._attrs0 = plain_attrs(module)  # the modules' plain attributes at the start (recording.json's)
        self._hooks: list = []
        # the step's forwards {micro-batch: whether a backward reached its output} (_post)
        self._backpropagated: dict[int, bool] = {}
        self._hooked: set[int] = set()
        self.unreached = 0  # the last take()'s forwards with gradients on that no backward reached
        self.untrained = 0  # ... of them, those whose rows no kept micro-batch of the step holds (rows read, not trained)
        self.first_dropped = False  # whether the step's first forward (the probe's) was one of them

    @property
    def attrs0(self) -> dict:
        return self._attrs0

    def hook(self) -> None:
        """The pre-hooks: the model's own (the batch), then every submodule's (autocast and casts read
        inside the forward: accelerate, and so HF's Trainer with bf16=True, wraps model.forward). They
        run eagerly under torch.compile (a graph break, in any placement of the compile; a compile
        placed after the Recorder traces them in its first step, take() makes them eager after it)."""
        self._register()
        # each module's own parameters' stored dtypes (under FSDP2 the sharded ones): a forward that
        # sees another dtype runs on a cast copy
        self._stored = {m: {n: p.dtype for n, p in m._parameters.items() if p is not None}
                        for m in self.module.modules()}

    def _register(self) -> None:
        self._plain = "torch._dynamo" not in sys.modules  # see _eager
        self._hooks = [self.module.register_forward_pre_hook(_eager(self._pre), with_kwargs=True),
                       self.module.register_forward_hook(_eager(self._post))]
        inner = _eager(self._inner)
        self._hooks += [m.register_forward_pre_hook(inner) for m in self.module.modules() if m is not self.module]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def take(self) -> tuple[list, list, list, list, list, list, list]:
        """The step's (batches, autocasts, casts, evals, calls, attrs, rngs), each per micro-batch; empty after.
        A forward with gradients on whose output no backward reached (a metric computed without no_grad)
        is no micro-batch: dropped, and counted in `unreached`."""
        if self._hooks and self._plain and "torch._dynamo" in sys.modules:  # torch.compile came after hook()
            self.remove()
            self._register()
        got = (self.batches, self.autocasts, self.casts, self.evals, self.calls, self.attrs, self.rngs)
        dropped = {m for m, reached in self._backpropagated.items() if not reached}
        self.untrained = _untrained(self.batches, dropped)
        self.first_dropped = 0 in dropped
        if dropped:
            got = tuple([x for m, x in enumerate(xs) if m not in dropped] for xs in got)
        self.unreached = len(dropped)
        self.batches, self.autocasts, self.casts, self.evals, self.calls, self.attrs = [], [], [], [], [], []
        self.rngs, self._backpropagated, self._hooked = [], {}, set()
        return got

    def moved(self) -> list[str]:
        """The parameters updated in place since the step's first forward (an optimizer.step() before
        rec.step), by name; forgets the forward's counts. Only a parameter still registered as the same
        tensor is compared (FSDP2 swaps its registered parameters: nothing to compare there)."""
        noted, self._versions = getattr(self, "_versions", {}), {}
        return [n for n, p in self.module.named_parameters()
                if n in noted and noted[n][0] is p and p._version != noted[n][1]]

    def _pre(self, module, args, kwargs):
        # forwards under torch.no_grad()/inference_mode (a metric, a probe loss) are not the step's
        # micro-batches: no gradient can come of them. A forward with gradients on (in training or eval
        # mode) is one only where its output is backpropagated: kept provisionally, and dropped at take()
        # unless a gradient reached its output (_post's hook)
        if not torch.is_grad_enabled():
            return None
        rng = rng_states(self.device_type, self._device)  # before anything here could draw
        batch = {}
        last = max((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), default=-1)
        named = self._positional(module)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                # the last positional tensor, where the forward names it attention_mask or labels (model(x, mask),
                # checkpoint(model, x, mask)): recorded by that name, so the objective reads it as what it is
                # (a keyword it becomes for the reference's call, with no positional after it to shift)
                key = named[i] if i == last and i < len(named) and named[i] in ("attention_mask", "labels") \
                    and named[i] not in kwargs else f"arg{i}"
                batch[key] = a.detach().cpu().clone()
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
        if not self.batches:  # the step's first forward: each parameter's in-place update count (moved() reads)
            self._versions = {n: (p, p._version) for n, p in module.named_parameters()}
        self.batches.append(batch)
        self.rngs.append(rng)
        if self.arm is not None and module.training:  # the probe step's first micro-batch alone
            self.arm(len(self.batches))
        self.autocasts.append(_autocast_state(self.device_type))
        self.casts.append(None)
        # "" first where the model itself is in eval mode (reference/forward.set_modes)
        self.evals.append(([] if module.training else [""]) + [n for n, m in self._submodules if not m.training]
                          or None)
        if self.every_forward or not module.training:
            self._backpropagated[len(self.batches) - 1] = False
        return None

    def _positional(self, module) -> list[str]:
        """_positional_names of the module's forward, read once per forward function (accelerate may wrap
        the forward after the Recorder started)."""
        fn = getattr(module.forward, "__func__", module.forward)
        if self._named[0] is not fn:
            self._named = (fn, _positional_names(module.forward))
        return self._named[1]

    def _post(self, module, args, output):
        """After a forward with gradients on: a hook on each output tensor that needs a gradient marks its
        micro-batch backpropagated when the backward reaches it. An output with no such tensor to be
        found is kept as a micro-batch (nothing tells it apart)."""
        m = len(self.batches) - 1
        if self._backpropagated.get(m) is not False or m in self._hooked:
            return None
        self._hooked.add(m)

        def reached(_grad, m=m):
            self._backpropagated[m] = True

        needing = [t for t in _tensors(output) if t.requires_grad]
        for t in needing:
            try:
                t.register_hook(reached)
            except RuntimeError:  # a tensor that takes no hook: the forward counts as backpropagated
                self._backpropagated[m] = True
        if not needing:  # no output tensor that a backward could reach (the loss kept on a module, an output
            self._backpropagated[m] = True  # the walk cannot see into): nothing tells it apart, kept
        return None

    def _inner(self, module, args):
        if not self.autocasts or not module.training or not torch.is_grad_enabled():
            return None
        if self.autocasts[-1] is None:
            self.autocasts[-1] = _autocast_state(self.device_type)
        if self.casts[-1] is None:  # this module's parameters as its forward sees them (after FSDP2's unshard)
            stored = self._stored.get(module, {})
            for n, p in module._parameters.items():
                if p is not None and n in stored and p.dtype != stored[n]:
                    self.casts[-1] = str(p.dtype).removeprefix("torch.")
                    break
        return None

    def labels(self, labels) -> None:
        """The labels of the LAST forward's loss, kept with its micro-batch (Recorder.labels says when)."""
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
        """What the LAST forward's loss reads beside its inputs, kept with its micro-batch under the names
        given, one row per row (Recorder.beside says what for)."""
        if self.objective in OBJECTIVES:
            raise RecorderError(f"rec.beside() with the built-in objective {self.objective!r}, which reads "
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
