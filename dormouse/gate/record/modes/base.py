"""The gate's modes: what every mode shares. A mode's values worked out once
(Mode: its RunConfig, device and settings), and the seams through which a
benchmark or a test's planted fault acts on every mode of a process (run
hooks, model hooks, run scopes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

import torch

from dormouse.config import RunConfig
from dormouse.digest import fingerprint
from dormouse.errors import DormouseError
from dormouse.gate.record.dormouse_loop import LoopRecorder
from dormouse.gate.fixtures import build, make_run
from dormouse.gate.record.provenance import gate_provenance
from dormouse.gate.settings import GateSettings
from dormouse.train.tensors import named_state

QUIET = lambda line: None  # noqa: E731


# --------------------------------------------------------------------------- the seams

RunHook = Callable[[GateSettings, RunConfig], "RunConfig | None"]
ModelHook = Callable[[GateSettings, torch.nn.Module], None]
RunScope = Callable[[GateSettings], ContextManager]
_RUN_HOOKS: list[RunHook] = []
_MODEL_HOOKS: list[ModelHook] = []
_RUN_SCOPES: list[RunScope] = []


def install_run_hook(hook: RunHook) -> Callable[[], None]:
    """Add `hook` to every mode of this process: each mode's RunConfig, as
    fixtures.make_run builds it from the settings (the fleet's in every rank
    and leg, single's, exact's, gradref's, the replay's), is passed to
    hook(settings, run), which may return another RunConfig: the one the mode
    then trains and records (None: unchanged). The explicit seam for what a
    torchrun rank cannot be handed as an argument -- a benchmark's choice per
    fleet run of a plan, a test's planted fault; nothing here installs one.
    Returns the function that removes it."""
    _RUN_HOOKS.append(hook)
    return lambda: _RUN_HOOKS.remove(hook)


def install_model_hook(hook: ModelHook) -> Callable[[], None]:
    """Add `hook` to every mode of this process: every model a mode builds
    (Mode.model: the fleet's on every rank, the references', the floor runs')
    is passed to hook(settings, model) right after its seeded build, before
    anything reads it. The seam for a change to the network itself (a test's
    planted batch statistic). Returns the function that removes it."""
    _MODEL_HOOKS.append(hook)
    return lambda: _MODEL_HOOKS.remove(hook)


def install_run_scope(scope: RunScope) -> Callable[[], None]:
    """Add `scope` to every fleet run of this process: run_rank_plan enters
    scope(settings) around each run of its plan (several runs share one
    launch), so what the scope installs acts on that run alone. Returns the
    function that removes it."""
    _RUN_SCOPES.append(scope)
    return lambda: _RUN_SCOPES.remove(scope)


def deterministic_kernels(s: GateSettings) -> bool:
    """Under reduce exact on CUDA, every process of the gate runs with
    torch's deterministic algorithms (and cuBLAS's fixed workspace,
    CUBLAS_WORKSPACE_CONFIG=:4096:8, set before its first use): the exact
    mode's bitwise claim needs kernels whose results do not depend on the
    order their atomics land in (index_add_'s and scatter's backward, the
    MoE's). An operation with no deterministic kernel then raises, naming
    itself, rather than failing a fleet the gate built. On the CPU every
    kernel used is deterministic already. Returns whether it switched them on."""
    if s.device != "cuda" or s.reduce != "exact":
        return False
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    return True


@dataclass(frozen=True)
class Mode:
    """One run of a mode, worked out once from the settings and handed down:
    the RunConfig it trains (fixtures.make_run, then every run hook), the
    device, and the settings it records. Everything a mode needs beyond them
    is derived from these, not from the settings again."""

    s: GateSettings
    run: RunConfig
    device: torch.device

    def model(self) -> torch.nn.Module:
        """A fresh seeded build of the run's network (fixtures.build), every
        model hook applied; on the CPU (the caller moves it)."""
        model = build(self.run)
        for hook in _MODEL_HOOKS:
            hook(self.s, model)
        return model

    def start_state(self, built: torch.nn.Module) -> tuple[dict, int]:
        """The parameters the mode starts from, and the step: `built` (a
        fresh Mode.model(), not yet trained) as it stands, or with
        resume_from the checkpoint's weights and steps done (read whole,
        whichever topology wrote it). Its fingerprint is every artifact's
        `init`."""
        if not self.s.resume_from:
            return named_state(built), 0
        from dormouse.train.checkpoint import load_model_weights

        model, _, step = load_model_weights(Path(self.s.resume_path()), build=lambda run: self.model())
        return named_state(model), step

    def gate_extra(self, init: str, **more) -> dict:
        """What a recording of this mode keeps beside the run (recording.json's
        extra, GateReferences' JSON): the settings' record and the gate's
        provenance, the initial parameters' fingerprint `init` among it."""
        prov = gate_provenance(device=self.s.device, corpus=Path(self.run.train.data), init=init)
        return {"settings": self.s.record(), "provenance": prov, **more}

    def recorder(self, out: Path, built: torch.nn.Module) -> LoopRecorder:
        """A fresh recording of this mode's run into `out` (LoopRecorder), `built`
        its fresh model; a run from resume_from is rebuilt from that checkpoint."""
        return LoopRecorder(out, extra=self.gate_extra(fingerprint(self.start_state(built)[0])), fresh=True)


def mode(s: GateSettings, **kw) -> Mode:
    """A mode's values: the RunConfig fixtures.make_run(s, **kw) gives after
    every installed run hook, and the device (deterministic kernels where the
    settings need them)."""
    deterministic_kernels(s)
    if s.device == "cuda" and not torch.cuda.is_available():
        raise DormouseError("device 'cuda' asked for but CUDA is not available: use --device cpu")
    run = make_run(s, **kw)
    for hook in _RUN_HOOKS:
        run = hook(s, run) or run
    return Mode(s, run, torch.device(s.device))
