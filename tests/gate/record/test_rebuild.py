"""The reference's rebuild says why build_model's names are not the recording's where the loop
wrapped the model after building it (PEFT's peft_config= inside TRL's trainers)."""

from __future__ import annotations

import pytest
import torch

from dormouse.gate.record.reference.rebuild import _wrapped_hint


def _base() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def test_a_model_wrapped_by_peft_after_build_model_is_named_with_the_fix():
    peft = pytest.importorskip("peft")
    built = set(_base().state_dict())
    wrapped = peft.get_peft_model(_base(), peft.LoraConfig(r=2, target_modules=["0"]))
    recorded = set(wrapped.state_dict())
    assert built.isdisjoint(recorded)  # every name moved, and the wrapped layer's renamed (base_layer)
    hint = _wrapped_hint(built, recorded)
    assert "the loop wrapped the model" in hint and "'base_model.model.'" in hint and "get_peft_model" in hint
    assert "build_model wrapped the model" in _wrapped_hint(recorded, built)


def test_names_that_are_simply_other_get_no_hint():
    other = {"encoder.weight", "decoder.bias", "head.weight"}
    assert _wrapped_hint(set(_base().state_dict()), other) == ""
    wrapped = {"module." + n for n in _base().state_dict()}  # DDP's prefix: a wrapper, not PEFT's
    hint = _wrapped_hint(set(_base().state_dict()), wrapped)
    assert "'module.'" in hint and "PEFT" not in hint


def test_an_optimizer_is_what_the_replay_steps_not_only_torchs_base_class():
    """rebuild.is_optimizer: step(), zero_grad() and a param_groups list with an lr, as torch's optimizers
    and dormouse's own loop's (MixAsOptimizer, not a torch.optim.Optimizer) have; a model is not one."""
    import dataclasses

    from dormouse.config import RunConfig, TrainConfig, preset
    from dormouse.gate.record.dormouse_loop import LoopSchedule, MixAsOptimizer
    from dormouse.gate.record.reference.rebuild import is_optimizer
    from dormouse.train import loop

    net = _base()
    assert is_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3))
    assert not is_optimizer(net) and not is_optimizer(type("StepOnly", (), {"step": lambda self: None})())
    run = RunConfig(model=preset("tiny"), train=dataclasses.replace(TrainConfig(), steps=8, warmup=2))
    model = loop.build_model(run)
    opt = MixAsOptimizer(model, run)
    assert is_optimizer(opt) and not isinstance(opt, torch.optim.Optimizer)
    sched = LoopSchedule(opt, run, start=3)  # the lr of steps 3, 4, 5 (0-based) as the loop's schedule gives
    got = [opt.param_groups[0]["lr"]] + [sched.step() or opt.param_groups[0]["lr"] for _ in range(2)]
    assert got == [loop.lr_at(k, run) for k in (3, 4, 5)]


def test_the_replay_steps_an_optimizer_of_ones_own_whose_zero_grad_takes_no_argument():
    """A review's crash: a hand-written SGD whose zero_grad(self) takes no keyword passed is_optimizer, then
    the replay called zero_grad(set_to_none=True). One replayed step is now p - lr g, as computed here."""
    from dormouse.gate.record.reference.rebuild import is_optimizer
    from dormouse.gate.record.reference.replay import train_step

    class PlainSGD:
        def __init__(self, params, lr):
            self.param_groups = [{"params": list(params), "lr": lr}]

        @torch.no_grad()
        def step(self):
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p -= self.param_groups[0]["lr"] * p.grad

        def zero_grad(self):
            for p in self.param_groups[0]["params"]:
                p.grad = None

    net = _base()
    opt = PlainSGD(net.parameters(), 0.5)
    assert is_optimizer(opt)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    grads = {n: torch.full_like(p, 0.25) for n, p in net.named_parameters()}
    train_step(net, opt, None, dict(grads), 0.0, clipped=False)
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), before[n] - 0.5 * grads[n]) and p.grad is None
