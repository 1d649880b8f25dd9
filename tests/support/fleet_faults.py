"""A gate process with a fault injected, for tests only: a test runs this file
instead of `-m dormouse.gate` (torchrun for the ranks, plain python for the
in-process modes when the fault is in the network itself); it monkeypatches
the library inside the process, then hands over to dormouse.gate's own main.
The production path has no fault switches.

The fault is named by DORMOUSE_TEST_FAULT:

  kill_rank1       rank 1 SIGKILLs itself after step 3 (checkpoints every 2 steps)
  raise_rank1      rank 1 raises RuntimeError after step 2 (its peer is then in step 3's reduce)
  plain_mean       the reduce averages gradients (1/W each) instead of weighting them by tokens
  window_weights   the fleet weights ranks by windows instead of tokens
  grad_x2          the fleet's reduced gradient is doubled (a double or missing division)
  wrong_step       the fleet reads step k+8's bytes at step k
  skip_param       head.weight keeps its local gradient: left out of the reduce
  seeds            each rank's model starts from seed + rank, after the start-up
                   identity check (the loop's on_start)
  capacity_moe     the MoE drops by capacity (factor 0.5) and the refusal of that
                   configuration is bypassed (run it in every mode: it is the network)
  batch_stats      the router's logits are centred over the batch: a batch statistic,
                   so the network depends on which windows share a batch (every mode)
  one_ulp          at step 3, rank 1 moves every element of head.weight's local
                   gradient (one slice's) to its float neighbour before the reduce

Review attacks (tests/gate/catches/test_own_fleet_once_false_passes_and_alarms.py; see the section at the end):
  lr_x1_5, lr_last_x3, ns_bf16, ns_bf16_minlr, no_clip_mixed   the fleet's run config
                   differs from the recipe and is recorded (the replay trusts it)
  final_tamper     the final model differs from the traced one
  sustained_5e6/8e6  g += eps max|g| * fixed sign pattern, every step
  bf16_bias, bf16_decay, bf16_decay_small  systematic bias inside the bf16 wire bound
  eval_wrong       the eval reports 0
  loads_rank0, loads_reversed (the routing bias moved by the loads reversed)

Issue 16 (tests/gate/catches/test_own_fleet_logged_loss_and_stale_weights.py):
  mean_of_ranks_loss   the fleet logs the plain mean of its ranks' losses (gradients right)
  stale_weights        at step 3, rank 1 computes on the previous step's weights
  fsdp_stale_shard     at step 3, rank 1's FSDP2 gradient shard is the one of step 2
  bf16_decay_scaled    bf16_decay at DORMOUSE_TEST_FAULT_SCALE x W u |g| sign(p) (measuring the smallest caught)

Review 4 (tests/gate/record/test_launcher.py):
  hash_order           each rank orders its gradients for the reduce by Python's string hash

How a fault enters: only through explicit seams.
- a fault in the training step (the windows a rank reads, the gradient it
  contributes, the reduced gradient, the loads, the logged loss or eval, the
  weights a step computes on, the model after the last step, a rank dying
  after a step) is a hook of dormouse.train.hooks, `install`ed for every
  train() of the process (on_start, on_batch, on_local_grads, on_reduced,
  on_step, on_eval, on_end);
- a fault in the run a mode trains (the fleet's recipe, its checkpoints) is a
  run hook of the gate's modes (modes.install_run_hook), which the artifacts
  then record as the mode's config;
- a fault in the network itself (a batch statistic, a capacity limit), in
  every mode, is a model hook of the gate's modes (modes.install_model_hook).

Several faulted fleets share one torchrun launch (a plan, as clean fleets
do): DORMOUSE_TEST_FAULTS maps each run's out dir to its fault, and
`scoped` removes a fault's hooks after its run, so
the next run of the plan trains clean (gatekit.faulty_fleets; a clean run
after a faulted one in the same launch shows it).

To add a fault: add a function here that installs the hooks it needs (the
loop's, or the modes' run hooks, model hooks and run scopes) and name it in
FAULTS. A fault never replaces a module attribute.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import torch

import dormouse.gate.record.modes as modes
from dormouse.gate.record.dormouse_loop import install_build_hook
from dormouse.train.hooks import Hooks, install


def kill_rank1() -> None:
    modes.install_run_hook(lambda s, run: _with_ckpt_every(run, 2))

    def die(step, model, info):
        if step == 3 and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)

    install(Hooks(on_step=[die]))


def raise_rank1() -> None:
    def fail(step, model, info):
        if step == 2 and os.environ.get("RANK") == "1":
            raise RuntimeError("planted failure on rank 1")

    install(Hooks(on_step=[fail]))


def _with_ckpt_every(run, every):
    return dataclasses.replace(run, train=dataclasses.replace(run.train, ckpt_every=every))


def _scale_local(factor) -> None:
    """Every piece of this rank's gradient times factor(plan, rank) before the reduce."""
    def scaled(piece):
        f = factor(piece.plan, piece.rank)
        for g in piece.grads.values():
            g.mul_(f)

    install(Hooks(on_local_grads=[scaled]))


