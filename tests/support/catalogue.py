"""The catalogue of what the gate catches: every integration case of tests/gate/catches one row of
one table (CASES), the fleets they run in one row each of another (FLEETS). A test file's launch
fixture runs its fleet's rows (`runs`, `argv`), its parametrised test holds each row's verdict to
the row (casecheck.gives), and docs/catches.md is written from the same rows (catches_doc.py).

A row says: the run (its id, the fleet it is launched in, the client's options, the fault planted,
None for a clean run), the verdict it must get (PASS, FAIL, or refused: the reference refuses the
recording in one line), the checks that must fail with words their reason holds, the checks that
may fail besides (None: any) with the words they hold when they do, checks that must pass with
words of theirs, and the independent confirmation that checks the verdict (a computation of the
test file's own that shares no code with the gate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

Words = tuple[str, ...]
VERDICTS = ("PASS", "FAIL", "refused")


@dataclass(frozen=True)
class Fleet:
    """One launch: the client script (tests/support/<client>) at `world` gloo ranks, its layout in words,
    the test file whose module-scoped fixture launches it, the options every run of it takes unless its
    row says otherwise, and the client's option a fault is planted through (None: the row's options)."""
    name: str
    client: str
    world: int
    layout: str
    test: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fault_key: str | None = "fault"


@dataclass(frozen=True)
class Case:
    """One integration case (the module docstring says what each field is)."""
    id: str
    fleet: str
    config: Mapping[str, Any] | str | tuple[str, ...] = field(default_factory=dict)
    fault: str | None = None
    verdict: str = "PASS"
    fails: Mapping[str, Words] = field(default_factory=dict)
    may_fail: Mapping[str, Words] | None = None
    holds: Mapping[str, Words] = field(default_factory=dict)
    confirmation: str = ""
    what: str = ""

    def __post_init__(self):
        assert self.verdict in VERDICTS, (self.id, self.verdict)
        assert (self.verdict == "PASS") == (not self.fails) or self.verdict == "refused", self.id
        for name in ("fails", "holds") + (("may_fail",) if self.may_fail is not None else ()):
            words = {k: (w,) if isinstance(w, str) else tuple(w) for k, w in getattr(self, name).items()}
            object.__setattr__(self, name, MappingProxyType(words))
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", MappingProxyType(dict(self.config)))

    @property
    def client(self) -> str:
        return FLEETS[self.fleet].client


def of(fleet: str) -> list[Case]:
    """The fleet's rows, in the order its launch trains them."""
    assert fleet in FLEETS, fleet
    return [c for c in CASES if c.fleet == fleet]


def case(fleet: str, id: str) -> Case:
    return next(c for c in of(fleet) if c.id == id)


def ids(fleet: str) -> list[str]:
    return [c.id for c in of(fleet)]


def run(c: Case) -> dict:
    """A run-dict client's options for the row: the fleet's defaults, the row's, the fault."""
    f = FLEETS[c.fleet]
    return {**f.defaults, **c.config, **({f.fault_key: c.fault} if c.fault and f.fault_key else {})}


def runs(fleet: str) -> dict[str, dict]:
    """{id: the client's run dict} of the fleet's rows (looprec.launched's `runs`)."""
    return {c.id: run(c) for c in of(fleet)}


def argv(fleet: str) -> list[str]:
    """The fleet's rows as a framework client's arguments ("id:k=v:..."; a row of legs, one per leg)."""
    f, out = FLEETS[fleet], []
    for c in of(fleet):
        legs = c.config if isinstance(c.config, tuple) else (c.config if isinstance(c.config, str) else "",)
        for i, leg in enumerate(legs):
            fault = f"fault={c.fault}" if c.fault and f.fault_key and i == len(legs) - 1 else ""
            fault = fault.replace("fault=", f"{f.fault_key}=")
            out.append(":".join(x for x in (c.id, leg, fault) if x))
    return out


