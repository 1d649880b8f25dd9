"""The catalogue of what the gate catches: every integration case of tests/gate/catches one row of
one table (CASES), the fleets they run in one row each of another (FLEETS). A test file's launch
fixture runs its fleet's rows (`runs`, `argv`), its parametrised test holds each row's verdict to
the row (casecheck.gives), and docs/catches.md is written from the same rows (catches_doc.py).

A row says: the run (its id, the fleet it is launched in, the client's options, the fault planted,
None for a clean run), the verdict it must get (PASS, FAIL, or refused: the reference refuses the
recording in one line), the checks that must fail with words their reason holds, the checks that
may fail besides (None: any) with the words they hold when they do, checks that must pass with
words of theirs, and the independent confirmation that checks the verdict (a computation of the
test file's own that shares no code with the gate). A row marked `slow` (a variant whose mechanism
another row of CI's already holds) is launched and judged only where slow tests run: conftest sets
SKIP_SLOW under CI's `-m "not slow"`, and `runs`/`argv` leave such a row out."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

Words = tuple[str, ...]
VERDICTS = ("PASS", "FAIL", "refused")
SKIP_SLOW = False  # conftest: True when the session deselects slow tests


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
    slow: bool = False

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


def launched(fleet: str) -> list[Case]:
    """The fleet's rows its launch trains in this session (a slow row only where slow tests run)."""
    return [c for c in of(fleet) if not (c.slow and SKIP_SLOW)]


def ids(fleet: str) -> list[str]:
    return [c.id for c in of(fleet)]


def run(c: Case) -> dict:
    """A run-dict client's options for the row: the fleet's defaults, the row's, the fault."""
    f = FLEETS[c.fleet]
    return {**f.defaults, **c.config, **({f.fault_key: c.fault} if c.fault and f.fault_key else {})}


def runs(fleet: str) -> dict[str, dict]:
    """{id: the client's run dict} of the fleet's rows (looprec.launched's `runs`)."""
    return {c.id: run(c) for c in launched(fleet)}


def argv(fleet: str) -> list[str]:
    """The fleet's rows as a framework client's arguments ("id:k=v:..."; a row of legs, one per leg)."""
    f, out = FLEETS[fleet], []
    for c in launched(fleet):
        legs = c.config if isinstance(c.config, tuple) else (c.config if isinstance(c.config, str) else "",)
        for i, leg in enumerate(legs):
            fault = f"{f.fault_key}={c.fault}" if c.fault and f.fault_key and i == len(legs) - 1 else ""
            out.append(":".join(x for x in (c.id, leg, fault) if x))
    return out


# ---------------------------------------------------------------------------------------------- the fleets

FLEETS: dict[str, Fleet] = {f.name: f for f in (
    Fleet("ddp", "ddp_loop.py", 2, "DDP and FSDP2, 2 gloo ranks (resumes in a second launch)",
          "test_ddp_fsdp_loops.py", {"steps": 4}),
    Fleet("review", "ddp_loop.py", 2, "DDP, 2 gloo ranks: a reviewer's attacks and clean loops at other settings",
          "test_ddp_loops_written_from_the_docs.py", {"steps": 4}),
    Fleet("causes", "ddp_loop.py", 2, "DDP and FSDP2, 2 gloo ranks: the causes the judge names",
          "test_named_causes.py", {"steps": 2, "micro": 2}),
    Fleet("precision", "ddp_loop.py", 2, "DDP under bfloat16/float16 autocast, 2 gloo ranks, 3 micro-batches a step",
          "test_reduced_precision_loops.py", {"steps": 3}),
    Fleet("autocast", "ddp_loop.py", 2, "DDP under bfloat16 autocast and FSDP2 mixed precision, 2 gloo ranks, 3 "
          "micro-batches a step", "test_autocast_loops.py", {"steps": 3}),
    Fleet("wild", "wild_loop.py", 2, "DDP loops written as others write them (a review's and issue trackers' "
          "workloads), 2 gloo ranks", "test_loops_we_did_not_write.py", {"seed": 3}, fault_key=None),
    Fleet("wild_pp", "tp_loop.py", 2, "pipeline (tied weights over 2 stages) and tensor-parallel loops written as "
          "others write them, 2 gloo ranks", "test_loops_we_did_not_write.py"),
    Fleet("cp", "cp_loop.py", 2, "context parallel: CP 2 on 2 gloo ranks (torch's ring or a plain one)",
          "test_context_parallel.py"),
    Fleet("cp_dp", "cp_loop.py", 4, "context parallel: CP 2 x DP 2 on 4 gloo ranks", "test_context_parallel.py"),
    Fleet("ep", "ep_loop.py", 2, "expert parallel (4 experts over 2 gloo ranks, all_to_all) and hand-written tensor "
          "parallel, declared shardings", "test_expert_parallel.py"),
    Fleet("tp", "tp_loop.py", 2, "DTensor tensor parallel (TP 2, sequence parallel, loss_parallel), DDP, and "
          "pipeline parallel (pp_loop.py, 2 stages) on 2 gloo ranks", "test_tensor_and_pipeline_parallel.py"),
    Fleet("batch", "batch_loop.py", 2, "DDP, 2 gloo ranks: objectives over more than a row (MoE balancing, in-batch "
          "contrastive), what else a forward receives, torch.compile", "test_batch_level_objectives.py"),
    Fleet("hf", "hf_client.py", 2, "Hugging Face Trainer (GPT-2, gradient accumulation 2, max_grad_norm 1.0) on 2 "
          "gloo ranks", "test_hf_trainer.py"),
    Fleet("lightning", "lightning_client.py", 2, "PyTorch Lightning, strategy ddp, accumulate_grad_batches 2, "
          "gradient_clip_val 1.0, 2 gloo ranks", "test_lightning.py", fault_key="mode"),
    Fleet("trl", "trl_client.py", 2, "TRL's SFTTrainer and DPOTrainer, PEFT LoRA (a tiny Llama, gradient accumulation "
          "2) on 2 gloo ranks", "test_trl_peft.py"),
    Fleet("grpo", "grpo_client.py", 2, "TRL's GRPOTrainer, generation included, gradient accumulation 2, on 2 gloo "
          "ranks", "test_rl_trainers.py"),
    Fleet("accelerate", "accelerate_loop.py", 2, "a hand-written accelerate loop (gradient accumulation 2) on 2 "
          "gloo ranks, run by the field sweep (examples/field/sweep.py)", "test_accelerate.py", fault_key=None),
    Fleet("own", "dormouse.gate (fleet_faults.py)", 2, "dormouse's own trainer under the gate's own fleet "
          "(GateSettings), each run with a fault of fleet_faults.py", "test_own_fleet_logged_loss_and_stale_weights.py",
          fault_key=None),
    Fleet("configs", "dormouse.gate", 2, "dormouse's own trainer under the gate's own fleet at configurations "
          "other than the tiny fixture", "test_own_fleet_configs.py", fault_key=None),
    Fleet("titan", "titan_loop.py", 2, "torchtitan's own llama and TP plan, TP 2 on 2 gloo ranks", "test_torchtitan.py"),
    Fleet("titan_2d", "titan_loop.py", 4, "torchtitan's llama, FSDP2 x TP (fsdp 2 x tp 2) on 4 gloo ranks",
          "test_torchtitan.py"),
    Fleet("dp_tp", "tp_loop.py", 4, "FSDP2 x tensor parallel (mesh dp 2 x tp 2) on 4 gloo ranks",
          "test_tensor_and_pipeline_parallel.py"),
)}
EVERY_CHECK = dict.fromkeys(("independence", "gradient", "grad_mask", "replay", "data", "loss", "ranks", "clip"), ())
CP_LAYOUT = "context parallel ({} order along dim 1): 1 data-parallel replica(s) of 2 CP rank(s)"
BY_HAND = "one process's gradient on the global rows in plain PyTorch (the test's own)"
EP_HAND = "the one-process model's autograd on the global batch (the test's own)"
TP_LAYOUT = ("mesh tp 2", "16 of 21 parameters split")
AGREE = "every module's forward output and output gradient agree"
PP_LAYOUT = ("pipeline of 2 stages", "21 parameters")
PLAIN = "the unparallelised model's gradient on the global batch (the test's own)"
TITAN = ("the layout check fails, so do gradient and loss, replay passes; rank 0's gradient is the factor times "
         "the unparallelised model's (the test's own)")
BATCH = "batchmodels' formulas on the rows batch_loop gives, one process (the test's own)"
FIELD = "one process's gradient computed by hand from the data layout (fieldkit.one_process_gradient)"
WRONG_GRADIENT = {"clip": "the gradient itself is wrong (see gradient)", "probe": "the loss is at fault, not a module"}
HF_HAND = "one process's gradient by hand"
FIX = "loss_type=ForCausalLM"  # the Trainer counts the shifted labels (see hf_client's docstring)
HF_CLEAN = {"gradient": "equals one process", "replay": "bitwise", "loss": "equals the declared objective"}
TRL_HAND = "the recorded micro-batches' gradient by hand in one process (fieldkit, its own loss code)"
GRPO_HAND = "the test's own surrogate and normalisation in plain PyTorch on the recorded micro-batches"
WILD = "one process's gradient on the loop's own rows (the test's own)"
AC = {"seed": 8, "autocast": True}
SKETCHED = {**EVERY_CHECK, "gradient": ("sketch k=64", "detected with probability")}