def plain_mean() -> None:
    # The loop scaled this rank's loss by t_r / T; undo that and apply 1 / W.
    _scale_local(lambda plan, r: plan.tokens / (plan.world * plan.shapes[r].tokens))


def window_weights() -> None:
    # The loop scaled this rank's loss by t_r / T; apply b_r / B (its share of the windows) instead.
    _scale_local(lambda plan, r: (plan.shapes[r].batch / plan.windows) / (plan.shapes[r].tokens / plan.tokens))


def grad_x2() -> None:
    def doubled(state):
        for p in state.model.parameters():
            if p.grad is not None:
                p.grad.mul_(2)

    install(Hooks(on_reduced=[doubled]))


def zero_fill() -> None:
    """After the reduce, every exactly-zero gradient element (an embedding row of a byte
    absent from the step's batch; LoRA A while B is 0) gets 2^-22 max|g| sign(p): far
    inside the gradient's relative bound, but Adam moves each such element by ~lr every
    step (reviews' false passes under mixed window lengths, where no single process and
    so no curve applies: first at 4e-6, then at 2^-22 under a looser exact-zero rule)."""
    def filled(state):
        with torch.no_grad():
            for p in state.model.parameters():
                if p.grad is not None:
                    g = p.grad
                    g.add_(torch.where(g == 0, 2.0**-22 * g.abs().max() * torch.sign(p), torch.zeros_like(g)))

    install(Hooks(on_reduced=[filled]))


def wrong_step() -> None:
    def later(batch):  # the loop's on_batch: the windows of step k + 8 instead of k's
        batch.batches = batch.read(batch.step + 8)

    install(Hooks(on_batch=[later]))


def skip_param() -> None:
    local = {}

    def keep(piece):  # head.weight's local gradient, as the reduce is about to read it
        if "head.weight" in piece.grads:
            local[piece.step] = piece.grads["head.weight"].clone()

    def restore(state):  # as if head.weight had been left out of the buckets
        dict(state.model.named_parameters())["head.weight"].grad.copy_(local.pop(state.step))

    install(Hooks(on_local_grads=[keep], on_reduced=[restore]))


def seeds() -> None:
    """Each rank's model starts from seed + rank, past the fleet's start-up
    identity check (the loop's on_start runs after it): ranks that never
    broadcast their initial state."""
    def apart(st):
        if st.rank:
            torch.manual_seed(st.run.train.seed + st.rank)
            fresh = type(st.model)(st.run.model).to(next(st.model.parameters()).dtype)
            with torch.no_grad():
                for p, q in zip(st.model.parameters(), fresh.parameters()):
                    p.copy_(q)

    install(Hooks(on_start=[apart]))


def capacity_moe() -> None:
    """Every mode's network drops by capacity (factor 0.5): the built model's
    MoE keeps each expert's first assignments only (a configuration the
    fleet refuses, set on the built modules, past the refusal)."""
    def capped(s, model):
        for m in model.modules():
            if hasattr(m, "capacity") and hasattr(m, "n_experts"):
                m.capacity = 0.5

    modes.install_model_hook(capped)
    install_build_hook(lambda model: capped(None, model))  # the recording's reference rebuilds the same network


def batch_stats() -> None:
    """Every mode's router logits are centred over the batch: a batch statistic."""
    def centred(s, model):
        for m in model.modules():
            if hasattr(m, "router") and isinstance(m.router, torch.nn.Linear):
                # (N, E) logits of every token in the batch, minus their batch mean
                m.router.register_forward_hook(lambda mod, inp, out: out - out.mean(dim=0, keepdim=True))

    modes.install_model_hook(centred)
    install_build_hook(lambda model: centred(None, model))  # the recording's reference rebuilds the same network