# ---------------------------------------------------------------------------------------------- the fleets

DDP = "tests/support/ddp_loop.py: a plain loop, gradient accumulation, variable-length padded rows"
FLEETS: dict[str, Fleet] = {f.name: f for f in (
    Fleet("ddp", "ddp_loop.py", 2, "DDP and FSDP2, 2 gloo ranks (resumes in a second launch)",
          "test_ddp_fsdp_loops.py", {"steps": 4}),
    Fleet("review", "ddp_loop.py", 2, "DDP, 2 gloo ranks: a reviewer's attacks and clean loops at other settings",
          "test_ddp_loops_written_from_the_docs.py", {"steps": 4}),
    Fleet("causes", "ddp_loop.py", 2, "DDP and FSDP2, 2 gloo ranks: the causes the judge names",
          "test_named_causes.py", {"steps": 2, "micro": 2}),
    Fleet("precision", "ddp_loop.py", 2, "DDP under bfloat16/float16 autocast, 2 gloo ranks, 3 micro-batches a step",
          "test_reduced_precision_loops.py", {"steps": 3}),
)}
EVERY_CHECK = dict.fromkeys(("independence", "gradient", "grad_mask", "replay", "data", "loss", "ranks", "clip"), ())
AC = {"seed": 8, "autocast": True}
SKETCHED = {**EVERY_CHECK, "gradient": ("sketch k=64", "detected with probability")}

# ---------------------------------------------------------------------------------------------- the cases