# ---------------------------------------------------------------------------------------------- the cases

CASES: tuple[Case, ...] = (
    # ---------------------------------------------------------------- ddp: the plain DDP / FSDP2 loop
    Case("clean0", "ddp", {"seed": 0, "steps": 6}, holds=EVERY_CHECK),
    Case("clean1", "ddp", {"seed": 1}, holds={**EVERY_CHECK, "independence": (
        "2 of 24 micro-batches differentiated row by row", "the step's 12 rows in 1 forward (padded on the right")}),
    Case("clean2", "ddp", {"seed": 2}, holds=EVERY_CHECK),
    Case("clean_resume", "ddp", {"seed": 3, "stop_at": 2, "leg": 1}, holds={**EVERY_CHECK, "replay": "across 1 resume"}),
    Case("fsdp", "ddp", {"seed": 4, "fsdp": True}, holds=EVERY_CHECK),
    Case("sketch", "ddp", {"seed": 5, "sketch": 64, "every": 2, "steps": 5}, holds=SKETCHED),
    Case("fsdp_sketch", "ddp", {"seed": 6, "fsdp": True, "sketch": 64}, holds=SKETCHED, slow=True),
    Case("micro_mean", "ddp", fault="micro_mean", verdict="FAIL",
         fails={"gradient": "mean of per-micro-batch token means"}),
    Case("comp_twice", "ddp", fault="comp_twice", verdict="FAIL", fails={"gradient": "= W "}),
    Case("comp_none", "ddp", fault="comp_none", verdict="FAIL", fails={"gradient": "= 1/W "}),
    Case("local_count", "ddp", fault="local_count", verdict="FAIL",
         fails={"gradient": "each rank normalised by its own token count"}),
    Case("same_data", "ddp", fault="same_data", verdict="FAIL", fails={"data": "every rank read the same data"},
         holds={"gradient": ()}, what="every rank reads the same batch: the gradient is right, only data sees it"),
    Case("bn", "ddp", fault="bn", verdict="FAIL", fails={"independence": "BatchNorm (bn)"}),
    Case("dropout", "ddp", fault="dropout", holds={"gradient": "equals one process's gradient", "loss": (), "clip": (),
         "independence": "not judged: the gradient changes with the RNG state (active dropout (drop))"},
         what="torch's own dropout, each rank its own RNG: each forward's masks drawn again from its recorded state",
         confirmation="one process's gradient by hand from each rank's recorded RNG state equals the fleet's; "
                      "from one seed it does not"),
    Case("bn_frozen", "ddp", {"eval_modules": ["bn"]}, "bn", what="BatchNorm in eval mode (running statistics)",
         confirmation="the same recording without its modes fails independence"),
    Case("dropout_off", "ddp", {"eval_modules": ["drop"]}, "dropout", what="a dropout module in eval mode"),
    Case("bn_frozen_rank1", "ddp", {"eval_modules": ["bn"], "eval_rank": 1}, "bn", verdict="FAIL",
         fails={"ranks": "rank 1's micro-batch 0 ran other submodules in eval mode (bn) than rank 0's first (none)"},
         what="rank 1 alone froze its BatchNorm"),
    Case("eval_model", "ddp", {"eval_modules": [""], "dropout": 0.1, "steps": 3}, "dropout",
         holds={"gradient": "equals one process's gradient"},
         what="the whole model in eval mode (model.eval(): its dropout off), its output backpropagated",
         confirmation="the same recording judged with its forwards in training mode fails the gradient"),
    Case("rank1_p", "ddp", {"rank1_p": 0.3, "steps": 3}, "dropout", verdict="FAIL",
         fails={"ranks": "rank 1's module 'drop' has p = 0.3, rank 0's 0.1 (set before the Recorder started)"},
         what="rank 1 set its dropout's p before the Recorder started"),
    Case("frozen_script", "ddp", {"freeze": ["pos.weight"]}, what="a parameter frozen by the script",
         confirmation="without the recorded freeze the reference trains pos.weight and grad_mask fails"),
    Case("position_ids", "ddp", {"position_ids": True}, what="a forward keyword beyond RecordingSpec(inputs=...)",
         confirmation="without the recorded position_ids the gradient check fails"),
    Case("left_pad", "ddp", {"left_pad": True}, verdict="FAIL",
         fails={"independence": "or on its padding (left padding with absolute positions)"},
         what="left padding with absolute positions: a row's function depends on its padding"),
    Case("fsdp_unsharded_probe", "ddp", {"fsdp": True, "fsdp_layers": True, "max_grad_norm": 0.0}, "nograd_log",
         holds=EVERY_CHECK, what="FSDP2 layers kept unsharded, a no-grad probe forward before rec.step"),
    Case("fsdp_unsharded_clip", "ddp", {"fsdp": True, "fsdp_layers": True}, "nograd_log", verdict="FAIL",
         fails={"clip": "the loop clipped by a gradient norm of 0"},
         what="... and clip_grad_norm_ after the probe: it reads unsharded parameters holding no gradient", slow=True),
    Case("clip_local", "ddp", fault="clip_local", verdict="FAIL", fails={"clip": "local norm"}),
    Case("unused_zero", "ddp", fault="unused_zero", verdict="FAIL",
         fails={"grad_mask": "spare.bias, spare.weight had a gradient (all zeros)"}),
    Case("resume_drop_sched", "ddp", {"stop_at": 2, "leg": 1}, "resume_drop_sched", verdict="FAIL",
         fails={"replay": "the resume dropped the lr scheduler's state"}),
    Case("loss_rank_mean", "ddp", fault="loss_rank_mean", verdict="FAIL", may_fail={},
         fails={"loss": ("the mean of the ranks' own token means", "the logged loss is wrong, not the training")},
         holds={"gradient": (), "replay": ()}),
    Case("sketch_comp_twice", "ddp", {"sketch": 64, "every": 2, "steps": 5}, "comp_twice", verdict="FAIL",
         fails={"gradient": "= W "}, slow=True),
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
                          "parameters and the lr right, so the resume did not restore the optimizer's state"}, slow=True),
    Case("rank_lr", "ddp", fault="rank_lr", verdict="FAIL",  # named at the step it starts, not by what it moves
         fails={"ranks": "at step 1 rank 1's lr is"}),
    Case("fsdp_local_count", "ddp", {"fsdp": True}, "local_count", verdict="FAIL",
         fails={"gradient": "each rank normalised by its own token count"}, slow=True),
    Case("fsdp_clip_local", "ddp", {"fsdp": True}, "clip_local", verdict="FAIL",
         fails={"clip": "each rank its own, where the global gradient's norm is"}),
    Case("fsdp_comp_twice", "ddp", {"fsdp": True}, "comp_twice", verdict="FAIL", fails={"gradient": "= W "}, slow=True),
    # ---------------------------------------------------------------- review: a reviewer's attacks, the same loop
    Case("clean_lowlr_noclip", "review", {"seed": 12, "max_grad_norm": 0, "lr": 1e-3}),
    Case("clean_sketch_every3", "review", {"seed": 13, "sketch": 64, "every": 3, "lr": 3e-2, "steps": 7}),
    Case("clean_drop_last", "review", {"seed": 14, "n": 50, "steps": 10}, holds={"data": "epochs inferred from dataset_len"},
         what="50 examples, 48 read per epoch (drop_last), 10 steps over 3 epochs"),
    Case("clean_drop_last_epoch", "review", {"seed": 14, "n": 50, "steps": 10, "epoch": True},
         holds={"data": "the loop's epochs (rec.step(epoch=...): 3 epoch(s), 120 reads"},
         what="... with the loop's own epochs given", slow=True),
    Case("dup_data", "review", fault="dup_data", verdict="FAIL", may_fail={},
         fails={"data": "identical rows: pass example_ids="}, what="a clean loop over a dataset of identical rows"),
    Case("dup_data_ids", "review", {"ids": True}, "dup_data", holds={"data": "identified by the example ids given"},
         what="... with example_ids"),
    Case("nograd_log", "review", fault="nograd_log", what="a train-mode forward under torch.no_grad() (a probe loss)",
         confirmation="the recording holds the loop's 3 micro-batches"),
    Case("rank1_eps4", "review", {"eps": 1e-4}, "rank1_eps", verdict="FAIL",  # 1+1e-4 on one rank: 7.5e-5 > 1e-5
         fails={"gradient": "differs from one process's gradient"}, slow=True),
    Case("dropout_no_sync", "review", {"dropout": 0.1, "no_sync_all": True, "steps": 2}, verdict="FAIL",
         fails={"gradient": "the gradients were not all-reduced over every micro-batch: at step 1"},
         what="torch's dropout, no_sync on every micro-batch", confirmation="the ranks' recorded gradients differ"),
    Case("bias_x2", "review", fault="bias_x2", verdict="FAIL", fails={"gradient": "tensor ln1.bias"}),
    Case("row_x2", "review", fault="row_x2", verdict="FAIL", fails={"gradient": "tensor tok.weight"}),
    Case("bias_eps_sketch", "review", {"eps": 1e-4, "sketch": 64}, "bias_eps", verdict="FAIL", fails={"gradient": (
        "in any one tensor is detected", "each tensor's sketch against its own bound", "in tensor ln1.bias")},
         what="ln1.bias's gradient off by 1e-4 under sketches k=64", confirmation="the stated bound is below 1e-4"),
    Case("no_shift", "review", fault="no_shift", verdict="FAIL", fails={"gradient": "not by a constant factor"}),
    Case("double_shift", "review", fault="double_shift", verdict="FAIL", fails={"gradient": "not by a constant factor"}, slow=True),
    Case("sched_twice", "review", fault="sched_twice", verdict="FAIL",
         fails={"replay": ("the loop's lr at step 2 is 0.009 where its scheduler, replayed, gives 0.00633333",
                           "the scheduler was stepped 2 times per optimizer step")}),
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
    Case("short_step_clean", "causes", {"fixed_len": 3, "short_last": True, "micro": 3}, slow=True),
    Case("count_previous", "causes", {"count": "previous", "steps": 3}, verdict="FAIL", fails={"gradient": (
        "a scalar that changes from step to step", "the loop divided by the previous step's token count")},
         what="each step's loss sum divided by the step before's global count (the first step's its own)",
         confirmation="the counts the cause names are the loop's own count_of, a step late"),
    Case("double_step", "causes", fault="double_step", verdict="FAIL", may_fail={}, fails={"replay": (
        "the fleet's update at step 2 differs", "the replay's optimizer stepped twice on step 2's gradients, bitwise")},
         confirmation="the test's own AdamW on the recorded gradients, stepped twice at step 2, gives the recorded "
                      "parameters bitwise"),
    Case("rank_sched", "causes", fault="rank_sched", verdict="FAIL", may_fail={"ranks": "rank 1's lr"},
         fails={"replay": ("rank 1's lr at step 2 is", "the lr its scheduler gives at step(s) 3",
                           "1 step(s) ahead from step 2 on")},
         confirmation="rank 1's recorded lr is the test's own LambdaLR factor of the third step"),
    Case("noclip_declared", "causes", {"max_grad_norm": 0.05}, "noclip_declared", verdict="FAIL", may_fail={},
         fails={"clip": "the declared max_grad_norm 0.05 was not applied: the update at step 1 equals the unclipped",
                "replay": "the declared max_grad_norm 0.05 was not applied"},
         confirmation="the test's own AdamW step on the unclipped recorded gradient (its norm above 0.05) gives the "
                      "recorded parameters bitwise"),
    Case("clip_tenth", "causes", {"max_grad_norm": 0.5}, "clip_tenth", verdict="FAIL",
         fails={"gradient": ("times 0.1 at every step = a clip at max_grad_norm 0.05 where 0.5 is declared",
                             "clipped by another threshold than the declared one")},
         what="the loop clips at a tenth of the declared max_grad_norm and reports its norm (every step clipped)"),
    Case("clip_half", "causes", {"max_grad_norm": 0.5}, "clip_half", verdict="FAIL",
         fails={"gradient": ("times 0.5 = 1/W", "a clip at max_grad_norm 0.25 where 0.5 is declared",
                             "or, every step clipped, a clip by another threshold")},
         what="the loop clips at half the declared max_grad_norm (every step clipped): the factor is 1/W too", slow=True),
    Case("sched_before_step", "causes", fault="sched_before_step", verdict="FAIL", may_fail={}, fails={"replay": (
        "every tensor's update at step 1 is the replay's times", "the lr the scheduler gives at step 2",
        "the scheduler stepped before optimizer.step()")},
         confirmation="the test's own AdamW at each next step's lr on the recorded gradients gives the recorded "
                      "parameters bitwise"),
    Case("group_lr", "causes", fault="group_lr", verdict="FAIL", may_fail={}, fails={"replay": (
        "the update at step 1 of 1 tensor(s) (ln1.bias)", "is the replay's times 2, exactly, every other tensor's the "
        "replay's")}, what="ln1.bias in a param group of its own at twice the lr",
         confirmation="the test's own AdamW with ln1.bias at twice the lr gives the recorded parameters bitwise"),
    Case("dropout_rank1_eps", "causes", {"dropout": 0.1, "eps": 1e-3}, "rank1_eps", verdict="FAIL",
         fails={"gradient": "differs from one process's gradient"}, what="torch's dropout, rank 1's loss x 1.001",
         confirmation="the fleet's gradient is off one process's at the ranks' recorded masks by more than the "
                      "clean dropout run's"),
    Case("rank1_growing", "causes", {"eps": 1e-3, "steps": 4}, "rank1_growing", verdict="FAIL",
         fails={"gradient": ("at step 4", "it first fails at step 2")},
         what="rank 1's loss x (1 + 0.001 (k - 1)) at step k: right at step 1, worst at the last",
         confirmation="the test's own one-process gradient at each step's recorded parameters: within 1e-6 at "
                      "step 1, off from step 2, most at step 4"),
    Case("no_sync_all", "causes", {"no_sync_all": True}, verdict="FAIL",
         fails={"gradient": "the gradients were not all-reduced over every micro-batch: at step 1"},
         confirmation="the ranks' recorded gradients differ"),
    Case("clip_local", "causes", fault="clip_local", verdict="FAIL", fails={"clip": "clipping by a local norm"},
         what="each rank clips by its local norm, then all-reduces"),
    Case("bf16_hook", "causes", {"bf16_hook": True, "max_grad_norm": 0.0}, verdict="FAIL",
         fails={"gradient": ("all-reduced in bfloat16", "declare it, RecordingSpec(wire='bf16')")},
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
         what="a gradient carrying 300 x the bfloat16 round-off, doubled", slow=True),
    Case("ac1_eps02", "precision", {**AC, "ac_steps": [1], "eps": 0.02}, "rank1_eps", verdict="FAIL",
         fails={"gradient": "differs"}, what="autocast at step 1 only; rank 1's loss x 1.02 (float32 steps 2, 3)"),
    Case("every2", "precision", {**AC, "every": 2, "steps": 4}, what="tensors every 2 steps under autocast", slow=True),
    Case("row_x2", "precision", AC, "row_x2", verdict="FAIL", fails={"gradient": "tok.weight"},
         what="one row of tok.weight's gradient doubled after the all-reduce"),
    Case("ac_micro0", "precision", {**AC, "ac_micro": [0]}, what="autocast on the first micro-batch of every step",
         confirmation="the bound stays under 0.1"),
    # ---------------------------------------------------------------- cp, cp_dp: context parallelism
    Case("clean", "cp", {"seed": 0}, holds={"layout": CP_LAYOUT.format("contiguous")}, confirmation=BY_HAND,
         what="torch's ring, contiguous shards, all-gather rotation"),
    Case("clean_lb", "cp", {"order": "load_balanced", "rotate": "alltoall", "seed": 1},
         holds={"layout": CP_LAYOUT.format("load_balanced")}, confirmation=BY_HAND,
         what="torch's ring, head-tail load balancing, all-to-all rotation"),
    Case("plain_lb", "cp", {"ring": "plain", "order": "load_balanced", "micro": 2, "seed": 2, "steps": 1},
         holds={"layout": CP_LAYOUT.format("load_balanced")}, confirmation=BY_HAND,
         what="a plain ring of the loop's own, load balanced"),
    Case("nn_gather", "cp", {"ring": "plain", "seed": 3, "steps": 1}, "nn_gather", verdict="FAIL",
         fails={"gradient": "differs from one process's gradient",
                "probe": "the gradient flowing into the output of layers.1.attn.k departs"}, holds={"loss": ()},
         what="torch.distributed.nn all_gather on gloo (pytorch #192920): dK wrong, the loss right",
         confirmation=BY_HAND + ": in the last layer only the key projection's gradient is wrong"),
    Case("loss_avg", "cp", {"seed": 4, "steps": 1}, "loss_avg", verdict="FAIL", fails={
        "gradient": "differs from one process's gradient",
        "probe": ("the CP ranks backpropagate the model's output at different scales",
                  "each scale is 1 / its shard's own token count")},
         what="the loss averaged over the CP ranks' shard means",
         confirmation=BY_HAND + ": the fleet's is the mean of the shards' token means"),
    Case("cp_avg", "cp", {"seed": 9, "steps": 1}, "cp_avg", verdict="FAIL", fails={
        "gradient": ("times 0.5 = 1 / the CP size 2", "2 context-parallel ranks"),
        "layout": "every gradient is one process's times 0.5 = 1 / the CP size 2"},
         what="the shards' gradient parts averaged over the CP group where they must be summed (a review's loop: "
         "the gradient line said 'the TP size')", confirmation=BY_HAND + ": the fleet's is half of it"),
    Case("no_cp_reduce", "cp", {"seed": 5, "steps": 1}, "no_cp_reduce", verdict="FAIL", fails={"layout": (
        "it was not all-reduced over the CP group", "the sum of the group's gradients is one process's gradient")},
         confirmation=BY_HAND + ": the group's gradients sum to it"),
    Case("positions", "cp", {"seed": 6, "steps": 1}, "positions", verdict="FAIL", fails={"layout": (
        "restart at every rank's shard", "not shifted to each shard's place in the sequence")},
         what="positions not shifted per shard", confirmation=BY_HAND + " with every shard's positions from 0"),
    Case("lb_order", "cp", {"ring": "plain", "order": "load_balanced", "seed": 7, "steps": 1}, "lb_order",
         verdict="FAIL", fails={"gradient": (), "probe": (
             "the first module whose forward output departs from one process's is layers.0.attn.core")},
         what="load-balanced keys reassembled in rank order", confirmation=BY_HAND),
    Case("declared_order", "cp", {"order": "load_balanced", "seed": 8, "steps": 1}, "declared_order", verdict="FAIL",
         fails={"layout": "the loop cut the sequence load_balanced and declared contiguous"},
         what="a load-balanced cut declared contiguous", confirmation=BY_HAND + ": the fleet's gradient is right"),
    Case("clean", "cp_dp", {"order": "load_balanced", "micro": 2, "seed": 10},
         holds={"layout": "2 data-parallel replica(s) of 2 CP rank(s)"}, confirmation=BY_HAND),
    Case("no_cp_reduce", "cp_dp", {"seed": 11, "steps": 1}, "no_cp_reduce", verdict="FAIL",
         fails={"layout": ("it was not all-reduced over the CP group", "CP group [0, 1]")},
         what="reduced over DP only", confirmation=BY_HAND + ": the CP group's two gradients sum to it"),
    # ---------------------------------------------------------------- ep: expert parallel, hand-written TP
    Case("clean", "ep", {"seed": 0}, holds={"layout": (
        "declared sharding ('moe.w*' along dim 0 over ranks [0, 1] (expert parallel))",
        "2 of 8 parameters assembled from their ranks' pieces")}, confirmation=EP_HAND),
    Case("ep_grad_unscaled", "ep", {"seed": 1}, "ep_grad_unscaled", verdict="FAIL", fails={"layout": (
        "the 2 expert parameters", "times 2 = the expert-parallel size 2", "pytorch #160285"), "gradient": ()},
         holds={"loss": (), "replay": ()}, what="expert gradients too large by the EP size, the loss right",
         confirmation=EP_HAND + ": the experts' gradients twice its"),
    Case("ep_grad_twice", "ep", {"seed": 1}, "ep_grad_twice", verdict="FAIL",
         fails={"layout": ("1 / the expert-parallel size 2", "remove that division")},
         what="expert gradients divided by the EP size once too often", confirmation=EP_HAND + ": half its"),
    Case("ep_flat_reduce", "ep", {"seed": 7, "steps": 1}, "ep_flat_reduce", verdict="FAIL", fails={"layout": (
        "the expert parameters moe.w1, moe.w2", "hold on every rank the sum over the group of every expert's gradient",
        "reduced over the expert-parallel group like replicated ones", "leave the expert parameters out"),
        "gradient": ()}, what="the expert gradients all-reduced with the dense ones (each rank its own experts)",
         confirmation=EP_HAND + ": each rank's experts' gradients are the sum of every rank's experts' there"),
    Case("aux_local", "ep", {"seed": 2}, "aux_local", verdict="FAIL", fails={"gradient": (
        "each rank's over its own micro-batches alone", "not the objective declared over the whole step")},
         holds={"layout": ()}, what="a balancing term over local routing counts, a global one declared",
         confirmation=EP_HAND + " with each rank's term over its own counts"),
    Case("tp_clean", "ep", {"tp": True, "seed": 3}, holds={"layout": (
        "('out.*' along dim 0 over ranks [0, 1] (tensor parallel))",
        "1 data-parallel replica(s) of 2 tensor-parallel rank(s)")}, confirmation=EP_HAND,
         what="hand-written TP: the output head split over the vocabulary"),
    Case("tp_no_reduce", "ep", {"tp": True, "seed": 4}, "tp_no_reduce", verdict="FAIL", fails={"layout": (
        "differs between ranks 0 and 1 of TP group [0, 1]", "not reduced over it")},
         what="the input gradient's all-reduce left out", confirmation=EP_HAND + ": the replicated ones differ"),
    Case("tp_sum_replicated", "ep", {"tp": True, "seed": 8, "steps": 1}, "tp_sum_replicated", verdict="FAIL",
         fails={"layout": ("parameters replicated over the TP group are one process's times 2 = the TP size 2",
                           "summed over the TP group instead of averaged"), "gradient": ()},
         what="hand-written TP: every replicated gradient summed over the TP ranks",
         confirmation=EP_HAND + ": the replicated ones twice its, the head's its"),
    Case("tp_rng_alike", "ep", {"tp": True, "emb_dropout": 0.1, "seed": 6, "steps": 1}, verdict="FAIL",
         fails={"independence": ()}, holds={"layout": ()}, what="dropout seeded alike on every TP rank",
         confirmation="the ranks' recorded replicated gradients are equal"),
    Case("tp_rng_apart", "ep", {"tp": True, "emb_dropout": 0.1, "seed": 6, "steps": 1}, "rng_apart", verdict="FAIL",
         fails={"layout": ("the TP ranks drew different masks (dropout) where they hold the same activations",
                           "Not a missing reduction")},
         what="... seeded by rank", confirmation="the ranks' recorded replicated gradients differ"),
    Case("declare_reversed", "ep", {"seed": 5, "steps": 1}, "declare_reversed", verdict="refused", fails={"reference": (
        "builds moe.w1 other than the recorded initial one, which the declared sharding 'moe.w*' assembled",
        "declared in another order than the pieces concatenate in")},
         what="the ranks of a declared sharding named out of order",
         confirmation="the recorded initial experts are build_model's with the halves swapped"),
    # ---------------------------------------------------------------- tp, dp_tp: tensor, pipeline and 2-D parallelism
    Case("clean", "tp", {"seed": 0}, holds={"layout": TP_LAYOUT, "data": (), "probe": AGREE}, confirmation=PLAIN),
    Case("clean_seed2", "tp", {"seed": 2, "loss_parallel": False, "dropout": 0.1}, holds={"layout": TP_LAYOUT,
         "probe": ()}, confirmation=PLAIN + "; each TP rank its own columns' dropout mask",
         what="logits gathered (not loss_parallel); a dropout keyed by global column on the column-split hidden"),
    Case("sp_norm_local", "tp", {"seed": 3}, "sp_norm_local", verdict="FAIL", fails={"layout": (
        "norm.weight", "not reduced over it", "the sum of the group's gradients is one process's gradient")},
         what="a sequence-parallel norm's weight gradient not reduced over TP",
         confirmation=PLAIN + ": the ranks' parts sum to it"),
    Case("sp_norm_avg", "tp", {"seed": 20, "steps": 1}, "sp_norm_avg", verdict="FAIL", fails={"layout": (
        "replicated (non-sharded) tensors layers.0.attention_norm.weight", "times 0.5 = 1 / the TP size 2",
        "averaged over the TP group where each rank held only its part"), "gradient": ()},
         what="the sequence-parallel norms' weight gradients averaged over TP where summed (the final norm right)",
         confirmation=PLAIN + ": the block norms' half its, every other tensor its"),
    Case("tp_grad_x", "tp", {"seed": 4}, "tp_grad_x", verdict="FAIL", fails={"layout": (
        "times 2 = the TP size 2", "split over a model-parallel"), "gradient": ()},
         what="TP-split gradients too large by the TP size", confirmation=PLAIN + ": the split ones twice it"),
    Case("tp_rows", "tp", {"seed": 5}, "tp_rows", verdict="FAIL",
         fails={"layout": ("rank 1, a model-parallel peer of rank 0", "other rows")},
         what="a TP rank fed other rows than its replica"),
    Case("tp_w1", "tp", {"module": "layers.1.feed_forward.w1", "factor": 1.01, "seed": 6}, "module_x",
         verdict="FAIL", fails={"probe": (
             "the first module whose forward output departs from one process's is layers.1.feed_forward.w1",
             "the 20 module(s) before it in execution order agree")},
         what="one column shard of w1 off by 1.01 on rank 1",
         confirmation="the recorded w1 output is the plain model's but for rank 1's shard x 1.01"),
    Case("dp_clean", "tp", {"tp": 1, "seed": 7}, holds={"probe": AGREE}, what="DDP (tp 1)"),
    Case("dp_wv", "tp", {"tp": 1, "module": "layers.0.attention.wv", "factor": 1.01, "seed": 8}, "module_x",
         verdict="FAIL", fails={"probe": (
             "on rank 1's first micro-batch the first module whose forward output departs",
             "is layers.0.attention.wv", "the 4 module(s) before it")},
         what="DDP: wv's output off by 1.01 on rank 1", confirmation="rank 1's recorded wv output is the plain x 1.01"),
    Case("dp_loss_x", "tp", {"tp": 1, "factor": 1.5, "seed": 9}, "loss_x", verdict="FAIL", fails={"probe": (
        "rank 1 backpropagates its loss at 1.5 times rank 0's scale", "the loss is at fault, not a module")},
         what="DDP: rank 1's loss scaled by 1.5"),
    Case("dp_sum", "tp", {"tp": 1, "seed": 10}, "dp_sum", verdict="FAIL", fails={"gradient": "= W"},
         holds={"probe": "after the backward (the reduction)"}, what="DDP: a reduction that sums"),
    Case("pp_gpipe", "tp", {"pp": True, "schedule": "GPipe", "micro": 2, "rows": 4, "seed": 11},
         holds={"layout": PP_LAYOUT}, confirmation=PLAIN + ": each stage's recorded part"),
    Case("pp_1f1b", "tp", {"pp": True, "schedule": "1F1B", "micro": 3, "rows": 6, "seed": 12},
         holds={"layout": PP_LAYOUT}, confirmation=PLAIN + ": each stage's recorded part"),
    Case("pp_loss_div", "tp", {"pp": True, "schedule": "1F1B", "micro": 3, "rows": 6, "seed": 13}, "loss_div",
         verdict="FAIL", fails={"gradient": ("times 0.3333 = 1/K", "K = 3 micro-batches"), "loss": ()},
         what="a pipeline loss divided by the micro-batches on top of scale_grads"),
    Case("pp_stale", "tp", {"pp": True, "schedule": "1F1B", "micro": 3, "rows": 6, "seed": 14}, "stale",
         verdict="FAIL", fails={"gradient": ("not zeroed between steps: from step 2 on", "times 0.3333 = 1/K")},
         what="a pipeline stage that never zeroes its gradients",
         confirmation=PLAIN + " at step 2 plus a third of the stage's step-1 gradient"),
    Case("tp_loss_x2", "tp", {"factor": 2.0, "seed": 16, "steps": 1}, "loss_x_all", verdict="FAIL", fails={
        "gradient": "times 2 = K = the TP size 2 (W = 1 data-parallel replica(s) of 2 model-parallel ranks, K = 2 "
                    "micro-batches)",
        "layout": "every gradient is one process's times 2 = the TP size 2"},
         what="every gradient x 2 in TP alone", confirmation=PLAIN + " x 2"),
    Case("tp_loss_vp", "tp", {"loss_parallel": False, "seed": 17}, "loss_vp_gathered", verdict="FAIL", fails={
        "loss": "it is the declared objective + log(2) = + 0.6931, log of the TP size 2, at every step",
        "gradient": (), "probe": ("every module's forward output agrees with one process's, but the gradient "
                                  "flowing into the output of output departs",
                                  "the gradient parts at the model's own output (its loss)")},
         holds={"layout": (), "replay": ()}, what="Megatron's vocabulary-parallel cross-entropy on gathered logits",
         confirmation="the logged loss is the plain model's token mean + log 2"),
    Case("tp_reduce_bf16", "tp", {"seed": 24, "steps": 1}, "tp_reduce_bf16", verdict="FAIL", fails={"gradient": (
        "the gradients of 5 tensor(s) (layers.0.attention_norm.weight, layers.0.ffn_norm.weight, "
        "layers.1.attention_norm.weight, ...) are bfloat16 values in every element",
        "a reduce dtype applied on one mesh dimension only")}, holds={"loss": (), "replay": ()},
         what="the TP-replicated norms' gradients all-reduced in bf16, the rest float32",
         confirmation="the norms' recorded gradients on the bf16 grid, the rest " + PLAIN),
    Case("tp_dropout_local", "tp", {"dropout": 0.1, "seed": 19, "steps": 1}, "dropout_local", verdict="FAIL",
         fails={"gradient": "not by a constant factor", "probe": (
             "the first module whose forward output departs from one process's is layers.0.feed_forward.drop",
             "the 10 module(s) before it in execution order agree")}, holds={"layout": (), "replay": ()},
         what="the keyed dropout keyed by each TP rank's local column",
         confirmation="both TP ranks zeroed the same elements of their shards"),
    Case("tp_init_shards", "tp", {"seed": 15, "steps": 1}, "init_shards", verdict="refused", fails={"reference": (
        "equal copies of one shard along dim 0", "after parallelize_module")},
         what="DTensor's random ops initialising sharded parameters", confirmation="the two halves of wq are equal"),
    Case("clean", "dp_tp", {"seed": 0}, holds={"layout": ("mesh dp 2 x tp 2", "2 data-parallel replica(s) of 2")},
         confirmation=PLAIN),
    Case("loss_local", "dp_tp", {"seed": 1}, "loss_local", verdict="FAIL", fails={"loss": (
        "rank 0's own token mean", "the logged loss is wrong, not the training")},
         holds={"gradient": (), "layout": (), "replay": ()}, what="the loss logged without its DP reduction",
         confirmation="rank 0 logged its replica's rows' token mean"),
    Case("dp_sum", "dp_tp", {"seed": 2}, "dp_sum", verdict="FAIL",
         fails={"layout": "every gradient is one process's times 2 = the DP size 2"},
         what="a DP reduction that sums", confirmation=PLAIN + " x 2"),
    # FSDP2's reduce_dtype bf16 on dp (the TP reductions stay float32): undeclared, then declared (one
    # micro-batch: FSDP2 accumulates no-sync micro-batches in the reduce dtype, which the wire does not cover)
    Case("reduce_bf16", "dp_tp", {"reduce_dtype": "bfloat16", "seed": 20, "steps": 1}, verdict="FAIL", fails={
        "gradient": ("every element of the fleet's gradient is a bfloat16 value", "declare it, RecordingSpec(wire='bf16')")},
         holds={"loss": (), "layout": (), "replay": ()}, what="FSDP2's reduce_dtype bf16 on dp, undeclared",
         confirmation="every recorded gradient on the bf16 grid, a bf16 rounding from " + PLAIN),
    Case("reduce_bf16_wire", "dp_tp", {"reduce_dtype": "bfloat16", "wire": "bf16", "micro": 1, "rows": 4, "seed": 21,
                                       "steps": 1},
         holds={"gradient": "declared bf16 wire's bound", "bias": ()}, what="... declared wire='bf16'",
         confirmation="on the bf16 grid, a bf16 rounding from " + PLAIN),
    # ---------------------------------------------------------------- titan, titan_2d: torchtitan's llama
    Case("clean", "titan", {"seed": 0}, holds={"layout": ("mesh fsdp 1 x tp 2", "12 of 17 parameters split")},
         confirmation=PLAIN),
    # K = 3 micro-batches, so that the factor 1/2 is the TP size's alone
    Case("world_tokens", "titan", {"seed": 5, "micro": 3}, "world_tokens", verdict="FAIL", fails={
        "layout": "every gradient is one process's times 0.5 = 1 / the TP size 2",
        "gradient": "times 0.5 = 1 / the TP size 2 (W = 1 data-parallel replica(s)", "loss": ()},
         holds={"replay": ()}, what="the token count summed over the TP peers too", confirmation=TITAN),
    Case("init_after", "titan", {"seed": 7, "steps": 1}, "init_after", verdict="refused", fails={"reference": (
        "equal copies of one shard along dim 1", "initialise the model before parallelising it")},
         what="torchtitan's trainer's order: built on meta, parallelised, then init_states() on each rank's shards",
         confirmation="the two halves of wo are equal, not build_model's"),
    Case("clean", "titan_2d", {"seed": 0}, holds={"layout": ("mesh fsdp 2 x tp 2", "2 data-parallel replica(s) of 2")},
         confirmation=PLAIN),
    Case("local_tokens", "titan_2d", {"seed": 1, "micro": 3}, "local_tokens", verdict="FAIL", fails={
        "layout": "every gradient is one process's times 2 = the DP size 2", "gradient": (), "loss": ()},
         holds={"replay": ()}, what="the loss divided by each rank's own token count (K = 3: the factor 2 is not K's)",
         confirmation=TITAN),
    # ---------------------------------------------------------------- batch: objectives over more than a row
    # load balancing over each forward's own routing statistics, one row a micro-batch (the usual LLM setting)
    Case("moe_local", "batch", {"kind": "moe"}, verdict="FAIL",
         fails={"independence": ("the rows of a forward interact", "objective_scope='step'")}, holds={"gradient": ()},
         what="an MoE balancing term over each forward's statistics, undeclared",
         confirmation=BATCH + ": each forward's own term, not the global batch's"),
    Case("moe_local_declared", "batch", {"kind": "moe", "scope": "forward"},
         holds={"independence": ("declared per forward", "in 1 forward give a gradient")}, what="... declared per forward"),
    # ... over the step's statistics, all-reduced across ranks with autograd
    Case("moe_global", "batch", {"kind": "moe", "stats": "global", "micro": 1, "batch": 2,
                                 "objective": "batchmodels:moe_step", "scope": "step"},
         holds={"probe": "not probed: the objective is declared over the whole step"},
         what="balancing over all-reduced statistics, declared over the step", confirmation=BATCH),
    Case("moe_global_undeclared", "batch", {"kind": "moe", "stats": "global", "micro": 1, "batch": 2}, verdict="FAIL",
         fails={"gradient": ("the gradient of the step's rows in one forward", "declare objective_scope='step'")},
         what="... undeclared"),
    # in-batch contrastive with every rank's positives as the negatives (all_gather with autograd)
    Case("pair", "batch", {"kind": "pair", "micro": 1, "batch": 2, "objective": "batchmodels:contrastive_step",
                           "scope": "step"}, what="in-batch contrastive, every rank's negatives, declared",
         confirmation=BATCH),
    Case("pair_undeclared", "batch", {"kind": "pair", "micro": 1, "batch": 2, "objective": "batchmodels:contrastive_local"},
         verdict="FAIL", fails={"gradient": "declare objective_scope='step'"},
         what="... each forward's own negatives declared", slow=True),
    # a bool forward keyword, attributes the loop sets, labels the loss reads and the model is not given
    Case("switch", "batch", {"kind": "switch", "objective": "causal_lm", "flip": True, "attrs": True, "labels": "rec"},
         what="a bool forward keyword, attributes the loop sets, labels given to rec.labels", confirmation=BATCH),
    # a branch one rank switches alone: a keyword, an attribute
    Case("flip_rank1", "batch", {"kind": "switch", "objective": "causal_lm", "flip": "rank1", "attrs": True},
         verdict="FAIL", fails={"ranks": "non-tensor forward arguments"}, what="a keyword one rank switches alone",
         confirmation=BATCH + ": rank 0's network over every rank's rows is not the fleet's"),
    Case("attrs_rank1", "batch", {"kind": "switch", "objective": "causal_lm", "attrs": "rank1"},
         verdict="FAIL", fails={"ranks": "plain attributes"}, what="an attribute one rank sets alone",
         confirmation=BATCH + ": rank 0's network over every rank's rows is not the fleet's"),
    Case("labels_unrecorded", "batch", {"kind": "switch", "objective": "causal_lm", "labels": "unrecorded", "steps": 1},
         verdict="FAIL", fails={"gradient": "judged against input_ids"}, what="labels the model is not given, unrecorded"),
    # torch.compile in four placements (backend "eager": dynamo's tracing, which crashed in the Recorder's hook)
    *(Case(f"compile_{w}", "batch", {"kind": "switch", "objective": "causal_lm", "compile": w, "attrs": True,
                                     "steps": 1}, holds={"gradient": "judged against input_ids"},
           what=f"torch.compile ({w})", confirmation=BATCH) for w in ("outer", "inner", "block", "given")),
    # ---------------------------------------------------------------- hf: the Hugging Face Trainer (hf_client's fields)
    Case("clean", "hf", f"avg=1:selfcheck=32:{FIX}", holds={
        **HF_CLEAN, "reduction": "on 32 sampled elements per tensor"},
         what="HF's default average_tokens_across_devices=True; in-run checks"),
    Case("clean_s1", "hf", f"avg=1:seed=1:eval=2:gc=1:{FIX}", holds=HF_CLEAN,
         what="another seed, an eval every 2 steps, gradient checkpointing"),
    Case("clean_s2", "hf", f"avg=1:seed=2:unused=1:dropout=0.1:{FIX}", holds={
        **HF_CLEAN, "independence": "not judged: the gradient changes with the RNG state"},
         what="another seed, a parameter the forward never uses, GPT-2's dropouts at 0.1"),
    Case("clean_bf16", "hf", f"avg=1:seed=3:bf16=1:{FIX}", holds={"gradient": "autocast floor"},
         what="bf16=True: accelerate's CPU autocast around the forward"),
    Case("stock", "hf", "avg=1", verdict="FAIL", fails={"gradient": (
        "a scalar that changes from step to step", "one extra target per row"), "loss": ()}, may_fail=WRONG_GRADIENT,
         what="HF's defaults with GPT2LMHeadModel as it comes (loss_type None: the unshifted labels counted)",
         confirmation="the per-step factor fitted against the reference is N / (N + rows) by the recorded labels"),
    Case("local", "hf", f"avg=0:selfcheck=32:{FIX}", verdict="FAIL", fails={
        "gradient": "each rank normalised by its own token count", "loss": "mean of the ranks' own token means"},
         may_fail=WRONG_GRADIENT, holds={"reduction": "on 32 sampled elements per tensor"},
         what="average_tokens_across_devices=False"),
    Case("mean_of_means", "hf", FIX, "mean_of_means", verdict="FAIL", fails={
        "gradient": "mean of per-micro-batch token means", "loss": "mean of per-micro-batch token means"},
         may_fail=WRONG_GRADIENT, what="HF's pre-fix (2024) gradient accumulation"),
    # GA 3 so that W and K differ: the factor is named alone
    Case("no_world_comp", "hf", f"ga=3:{FIX}", "no_world_comp", verdict="FAIL", fails={
        "gradient": "= 1/W (W = 2 ranks, K = 3 micro-batches)", "loss": ()}, may_fail=WRONG_GRADIENT,
         what="the loss's world-size compensation left out"),
    Case("world_comp_x2", "hf", f"ga=3:{FIX}", "world_comp_x2", verdict="FAIL", fails={
        "gradient": "= W (W = 2 ranks, K = 3 micro-batches)", "loss": ()}, may_fail=WRONG_GRADIENT,
         what="... applied twice", slow=True),
    Case("logged_rank_means", "hf", FIX, "logged_rank_means", verdict="FAIL", may_fail={},
         fails={"loss": ("mean of the ranks' own token means", "not the training")},
         what="the logged loss a mean of the ranks' token means"),
    Case("unused_zero", "hf", f"unused=1:{FIX}", "unused_zero", verdict="FAIL", may_fail={},
         fails={"grad_mask": "extra.bias, extra.weight had a gradient (all zeros)"},
         what="zero gradients for an unused parameter"),
    Case("flat", "hf", f"flat=1:{FIX}", what="packed sequences (DataCollatorWithFlattening, position_ids)",
         confirmation="without the recorded config the reference attends across sequences and fails"),
    Case("uneven", "hf", f"examples=18:steps=3:{FIX}", verdict="FAIL", fails={"data": (
        "at step 1 and by rank", "at step 3 are identical", "within epoch 0", "even_batches", "dataloader_drop_last")},
         what="18 examples, global batch 8: an uneven end of the epoch"),
    Case("uneven_two", "hf", f"examples=18:steps=6:{FIX}", verdict="FAIL", fails={"data": (
        "at step 1 and by rank", "at step 3 are identical", "within epoch 0", "even_batches", "dataloader_drop_last")},
         what="... over two epochs"),
    Case("uneven_drop", "hf", f"examples=18:steps=4:drop=1:{FIX}", what="dataloader_drop_last=True: two epochs of 16",
         holds={"data": "within any of the loop's epochs (rec.step(epoch=...): 2 epoch(s), 32 reads"}),
    Case("resume", "hf", (f"leg=1:{FIX}", f"leg=2:{FIX}"), what="a checkpoint after step 2, resumed to step 4",
         holds={"replay": "across 1 resume(s)"}),
    Case("resume_no_sched", "hf", (f"leg=1:{FIX}", f"leg=2:{FIX}"), "no_sched_file", verdict="FAIL", fails={"replay": (
        "the resume loaded neither the optimizer's state (its lr, moments and step count start afresh) nor the lr "
        "scheduler's")}, may_fail={}, what="... resumed without the scheduler file"),
    # a tiny Qwen3-MoE (output_router_logits=True), one row a micro-batch: its load-balancing term over each
    # forward's own routing, declared per forward; undeclared; declared over the global batch (hf_client)
    Case("moe", "hf", "moe=1:bs=1:steps=2:scope=forward", what="an MoE model's per-forward balancing, declared",
         holds={"gradient": "router_aux_loss_coef 0.5 x each forward's aux_loss", "independence": (
             "declared per forward", "the step's 4 rows in 1 forward give a gradient")},
         confirmation="the per-forward objective by hand, 10% or more from the global batch's"),
    Case("moe_undeclared", "hf", "moe=1:bs=1:steps=1", verdict="FAIL", may_fail={}, fails={
        "independence": "the rows of a forward interact: the step's 4 rows in 1 forward"}, what="... undeclared",
         confirmation="the per-forward objective by hand"),
    Case("moe_global", "hf", "moe=1:bs=1:steps=1:scope=step:objective=global", verdict="FAIL",
         fails={"gradient": ("over each forward's own routing statistics",
                             "not the declared objective over the whole step")}, what="... declared over the global batch",
         confirmation="the per-forward objective by hand"),
    # ---------------------------------------------------------------- lightning (lightning_client's fields)
    Case("clean", "lightning", holds={"gradient": (), "replay": "bitwise", "loss": "equals the declared objective"},
         confirmation=FIELD),
    Case("rank_mean", "lightning", fault="rank_mean", verdict="FAIL", fails={
        "gradient": "each rank normalised by its own token count", "loss": ()},
         may_fail={"clip": (), "probe": "the loss is at fault"}, what="loss normalised per rank",
         confirmation=FIELD + " with weights 1 / (W N_r)"),
    Case("micro_mean", "lightning", fault="micro_mean", verdict="FAIL", fails={
        "gradient": "mean of per-micro-batch token means", "loss": ()},
         may_fail={"clip": (), "probe": "the loss is at fault"}, what="each micro-batch's own token mean",
         confirmation=FIELD + " with weights 1 / (W K n_m)"),
    Case("manual", "lightning", "mode=manual", holds={"clip": "equal the one-process gradient's"},
         what="manual optimization, clipping after the reduce", confirmation=FIELD),
    Case("clip_local", "lightning", fault="clip_local", verdict="FAIL",
         fails={"clip": "clipping by a local norm", "gradient": ()}, what="each rank clipping before the all-reduce",
         confirmation="the ranks' own norms by hand differ from the global gradient's"),
    Case("inferred_len", "lightning", "infer_len=1:steps=2", holds={
        "data": "within any of the loop's epochs (rec.step(epoch=...): 1 epoch(s), 16 reads"},
         what="a pre-batched loader, dataset_len left unknown"),
    # ---------------------------------------------------------------- trl: TRL and PEFT (trl_client's fields)
    Case("lora", "trl", "trainer=hf:lora=1", what="PEFT LoRA under the Trainer", confirmation=TRL_HAND),
    Case("sft", "trl", "trainer=sft", holds={"replay": "bitwise"}, what="SFTTrainer", confirmation=TRL_HAND),
    Case("sft_completion", "trl", "trainer=sft:completion=1", holds={"replay": "bitwise"},
         what="SFTTrainer, completion_only_loss", confirmation=TRL_HAND),
    Case("sft_no_items", "trl", "trainer=sft", "no_items", verdict="FAIL", fails={
        "gradient": "mean of per-micro-batch token means", "loss": ()}, may_fail={"clip": ()},
         what="compute_loss dropping num_items_in_batch", confirmation=TRL_HAND + " with weights K / (W K n_m)"),
    Case("sft_packing", "trl", "trainer=sft:pack=1", what="SFTTrainer(packing=True)",
         confirmation="each packed sequence computed alone, by hand"),
    Case("dpo", "trl", "trainer=dpo:steps=2", holds={"independence": "objective_scope='step'"},
         what="DPOTrainer, declared per pair over the step", confirmation="fieldkit's own pair code"),
    Case("dpo_sft", "trl", "trainer=dpo:dpo=sigmoid+sft:steps=2", verdict="FAIL", fails={"gradient": ()},
         what="DPO's sft term: each micro-batch's own token mean",
         confirmation="fieldkit's own pair code with the micro-batch-mean weighting"),
    Case("padfree", "trl", "trainer=sft:pf=1:steps=2", what="padding_free=True", confirmation=TRL_HAND),
    # ---------------------------------------------------------------- grpo: TRL's GRPOTrainer (grpo_client's fields)
    Case("grpo", "grpo", "loss=grpo:steps=1", holds={"gradient": ()}, what="loss_type grpo", confirmation=GRPO_HAND),
    Case("dapo", "grpo", "loss=dapo:steps=1", holds={"gradient": ()}, what="TRL's default, dapo",
         confirmation=GRPO_HAND),
    Case("grpo_zero", "grpo", "loss=grpo:ga=4:gens=8:seed=5:steps=1", holds={"loss": ()},
         what="loss_type grpo, 8 generations, accumulation 4: a clean loss near 0 (each group's advantages sum to 0)",
         confirmation=GRPO_HAND),
    Case("bnpo", "grpo", "loss=bnpo:steps=1", verdict="FAIL", fails={
        "gradient": "mean of per-micro-batch token means", "loss": ()}, may_fail={"clip": ()},
         what="bnpo: normalised over each local batch by design", confirmation=GRPO_HAND),
    Case("half", "grpo", "loss=dapo:steps=1", "half", verdict="FAIL", fails={"gradient": "times 0.5"},
         what="dapo with its loss halved (the x 0.5 class of TRL PR #6024)", confirmation=GRPO_HAND),
    # ---------------------------------------------------------------- accelerate: the field sweep's configurations
    Case("clean", "accelerate", holds={"gradient": (), "replay": "bitwise"},
         what="accumulate() with the global token count", confirmation=FIELD),
    Case("micro_mean", "accelerate", fault="micro_mean", verdict="FAIL", fails={
        "gradient": "mean of per-micro-batch token means", "loss": ()},
         may_fail={"clip": (), "probe": "the loss is at fault"}, what="each micro-batch's own token mean",
         confirmation=FIELD + " with weights 1 / (W K n_m)"),
    Case("sched_prepared", "accelerate", fault="sched_prepared", verdict="FAIL", fails={"replay": "lr at step 2"},
         may_fail={}, what="the lr scheduler through accelerator.prepare: stepped W times a step",
         confirmation="the recorded lr at step 2 is the schedule's at index W"),
    # ---------------------------------------------------------------- own: the gate's own fleet (GateSettings)
    Case("mean_of_ranks_loss", "own", {"profile": "4x32,1x64", "steps": 3}, "mean_of_ranks_loss", verdict="FAIL",
         fails={"loss": ("it is the mean of the ranks' own token means", "the logged loss is wrong, not the training")},
         may_fail={}, what="the plain mean of the ranks' losses logged under two window lengths"),
    Case("eval_wrong", "own", {"steps": 5}, "eval_wrong", verdict="FAIL", may_fail={},
         fails={"gradref": "the logged eval loss is wrong: at step 5"}, what="an eval reporting a constant"),
    Case("stale_weights", "own", {"steps": 4}, "stale_weights", verdict="FAIL", fails={"gradient": (), "curve": ()},
         what="rank 1 computing one step on the previous step's weights",
         confirmation="the curve's summary names the first failing check and step"),
    Case("fsdp_stale_shard", "own", {"shard": "fsdp", "steps": 4}, "fsdp_stale_shard", verdict="FAIL",
         fails={"gradient": (), "curve": ()}, what="an FSDP2 shard keeping last step's gradient",
         confirmation="the curve's summary names the first failing check and step"),
    # ---------------------------------------------------------------- configs: the gate's own fleet, other configurations
    Case("small", "configs", {"preset": "small", "steps": 2, "profile": "1,1"},
         what="the small preset's network (d_model 256) on one window per rank"),
    Case("file", "configs", {"config": "run.json", "steps": 6, "profile": "3,1"},
         what="a RunConfig file written by hand: Engram off, the block applied three times"),
    Case("data", "configs", {"data": "text.txt", "steps": 4, "profile": ""}, what="the user's own corpus, read in place"),
    *(Case(f"seed{k}", "configs", {"seed": k, "steps": 6}, what="a clean fixture run at another seed")
      for k in range(1, 4)),
    # ---------------------------------------------------------------- autocast: bfloat16 autocast, FSDP2 mixed precision
    Case("clean", "autocast", AC, holds={"gradient": ("autocast floor", "bfloat16 autocast"),
                                         "independence": "autocast floor", "clip": "autocast floor"},
         what="bfloat16 autocast: the bounds 10 x the floor the reference measures",
         confirmation="without the recorded autocast the same run fails at the float32 bound"),
    Case("micro_mean", "autocast", AC, "micro_mean", verdict="FAIL",
         fails={"gradient": "mean of per-micro-batch token means"}, confirmation="off by over 10 x the bound"),
    Case("comp_twice", "autocast", AC, "comp_twice", verdict="FAIL", fails={"gradient": "= W "},
         confirmation="off by over 10 x the bound"),
    Case("rank1_fp32", "autocast", AC, "rank1_fp32", verdict="FAIL", fails={"ranks": (
        "rank 1 ran micro-batch 0 under no autocast, rank 0 under cpu bfloat16 autocast: the fleet's ranks do not "
        "compute in one precision")}, what="rank 1 computing in float32"),
    Case("bias_x2", "autocast", AC, "bias_x2", verdict="FAIL", fails={"gradient": (
        "in tensor ln1.bias by 1 at step 1, above that tensor's bound", "x that tensor's own floor")},
         what="one small tensor's gradient doubled", confirmation="its norm a small share of the whole gradient's"),
    # FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): no autocast, the
    # parameters cast for the forward (the submodules' pre-hooks see them unsharded and cast)
    Case("fsdp_mp", "autocast", {"seed": 9, "fsdp": True, "fsdp_mp": True}, holds={
        "gradient": ("bfloat16 compute floor", "cast to bfloat16"), "loss": "loss floor"},
         what="FSDP2 mixed precision: parameters cast to bfloat16 for the forward",
         confirmation="every micro-batch recorded as computed in bfloat16"),
    Case("fsdp_mp_comp_twice", "autocast", {"seed": 9, "fsdp": True, "fsdp_mp": True}, "comp_twice",
         verdict="FAIL", fails={"gradient": "= W "}, slow=True),
    # ---------------------------------------------------------------- wild, wild_pp: loops we did not write
    Case("aux", "wild", {"model": "aux"}, what="the model keeps self.aux (a graph tensor) after its forward",
         confirmation=WILD + ", through `gate check`"),
    Case("labels_inputs", "wild", {"labels": "inputs"}, what="labels = input_ids, padding not masked "
         "(TrainCheck's pytorch-84803 workload)", confirmation=WILD + "; the rows alone sum to the batch's"),
    Case("bn_rank0", "wild", {"bn_rank0": True}, holds={"buffers": (
        "not judged: bn.num_batches_tracked, bn.running_mean, bn.running_var moved", "no buffer_update declares how")},
         what="BatchNorm statistics from rank 0's rows, broadcast", confirmation="the statistics are rank 0's rows'"),
    Case("collate_drop", "wild", {"collate_drop": True}, holds={"data": "the rows are taken as given"},
         what="rank 1's collator drops every row's last token", confirmation="rank 1's recorded rows are one short"),
    Case("clip_no_norm", "wild", {"clip_no_norm": True, "max_grad_norm": 0.3}, verdict="FAIL", fails={"gradient": (
        "the clip coefficients of a max_grad_norm of 0.3", "rec.step(grad_norm=norm)")},
         what="clipped, grad_norm not passed to rec.step"),
    Case("skip_step", "wild", {"skip_bwd": [2]}, what="step 2: opt.step() with no forward or backward (pytorch "
         "#115607)", confirmation="the parameters moved as the optimizer alone moves them, through `gate check`"),
    Case("skip_step_zeros", "wild", {"skip_bwd": [2], "zero_grads": True}, verdict="FAIL",
         fails={"grad_mask": "step 2"}, what="... on zeroed (not None) gradients"),
    Case("skip_step_logged", "wild", {"skip_bwd": [2], "skip_loss": True},
         holds={"loss": "step(s) 2 ran no forward (an optimizer step alone): the loss logged there is not compared",
                "clip": ()},
         what="... logging loss 0.0 there (a number)", confirmation="the command judged it: it crashed before"),
    Case("skip_step_stale", "wild", {"skip_bwd": [2], "skip_loss": True, "stale_after": [1]}, verdict="FAIL",
         fails={"gradient": ("at step 2 no rank ran a forward or a backward", "step 1's gradient, applied again"),
                "grad_mask": "one left from an earlier step"},
         what="... the gradients not zeroed after step 1: the optimizer applies step 1's again",
         confirmation="the recorded gradient at step 2 is step 1's"),
    Case("opt_copy", "wild", {"opt_copy": True}, verdict="FAIL", fails={"replay": (
         "no tensor moved where the replay's optimizer moves every one", "does not hold the model's parameters")},
         what="the optimizer built over another instance of the model", confirmation="the recorded parameters "
         "never move (the command crashed: a zero ratio)"),
    Case("metric_fwd", "wild", {"metric": "all"}, holds={
         "data": "6 forward(s) with gradients on over rows the rank trained on, whose output no backward reached",
         "gradient": "equals one process's gradient"},
         what="every rank runs a train-mode metric forward with gradients on, never backpropagated",
         confirmation=WILD + " (the metric forwards left out)"),
    Case("metric_fwd_rank0", "wild", {"metric": 0}, holds={"data": "were not taken as micro-batches",
         "gradient": "equals one process's gradient"}, what="... on rank 0 alone, over a micro-batch it trained on",
         confirmation=WILD + " (the metric forward left out)"),
    Case("detach_r1", "wild", {"detach_r1": True, "metric": 0}, verdict="FAIL", fails={"data": (
         "rank 1 ran 1 forward(s) with gradients on over rows it did not train on (no backward reached them)",
         "a micro-batch's loss left out of the backward")},
         what="rank 1 never backpropagates its first micro-batch; rank 0 runs a metric forward (the counts alike)",
         confirmation="rank 1 recorded one micro-batch fewer"),
    Case("metric_sliced", "wild", {"metric": 0, "metric_rows": "sliced"}, holds={
         "data": "over rows the rank trained on", "gradient": "equals one process's gradient"},
         what="rank 0's metric over the first 6 positions of a micro-batch it trained on",
         confirmation=WILD + " (the metric forward left out)"),
    Case("val_metric_detach_r1", "wild", {"detach_r1": True, "metric": 0, "metric_rows": "other"}, verdict="FAIL",
         fails={"data": ("forward(s) with gradients on over rows it did not train on", "torch.no_grad()")},
         what="rank 0's metric over validation rows beside rank 1's left-out loss (their counts alike)",
         confirmation="rank 1 recorded one micro-batch fewer"),
    Case("dc_eval", "wild", {"model": "dc"}, holds={"gradient": "equals one process's gradient"},
         what="model.eval(), the forward returns a dataclass of its logits", confirmation=WILD),
    Case("slots_out", "wild", {"model": "slots"}, holds={"gradient": "equals one process's gradient"},
         what="the forward returns an object with __slots__ holding its logits", confirmation=WILD),
    Case("posmask", "wild", {"posmask": True}, holds={"gradient": "equals one process's gradient"},
         what="net(input_ids, attention_mask): the mask passed positionally", confirmation=WILD),
    Case("rank_grad_half_clip", "wild", {"rank_grad_x": 0.5}, verdict="FAIL", fails={"clip": (
         "each rank its own synchronised gradient's norm, and those gradients differ between ranks",)},
         what="rank 1 halves its synchronised gradient, then clips"),
    Case("nan_attr", "wild", {"nan_attr": True}, holds={"ranks": ()},
         what="model.best = NaN on every rank before the Recorder", confirmation="NaN is never == NaN"),
    Case("is_main", "wild", {"is_main": True}, holds={"ranks": (
         "rank 1's model has is_main = False, rank 0's True (set before the Recorder started): not read by what "
         "the fleet computed",)}, what="model.is_main = (rank == 0), never read by the forward",
         confirmation=WILD),
    Case("rank_grad_half", "wild", {"rank_grad_x": 0.5, "max_grad_norm": 0.0}, verdict="FAIL", fails={"ranks": (
         "rank 1 scaled its whole gradient by 0.5 after the reduce, not by a clip coefficient")},
         what="rank 1 halves its synchronised gradient, no clipping"),
    Case("dropout", "wild", {"dropout": 0.1, "steps": 2}, holds={
         "independence": "not judged: the gradient changes with the RNG state", "gradient": (),
         "probe": ("not judged: one process's gradient of the probed micro-batch at step 1 changes with the "
                   "RNG state", "each rank drew its own masks")},
         what="a clean loop with dropout, each rank seeding its own masks"),
    Case("zero_labels", "wild", {"zero_labels": True, "steps": 2}, verdict="FAIL", fails={"data": (
        "rank 1's labels are not its input tokens at", "every target is token 0")},
         what="rank 1 zeroes its device copy's labels", confirmation="rank 1's recorded labels are zeros"),
    Case("sketch_late", "wild", {"sketch": 64, "loss_x": {"2": 1.5}}, verdict="FAIL",
         fails={"gradient": "1, 1.5 at steps 1, 2"}, what="sketched, AdamW; every rank's loss x 1.5 at step 2 alone",
         confirmation="the loop trained in one process by the test: its norm 1.5 x at step 2"),
    Case("half_fc", "wild", {"grad_x": {"fc.weight": 0.5}, "steps": 2}, verdict="FAIL", fails={"gradient": (
        "times 0.5 = 1/W = 1/K in tensor fc.weight alone, at every step, and every other tensor agrees")},
         what="one tensor's gradient halved after the reduce", confirmation=WILD + ": fc.weight's 0.5 x it"),
    Case("rec_late", "wild", {"rec_late": True, "steps": 2}, verdict="FAIL", fails={"intact": (
        "rec.step ran after optimizer.step() (the parameters had already moved", "changed between step 1's first "
        "forward and rec.step on rank 0", "call rec.step before opt.step()")},
         what="a clean loop calling rec.step after opt.step()", confirmation="the intact line is the first to fail"),
    Case("overlap", "wild", {"overlap": True, "steps": 2}, verdict="FAIL", fails={"data": (
        "rows read by rank 1 at step 1 and by rank 0 at step 2 are identical", "the ranks' shards overlap")},
         may_fail={}, what="hand-written shards that overlap by one example, no example ids",
         confirmation="no HF/accelerate advice: no Trainer, no epoch end"),
    Case("ref", "wild", {"ref": True, "steps": 1}, holds={"gradient": ()},
         what="a DPO-like objective whose frozen reference is the initial model at the run's seed (build_kwargs)",
         confirmation="the test's own gradient with the reference at the run's seed, not at another"),
    Case("tied", "wild_pp", {"pp": True, "tied": True, "steps": 2}, holds={
        "ranks": "tied tok_embeddings.weight = output.weight: their copies are equal bitwise"},
         what="a weight tied over the 2 pipeline stages, its copies' gradients summed"),
    Case("tied_one_way", "wild_pp", {"pp": True, "tied": True, "steps": 1}, "tied_one_way", verdict="FAIL",
         fails={"ranks": ("the tied tok_embeddings.weight and output.weight", "differ in their gradients at step 1")},
         what="... summed one way only", confirmation="the stages' recorded copies differ"),
    Case("tied_shared", "wild_pp", {"pp": True, "tied": "shared", "steps": 2}, holds={
        "ranks": "tied tok_embeddings.weight on the stages of ranks 0, 1: their copies are equal bitwise",
        "layout": "held under one name by several stages"},
         what="the embedding reused as the output under its one name on both stages, its copies' gradients summed",
         confirmation="the last stage's recorded gradient is the test's one-process gradient"),
    Case("tied_shared_one_way", "wild_pp", {"pp": True, "tied": "shared", "steps": 1}, "tied_one_way",
         verdict="FAIL", fails={"ranks": ("the copies of tok_embeddings.weight on the stages of ranks 0 and 1",
                                          "differ in their gradients at step 1")},
         what="... summed one way only", confirmation="the stages' recorded copies differ"),
    Case("pp_accum", "wild_pp", {"pp": True, "accum": 2, "steps": 1}, verdict="FAIL", fails={"gradient": (
        "the pipeline schedule divided ranks 0, 1' stages' accumulated gradients 2 times (by 2, 2",
        "torchtitan #1733", "scale_grads=False")},
         what="2 schedule.step() calls a step, scale_grads left on (torch's default)",
         confirmation="the recorded gradient is the test's 1/4 x the first call's + 1/2 x the second's"),
    Case("pp_accum_fixed", "wild_pp", {"pp": True, "accum": 2, "scale": False, "steps": 1},
         what="... with scale_grads=False and the loss divided by micro-batches x calls",
         confirmation="the recorded gradient is the test's one-process gradient over both calls' rows"),
    Case("norms_x_rank1", "wild_pp", {"steps": 1}, "norms_x_rank1", verdict="FAIL", fails={"layout": (
        "rank 0 holds one process's gradient", "its copy one process's times 1.001",
        "then changed on rank 1 alone")}, what="the TP-replicated norms' gradients summed, then scaled on rank 1",
         confirmation="rank 0's recorded norms' gradient is the test's one-process gradient, rank 1's 1.001 x it"),
    # DeepSpeed #1801's mechanism: the TP-replicated norms' gradients clipped on TP rank 0 alone
    Case("ds1801", "wild_pp", {"max_grad_norm": 0.05, "steps": 1}, "clip_tp0_norms", verdict="FAIL", fails={"clip": (
        "at step 1 rank 1's gradient of 5 tensor(s) (layers.0.attention_norm.weight",
        "the loop clipped those tensors on rank 0 and not on rank 1")},
         what="DeepSpeed #1801: the TP-replicated norms clipped on TP rank 0 alone",
         confirmation="the norms' recorded gradients by hand on each rank"),
)