def one_ulp() -> None:
    done = []

    def nudged(piece):
        if piece.rank == 1 and piece.step == 3 and not done and "head.weight" in piece.grads:
            g = piece.grads["head.weight"]
            g.copy_(torch.nextafter(g, torch.full_like(g, torch.inf)))
            done.append(1)  # one slice's copy of one tensor, once

    install(Hooks(on_local_grads=[nudged]))


FAULTS = {f.__name__: f for f in (kill_rank1, raise_rank1, plain_mean, window_weights, grad_x2, zero_fill, wrong_step, skip_param, seeds,
                                  capacity_moe, batch_stats, one_ulp)}


# ----------------------------------------------------------------- review attacks


def _fleet_run_tweak(**train_fields):
    """The fleet builds its run with other train fields; the rank artifacts
    record that (wrong) config, which the replay then trusts."""
    def tweaked(s, run):
        if run.train.dist:
            t = run.train
            return dataclasses.replace(run, train=dataclasses.replace(
                t, **{f: (v(t) if callable(v) else v) for f, v in train_fields.items()}))
        return None

    modes.install_run_hook(tweaked)


def lr_x1_5() -> None:
    """The fleet trains at 1.5 x the peak lr (and records that in its config)."""
    _fleet_run_tweak(lr=lambda t: t.lr * 1.5)


def lr_last_x3() -> None:
    """The fleet's schedule ends elsewhere: min_lr_frac 0.9 instead of the
    recipe's (only the late steps' lr differs), recorded in its config."""
    _fleet_run_tweak(min_lr_frac=0.9)


def final_tamper() -> None:
    """Every rank's trained model gets head.weight += 1e-3 after the last
    step (after the trace recorded it): the artifacts the fleet hands over are
    not the network it traced."""
    held = []

    def tampered(report):  # the loop's on_end: after the last step and its trace
        with torch.no_grad():
            dict(held.pop().named_parameters())["head.weight"].add_(1e-3)

    install(Hooks(on_start=[lambda st: held.append(st.model)], on_end=[tampered]))


def _after_reduce(perturb) -> None:
    def perturbed(state):
        with torch.no_grad():
            for n, p in state.model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    d = perturb(state, n, p, g)
                    if hasattr(p.grad, "full_tensor"):
                        from torch.distributed.tensor import distribute_tensor
                        d = distribute_tensor(d, p.grad.device_mesh, p.grad.placements)
                    p.grad.add_(d)

    install(Hooks(on_reduced=[perturbed]))


def _pattern(n, shape):
    g = torch.Generator().manual_seed(sum(map(ord, n)))
    return (torch.rand(shape, generator=g) < 0.5).float() * 2 - 1


def sustained_5e6() -> None:
    """Every step, every tensor: g += 5e-6 * max|g| * a FIXED sign pattern
    (a systematic bias just under gradref's 1e-5 relative bound)."""
    _after_reduce(lambda state, n, p, g: 5e-6 * g.abs().max() * _pattern(n, g.shape).to(g))


def sustained_8e6() -> None:
    """As sustained_5e6 with 8e-6."""
    _after_reduce(lambda state, n, p, g: 8e-6 * g.abs().max() * _pattern(n, g.shape).to(g))


def bf16_bias() -> None:
    """Under reduce='bf16': g += 0.4 W u |g| sign(pattern): a SYSTEMATIC bias
    inside the bf16 wire bound W u sum t|g|/T (u = 2^-8)."""
    _after_reduce(lambda state, n, p, g: 0.4 * state.plan.world * 2.0**-8 * g.abs() * _pattern(n, g.shape).to(g))


def bf16_decay() -> None:
    """Under reduce='bf16': g += 0.4 W u |g| sign(p): extra weight decay
    hidden inside the bf16 wire bound."""
    _after_reduce(lambda state, n, p, g: 0.4 * state.plan.world * 2.0**-8 * g.abs()
                  * torch.sign(p.full_tensor() if hasattr(p, "full_tensor") else p).detach())


def eval_wrong() -> None:
    """The fleet's eval reports a constant: nothing judges the eval."""
    def zero(ev):
        ev.loss = 0.0

    install(Hooks(on_eval=[zero]))