CASES: tuple[Case, ...] = (
    # ---------------------------------------------------------------- ddp: the plain DDP / FSDP2 loop
    Case("clean0", "ddp", {"seed": 0, "steps": 6}, holds=EVERY_CHECK),
    Case("clean1", "ddp", {"seed": 1}, holds={**EVERY_CHECK, "independence": (
        "5 of 24 micro-batches differentiated row by row", "the step's 12 rows in 1 forward (padded on the right")}),
    Case("clean2", "ddp", {"seed": 2}, holds=EVERY_CHECK),
    Case("clean_resume", "ddp", {"seed": 3, "stop_at": 2, "leg": 1}, holds={**EVERY_CHECK, "replay": "across 1 resume"}),
    Case("fsdp", "ddp", {"seed": 4, "fsdp": True}, holds=EVERY_CHECK),
    Case("sketch", "ddp", {"seed": 5, "sketch": 64, "every": 2, "steps": 5}, holds=SKETCHED),
    Case("fsdp_sketch", "ddp", {"seed": 6, "fsdp": True, "sketch": 64}, holds=SKETCHED),
    Case("micro_mean", "ddp", fault="micro_mean", verdict="FAIL",
         fails={"gradient": "mean of per-micro-batch token means"}),
    Case("comp_twice", "ddp", fault="comp_twice", verdict="FAIL", fails={"gradient": "= W "}),
    Case("comp_none", "ddp", fault="comp_none", verdict="FAIL", fails={"gradient": "= 1/W "}),
    Case("local_count", "ddp", fault="local_count", verdict="FAIL",
         fails={"gradient": "each rank normalised by its own token count"}),
    Case("same_data", "ddp", fault="same_data", verdict="FAIL", fails={"data": "every rank read the same data"},
         holds={"gradient": ()}, what="every rank reads the same batch: the gradient is right, only data sees it"),
    Case("bn", "ddp", fault="bn", verdict="FAIL", fails={"independence": "BatchNorm (bn)"}),
    Case("dropout", "ddp", fault="dropout", verdict="FAIL", fails={"independence": "active dropout (drop)"}),
    Case("bn_frozen", "ddp", {"eval_modules": ["bn"]}, "bn", what="BatchNorm in eval mode (running statistics)",
         confirmation="the same recording without its modes fails independence"),
    Case("dropout_off", "ddp", {"eval_modules": ["drop"]}, "dropout", what="a dropout module in eval mode"),
    Case("bn_frozen_rank1", "ddp", {"eval_modules": ["bn"], "eval_rank": 1}, "bn", verdict="FAIL",
         fails={"ranks": "rank 1's micro-batch 0 ran other submodules in eval mode (bn) than rank 0's first (none)"},
         what="rank 1 alone froze its BatchNorm"),
    Case("frozen_script", "ddp", {"freeze": ["pos.weight"]}, what="a parameter frozen by the script",
         confirmation="without the recorded freeze the reference trains pos.weight and grad_mask fails"),
    Case("position_ids", "ddp", {"position_ids": True}, what="a forward keyword beyond Recorder(inputs=...)",
         confirmation="without the recorded position_ids the gradient check fails"),
    Case("left_pad", "ddp", {"left_pad": True}, verdict="FAIL",
         fails={"independence": "or on its padding (left padding with absolute positions)"},
         what="left padding with absolute positions: a row's function depends on its padding"),
    Case("fsdp_unsharded_probe", "ddp", {"fsdp": True, "fsdp_layers": True, "max_grad_norm": 0.0}, "nograd_log",
         holds=EVERY_CHECK, what="FSDP2 layers kept unsharded, a no-grad probe forward before rec.step"),
    Case("fsdp_unsharded_clip", "ddp", {"fsdp": True, "fsdp_layers": True}, "nograd_log", verdict="FAIL",
         fails={"clip": "the loop clipped by a gradient norm of 0"},
         what="... and clip_grad_norm_ after the probe: it reads unsharded parameters holding no gradient"),
    Case("clip_local", "ddp", fault="clip_local", verdict="FAIL", fails={"clip": "local norm"}),
    Case("unused_zero", "ddp", fault="unused_zero", verdict="FAIL",
         fails={"grad_mask": "spare.bias, spare.weight had a gradient (all zeros)"}),
    Case("resume_drop_sched", "ddp", {"stop_at": 2, "leg": 1}, "resume_drop_sched", verdict="FAIL",
         fails={"replay": "the resume dropped the lr scheduler's state"}),
    Case("loss_rank_mean", "ddp", fault="loss_rank_mean", verdict="FAIL", may_fail={},
         fails={"loss": ("the mean of the ranks' own token means", "the logged loss is wrong, not the training")},
         holds={"gradient": (), "replay": ()}),
    Case("sketch_comp_twice", "ddp", {"sketch": 64, "every": 2, "steps": 5}, "comp_twice", verdict="FAIL",
         fails={"gradient": "= W "}),
    Case("resume_data", "ddp", {"stop_at": 2, "leg": 1}, "resume_data", verdict="FAIL",
         fails={"data": "an example was read twice within epoch 0 (steps 1 and 3"}),
    # the resume at step 3 with a fresh AdamW(lr=1e-2) under LambdaLR: its lr is 1e-2 x the warm-up's first
    # factor, 1/3 (loopmodel.lr_factor(0)), where the schedule's third step gives 1e-2 x 0.9
    Case("resume_noopt", "ddp", {"stop_at": 2, "leg": 1}, "resume_noopt", verdict="FAIL",
         fails={"replay": f"the loop's lr at step 3 is {1e-2 / 3:.6g}, the optimizer's initial lr, where the "
                          f"uninterrupted scheduler gives {1e-2 * 0.9:.6g}: the resume did not load the "
                          "optimizer's state"}),
    # the lr right, the first update after the resume (step 3) wrong: the moments named
    Case("resume_nomoments", "ddp", {"stop_at": 2, "leg": 1}, "resume_nomoments", verdict="FAIL",
         fails={"replay": "the first update after the resume at step 3 is the first that differs, with the "
                          "parameters and the lr right, so the resume did not restore the optimizer's state"}),
    Case("rank_lr", "ddp", fault="rank_lr", verdict="FAIL",
         fails={"ranks": "rank 1's parameters or persistent buffers differ from rank 0's before step 2"}),
    Case("fsdp_local_count", "ddp", {"fsdp": True}, "local_count", verdict="FAIL",
         fails={"gradient": "each rank normalised by its own token count"}),
    Case("fsdp_clip_local", "ddp", {"fsdp": True}, "clip_local", verdict="FAIL",
         fails={"clip": "each rank its own, where the global gradient's norm is"}),
    Case("fsdp_comp_twice", "ddp", {"fsdp": True}, "comp_twice", verdict="FAIL", fails={"gradient": "= W "}),
    # ---------------------------------------------------------------- review: a reviewer's attacks, the same loop
    Case("clean_lowlr_noclip", "review", {"seed": 12, "max_grad_norm": 0, "lr": 1e-3}),
    Case("clean_sketch_every3", "review", {"seed": 13, "sketch": 64, "every": 3, "lr": 3e-2, "steps": 7}),
    Case("clean_drop_last", "review", {"seed": 14, "n": 50, "steps": 10}, holds={"data": "epochs inferred from dataset_len"},
         what="50 examples, 48 read per epoch (drop_last), 10 steps over 3 epochs"),
    Case("clean_drop_last_epoch", "review", {"seed": 14, "n": 50, "steps": 10, "epoch": True},
         holds={"data": "the loop's epochs (rec.step(epoch=...): 3 epoch(s), 120 reads"},
         what="... with the loop's own epochs given"),
    Case("dup_data", "review", fault="dup_data", verdict="FAIL", may_fail={},
         fails={"data": "identical rows: pass example_ids="}, what="a clean loop over a dataset of identical rows"),
    Case("dup_data_ids", "review", {"ids": True}, "dup_data", holds={"data": "identified by the example ids given"},
         what="... with example_ids"),
    Case("nograd_log", "review", fault="nograd_log", what="a train-mode forward under torch.no_grad() (a probe loss)",
         confirmation="the recording holds the loop's 3 micro-batches"),
    Case("rank1_eps4", "review", {"eps": 1e-4}, "rank1_eps", verdict="FAIL",  # 1+1e-4 on one rank: 7.5e-5 > 1e-5
         fails={"gradient": "differs from one process's gradient"}),
    Case("bias_x2", "review", fault="bias_x2", verdict="FAIL", fails={"gradient": "tensor ln1.bias"}),
    Case("row_x2", "review", fault="row_x2", verdict="FAIL", fails={"gradient": "tensor tok.weight"}),
    Case("bias_eps_sketch", "review", {"eps": 1e-4, "sketch": 64}, "bias_eps", verdict="FAIL", fails={"gradient": (
        "in any one tensor is detected", "each tensor's sketch against its own bound", "in tensor ln1.bias")},
         what="ln1.bias's gradient off by 1e-4 under sketches k=64", confirmation="the stated bound is below 1e-4"),
    Case("no_shift", "review", fault="no_shift", verdict="FAIL", fails={"gradient": "not by a constant factor"}),
    Case("double_shift", "review", fault="double_shift", verdict="FAIL", fails={"gradient": "not by a constant factor"}),
    Case("sched_twice", "review", fault="sched_twice", verdict="FAIL",
         fails={"replay": "the loop's lr at step 2 is 0.009 where its scheduler, replayed, gives 0.00633333"}),
    Case("wd_wrong", "review", fault="wd_wrong", verdict="FAIL", fails={"replay": "parameters before step 2 differ"}),
    Case("fwd_no_bwd", "review", fault="fwd_no_bwd", verdict="FAIL",
         fails={"gradient": "differs from one process's gradient"}),
    Case("late_x15_every3", "review", {"every": 3}, "late_x15", verdict="FAIL",
         fails={"replay": "the recorded parameters differ from one process trained",
                "gradient": "after the parameters parted"}, what="loss x1.5 at step 2 only, tensors every 3 steps"),
    # ---------------------------------------------------------------- causes: what the judge names, the same loop
    Case("clean", "causes", {"max_grad_norm": 0.5}, holds={"intact": (), "finite": ()},
         what="the clip binds: coefficients below 1 to hold max_grad_norm against"),
    Case("nan_grad", "causes", {"nan": {"step": 2, "rank": 1, "where": "grad"}}, verdict="FAIL",
         fails={"finite": "at step 2 rank 1's gradient of", "gradient": "see finite", "clip": "see finite"},
         what="a NaN in rank 1's gradient alone, after the all-reduce",
         confirmation="the test's own scan finds the first NaN at that step and rank"),
    Case("nan_loss", "causes", {"nan": {"step": 2, "rank": 1, "where": "loss"}}, verdict="FAIL",
         fails={"finite": "at step 2 rank 0's gradient of", "gradient": "see finite", "clip": "see finite",
                "loss": ("see finite", "the logged loss at step 2 is nan"), "ranks": ()},
         what="a NaN loss on rank 1: the all-reduce spreads it, NaN logged",
         confirmation="the test's own scan finds the first NaN at that step and rank"),
    *(Case(f"count_{how}", "causes", {"count": how}, verdict="FAIL", what=f"the loss sum divided by a {how} count",
           fails={"gradient": ("a scalar that changes from step to step", words)},
           confirmation="the counts the cause names are the loop's own count_of")
      for how, words in (("padding", "padding counted as tokens"), ("unshifted", "one extra target per row"))),
    Case("count_unshifted_same_rows", "causes", {"count": "unshifted"}, "same_data", verdict="FAIL",
         fails={"gradient": "one extra target per row"}, what="... on ranks reading the same rows",
         confirmation="the counts the cause names are the loop's own count_of"),
    Case("count_rank0", "causes", {"count": "rank0"}, verdict="FAIL", fails={"gradient": (
        "a scalar that changes from step to step", "rank 0's own target count times W, used by every rank")},
         confirmation="the counts the cause names are the loop's own count_of"),
    Case("count_padding_equal", "causes", {"count": "padding", "pad_to": 12}, verdict="FAIL",
         fails={"gradient": ("a scalar that changes from step to step", "padding counted as tokens")},
         what="every rank padded to one length", confirmation="the counts the cause names are the loop's own count_of"),
    Case("last_k_twice", "causes", {"micro": 3}, "last_k_twice", verdict="FAIL", fails={"gradient": (
        "the loss divided by K twice on the last micro-batch (K = 3",
        "last micro-batch 0.3333, 0.3333 times the other micro-batches")},
         confirmation="the gradient recomputed from the recorded rows with the last micro-batch weighted 1/3"),
    # rows of 3 tokens (every micro-batch 6 targets), the last step reads 2 of K = 3 micro-batches: the textbook
    # mean / K accumulation is then the token mean at full steps, and 2/3 of it at the short one; and right
    Case("short_step", "causes", {"fixed_len": 3, "short_last": True, "micro": 3}, "micro_mean", verdict="FAIL",
         fails={"gradient": ("1, 0.6667 at steps 1, 2", "a short last step still divided by K")},
         confirmation="step 2's gradient recomputed from its recorded rows is 2/3 of the token mean's"),
    Case("short_step_clean", "causes", {"fixed_len": 3, "short_last": True, "micro": 3}),
    Case("no_sync_all", "causes", {"no_sync_all": True}, verdict="FAIL",
         fails={"gradient": "the gradients were never all-reduced: at step 1"},
         confirmation="the ranks' recorded gradients differ"),
    Case("clip_local", "causes", fault="clip_local", verdict="FAIL", fails={"clip": "clipping by a local norm"},
         what="each rank clips by its local norm, then all-reduces"),
    Case("bf16_hook", "causes", {"bf16_hook": True, "max_grad_norm": 0.0}, verdict="FAIL",
         fails={"gradient": ("all-reduced in bfloat16", "declare it, Recorder(wire='bf16')")},
         confirmation="every recorded gradient is a bfloat16 value"),
    Case("bf16_wire", "causes", {"bf16_hook": True, "max_grad_norm": 0.0, "wire": "bf16"},
         holds={"gradient": "declared bf16 wire's bound", "bias": ()}, what="a bf16 wire declared",
         confirmation="each element within W u sum_r |g_r| by the test's own figure"),
    Case("bf16_wire_clip", "causes", {"bf16_hook": True, "max_grad_norm": 0.05, "wire": "bf16"},
         what="... and the clip binds", confirmation="each element within W u sum_r |g_r| by the test's own figure"),
    Case("bf16_wire_decay", "causes", {"bf16_hook": True, "max_grad_norm": 0.0, "wire": "bf16"}, "wire_decay",
         verdict="FAIL", fails={"bias": ("biased beyond the bf16 wire's rounding", "decay")}, holds={"gradient": ()},
         what="a hook folding an extra weight decay inside the wire's rounding",
         confirmation="inside the bound, its mean along sign(p) clearly positive by the test's own figures"),
    Case("fp32_declared_bf16", "causes", {"wire": "bf16", "max_grad_norm": 0.0}, verdict="FAIL",
         fails={"gradient": "declares a bf16 wire"}, what="a float32 fleet declared bf16"),
    Case("fsdp_rank_seed", "causes", {"fsdp": True, "rank_seed": True}, verdict="refused", fails={"reference": (
        "the ranks started from different parameters: rank 0's recorded initial tensors equal build_model's, "
        "rank 1's do not",)}, what="FSDP2 ranks seeded apart", confirmation="rank 1's shard is build_model(seed=1)'s"),
    Case("same_rows_ids", "causes", {"ids": True, "rank_ids": True}, "same_data", verdict="FAIL",
         fails={"data": "at step 1 ranks 0 and 1 read identical rows, token for token"},
         what="ranks reading the same rows under distinct ids", confirmation="the rows equal, the ids disjoint"),
    # ---------------------------------------------------------------- precision: a reviewer's reduced-precision attacks
    Case("clean", "precision", AC, what="bfloat16 autocast"),
    Case("fp16", "precision", {**AC, "ac_dtype": "float16"}, what="float16 autocast"),
    Case("loss_outside", "precision", {**AC, "loss_outside": True}, holds={"loss": "loss floor"},
         what="the cross-entropy outside the autocast, on the forward's bfloat16 logits"),
    Case("flat_patch", "precision", {"seed": 8, "model": {"kind": "flat"}, "patch_forward": True}, verdict="FAIL",
         fails={"gradient": ()}, what="a model with no submodules whose forward enters autocast: a false FAIL "
         "(documented limit), never a false PASS", confirmation="the difference is round-off sized (< 0.05)"),
    Case("amp_comp_twice", "precision", {**AC, "model": {"kind": "amp", "amp": 300.0}}, "comp_twice", verdict="FAIL",
         fails={"gradient": "not judged in reduced precision"},
         what="a gradient carrying 300 x the bfloat16 round-off, doubled"),
    Case("ac1_eps02", "precision", {**AC, "ac_steps": [1], "eps": 0.02}, "rank1_eps", verdict="FAIL",
         fails={"gradient": "differs"}, what="autocast at step 1 only; rank 1's loss x 1.02 (float32 steps 2, 3)"),
    Case("every2", "precision", {**AC, "every": 2, "steps": 4}, what="tensors every 2 steps under autocast"),
    Case("row_x2", "precision", AC, "row_x2", verdict="FAIL", fails={"gradient": "tok.weight"},
         what="one row of tok.weight's gradient doubled after the all-reduce"),
    Case("ac_micro0", "precision", {**AC, "ac_micro": [0]}, what="autocast on the first micro-batch of every step",
         confirmation="the bound stays under 0.1"),
)