FAULTS.update({f.__name__: f for f in (lr_x1_5, lr_last_x3, final_tamper, sustained_5e6,
                                       sustained_8e6, bf16_bias, bf16_decay, eval_wrong)})


def loads_rank0() -> None:
    """Every rank moves the routing bias by rank 0's LOCAL loads times W
    (broadcast): ranks stay equal, the bias moves by rank-local loads."""
    import torch.distributed as dist

    def local(state):
        mine = state.local_loads.clone()
        dist.broadcast(mine, 0)
        state.loads = mine * state.plan.world

    install(Hooks(on_reduced=[local]))


def reverse_loads(state) -> None:
    """An on_reduced hook: the step's global expert loads reversed (expert e gets expert E-1-e's load)."""
    state.loads = state.loads.flip(-1)


def loads_reversed() -> None:
    """The routing bias moves by the step's global expert loads REVERSED
    (reverse_loads): ranks stay equal, the gradients and the optimizer's
    update are right; only the bias moves wrongly (the gate's gradref loads
    and the recording's buffers check catch it; in one process a test passes
    reverse_loads to train() as its own hook)."""
    install(Hooks(on_reduced=[reverse_loads]))


FAULTS.update({f.__name__: f for f in (loads_rank0, loads_reversed)})


def ns_bf16() -> None:
    """The fleet runs Newton-Schulz in bfloat16 (the recipe says float32) and
    records it: the curve then stops judging tensors (it reads the fleet's config)."""
    _fleet_run_tweak(ns_dtype="bfloat16")


def ns_bf16_minlr() -> None:
    """ns_bf16, and the schedule's floor at 0.9 (late lr wrong)."""
    _fleet_run_tweak(ns_dtype="bfloat16", min_lr_frac=0.9)


def no_clip_mixed() -> None:
    """The fleet does not clip (recorded): for mixed-length profiles (no curve)."""
    _fleet_run_tweak(grad_clip=0.0)


FAULTS.update({f.__name__: f for f in (ns_bf16, ns_bf16_minlr, no_clip_mixed)})


def bf16_decay_small() -> None:
    """bf16_decay at 0.2 W u |g| sign(p), added to the reduced gradient."""
    _after_reduce(lambda state, n, p, g: 0.2 * state.plan.world * 2.0**-8 * g.abs()
                  * torch.sign(p.full_tensor() if hasattr(p, "full_tensor") else p).detach())


FAULTS.update({f.__name__: f for f in (bf16_decay_small,)})



# ----------------------------------------------------------------- issue 16


STALE_STEP = 3  # the step the stale faults hit


def mean_of_ranks_loss() -> None:
    """The fleet logs the plain mean of its ranks' losses, sum_r L_r / W, instead
    of the token-weighted mean: after the reduce, the step's loss is replaced
    by sum_r L_r / W, each rank's L_r = (its share t_r L_r / T) * T / t_r,
    summed over the ranks. Its gradients stay right."""
    import torch.distributed as dist

    def plain(state):
        plan = state.plan
        mine = torch.tensor(state.local_loss * plan.tokens / (plan.world * plan.shapes[state.rank].tokens),
                            dtype=torch.float64)
        dist.all_reduce(mine)
        state.loss = float(mine)

    install(Hooks(on_reduced=[plain]))


def stale_weights() -> None:
    """At step STALE_STEP rank 1 runs its forward and backward on the weights
    after step STALE_STEP - 2 (the previous step's), then the current ones
    are put back before the optimizer step: one step's local gradient is stale.
    (Rank 1 records no snapshots, so its trace is not changed by the swap.)"""
    kept = {}

    def after_step(step, model, info):
        if os.environ.get("RANK") != "1":
            return
        params = dict(model.named_parameters())
        if step == STALE_STEP - 2:
            kept["prev"] = {n: p.detach().clone() for n, p in params.items()}
        elif step == STALE_STEP - 1:
            kept["now"] = {n: p.detach().clone() for n, p in params.items()}
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(kept["prev"][n])

    def after_reduce(state):
        if state.step == STALE_STEP and state.rank == 1:
            with torch.no_grad():
                for n, p in state.model.named_parameters():
                    p.copy_(kept["now"][n])

    install(Hooks(on_step=[after_step], on_reduced=[after_reduce]))


def fsdp_stale_shard() -> None:
    """Under shard='fsdp': at step STALE_STEP rank 1's shard of every reduced
    gradient is the one it held at the step before (a shard that kept last
    step's gradient), put in place after the reduce."""
    kept = {}

    def stale(state):
        if state.rank != 1:
            return
        grads = {n: p.grad for n, p in state.model.named_parameters() if p.grad is not None}
        now = {n: g.to_local().detach().clone() for n, g in grads.items()}
        if state.step == STALE_STEP:
            with torch.no_grad():
                for n, g in grads.items():
                    if n in kept:
                        g.to_local().copy_(kept[n])
        kept.clear()
        kept.update(now)

    install(Hooks(on_reduced=[stale]))


def bf16_decay_scaled() -> None:
    """bf16_decay at DORMOUSE_TEST_FAULT_SCALE x W u |g| sign(p)."""
    f = float(os.environ["DORMOUSE_TEST_FAULT_SCALE"])
    _after_reduce(lambda state, n, p, g: f * state.plan.world * 2.0**-8 * g.abs()
                  * torch.sign(p.full_tensor() if hasattr(p, "full_tensor") else p).detach())


FAULTS.update({f.__name__: f for f in (mean_of_ranks_loss, stale_weights, fsdp_stale_shard, bf16_decay_scaled)})


def hash_order() -> None:
    """Each rank lays a gradient out for the reduce in an order set by Python's
    string hash (reversed where hash(name) is odd) and back after it, as code
    iterating a set of names would: harmless where every rank's interpreter
    hashes alike (ranks forked from one agent share its hash secret), a mix of
    elements across ranks where not (an interpreter per rank, as on separate
    machines; with ~20 parameters the ranks agree on all by chance 1 in 10^6)."""
    def flip(grads) -> None:
        for name, g in grads.items():
            if hash(name) % 2:
                g.copy_(g.flatten().flip(0).view_as(g))

    install(Hooks(on_local_grads=[lambda piece: flip(piece.grads)],
                  on_reduced=[lambda state: flip({n: p.grad for n, p in state.model.named_parameters()
                                                  if p.grad is not None})]))


FAULTS.update({f.__name__: f for f in (hash_order,)})

# ----------------------------------------------------------------- several faults in one launch


def seams() -> list[list]:
    """Every list a fault may add to: the loop's installed hooks, the gate
    modes' run hooks, model hooks and run scopes, and the recording's rebuild
    hooks. A fault acts only through these (tests/gate/record/test_fault_seams.py
    holds every fault to it)."""
    import dormouse.gate.record.dormouse_loop as dormouse_loop
    import dormouse.gate.record.modes.base as base
    import dormouse.train.hooks as hooks

    return [hooks._INSTALLED, base._RUN_HOOKS, base._MODEL_HOOKS, base._RUN_SCOPES, dormouse_loop._BUILD_HOOKS]


class scoped:
    """`with scoped(fault):` the fault (or none) for one run, undone after it:
    every hook it installed is removed."""

    def __init__(self, fault: str | None):
        self.fault = fault

    def __enter__(self):
        self.saved = [(s, list(s)) for s in seams()]
        if self.fault:
            FAULTS[self.fault]()
        return self

    def __exit__(self, *exc):
        for s, items in self.saved:
            s[:] = items
        return False


def per_run(table: dict[str, str | None]) -> None:
    """DORMOUSE_TEST_FAULTS: {out dir: fault or null} for the runs of one
    launch's plan; each run gets its own fault (a run scope of the modes),
    none leaks into the next."""
    def scope(s):
        if str(s.out_dir) not in table:  # a run the table does not name would silently train clean
            raise SystemExit(f"DORMOUSE_TEST_FAULTS names {sorted(table)}, not the run {str(s.out_dir)!r}")
        return scoped(table[str(s.out_dir)])

    modes.install_run_scope(scope)


if __name__ == "__main__":
    if "DORMOUSE_TEST_FAULTS" in os.environ:
        import json

        per_run(json.loads(os.environ["DORMOUSE_TEST_FAULTS"]))
    else:
        FAULTS[os.environ["DORMOUSE_TEST_FAULT"]]()
    from dormouse.gate.__main__ import main

    if "," in sys.argv[1]:  # several in-process modes one after another ("single,gradref,reference"): one start-up
        for mode in sys.argv[1].split(","):
            if main([mode, *sys.argv[2:]]):
                sys.exit(f"{mode} failed")
        sys.exit(0)
    sys.exit(main())
