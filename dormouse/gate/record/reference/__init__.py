"""The one-process references for a recording (record/recorder.py): what one
process computes from the recorded micro-batches, never from the loop's own
loss code. It WRITES artifacts (<out>/reference/...); the judge
(judge/facts/) compares them with the recording.

Rebuild: `build_model(**build_kwargs)` must give the recorded initial state
bitwise; `build_optimizer(model, **build_kwargs)` the optimizer (and scheduler).

The declared objective, for a micro-batch b with model outputs z (logits):
  causal_lm     loss_sum(b) = sum_{i,t: y_{i,t+1} != -100} CE(z_{i,t}, y_{i,t+1}),
                count(b) = #{(i,t): y_{i,t+1} != -100}   (labels shifted by one: HF's convention)
  token_mean    the same without the shift (labels already aligned)
  example_mean  loss_sum(b) = sum_i mean_t CE(z_{i,t}, y_{i,t}) (or CE(z_i, y_i) for (B, C) logits), count = B
  "pkg.mod:fn"  fn(model, batch) -> (loss_sum, count)
The objective of a step over every rank r's micro-batches m is the GLOBAL mean
    L = sum_{r,m} loss_sum(b_rm) / sum_{r,m} count(b_rm),
and its gradient g = sum_{r,m} grad loss_sum(b_rm) / sum_{r,m} count(b_rm), each
micro-batch's gradient in float32 (as the fleet computes it) summed in float64.
Beside it, the weightings the famous bugs compute (so the judge can NAME them):
    micro_mean  (1/M) sum_{r,m} grad loss_sum(b_rm) / count(b_rm)       (mean of micro-batch means)
    rank_mean   (1/W) sum_r (sum_m grad loss_sum(b_rm)) / (sum_m count(b_rm))   (each rank its own count)
and fact 1's per-example sum over a SAMPLE S of micro-batches (example_sample):
    ex  = sum_{b in S} sum_{rows i of b} grad loss_sum(row i alone) / sum count
    exb = sum_{b in S} grad loss_sum(b) / sum count
equal when the network is a function of each example alone. S is every
rank's first micro-batch at the first recorded step and one micro-batch at
each later step the extras' budget takes (sample.py: their rows within 0.5 x
the gradient's so far), rotating over ranks and micro-batches: per-example
gradients cost about 1.5x a micro-batch's, and over every micro-batch of
every step they were half the check's time (a dependence on the batch
confined to micro-batches outside S is not seen; BatchNorm and dropout show
in any). The verdict states the steps taken.

One forward for the global batch ("gm", at the steps the budget takes): the same objective
over the step's rows merged into as few forwards as memory allows
(batchscope: every rank's and micro-batch's rows, padded as the recording
pads), normalised by its own count: equal to g when no row's gradient
depends on which rows share its forward. objective_scope (recording.json):
"example" (the default) and "forward" differentiate each micro-batch as above
(the judge holds gm to g only under "example"); "step" calls the declared
fn(model, batches) once on every rank's micro-batches of the step (rank then
micro order) and differentiates loss_sum / count (no per-example sample, no
merged forward); beside it, with more than one rank, "rank_mean": fn over
each rank's micro-batches alone, (1/W) sum_r grad(loss_sum_r / count_r) (the
step's statistics over each rank's own rows: what a fleet that never reduces
them trains); on a transformers MoE model, "fwd": the causal LM loss with the
model's own term per forward, the judge's name for a fleet that computes per
forward what the declaration computes over the step.
A transformers MoE model's own per-forward load-balancing term joins the
built-in objectives, weighted by the step's count (routeraux). "last": each
rank's last micro-batch's share of g (the judge's causes name a last
micro-batch weighted apart from the others).
What each forward received beyond its tensors (its non-tensor arguments, the
model's plain attributes the loop set) is put back as recorded (batchscope),
and the RNG state it started from on its rank (rngstate.py): torch's dropout
draws the rank's masks again (a row alone and a merged forward draw their own).

Reduced precision: each micro-batch's forward runs under the autocast the
recording says it ran under (the Recorder reads it), on the parameters in
the dtype they were recorded in. Under autocast, or with bfloat16/float16
parameters, the backward's round-off depends on the scale the loss is
backpropagated at, which the loop chooses (its normalisation is what is
under test), so the reference also measures it: "precision_floor" =
||3 g(loss_sum / 3) - g|| / ||g|| over the step's micro-batches, the same
gradient through a loss scaled by 1/3 (not a power of two), in one process;
the judge's bounds are FLOOR_MULTIPLE x its largest. "loss_floor" (built-in
objectives) is the step's loss computed from the logits in the dtype the
forward gives them, outside autocast (no float32 upcast), against the
objective's: how far a loop that computes its loss in that precision logs.
"precision_floor_tensors" is the floor of each tensor alone. Every
micro-batch of a step where any computes in reduced precision is measured. Parameters cast for the
forward (FSDP2's MixedPrecisionPolicy: the recording's "compute_dtype") are
computed on a copy of the model cast so.

Replay (full tensors at every step): from the initial state, the user's
optimizer (and scheduler) applied to the RECORDED gradients, clipped by
max_grad_norm when the loop's gradients were recorded before clipping; the
parameters before each step and after the last are written for the judge to
compare bitwise with the recorded ones. One uninterrupted optimizer and
scheduler run across a resume: what a correct resume equals.

Buffers (a recording with buffer_update, full tensors at every step): at
every step k, the declared rule applied in one process to the model holding
the recorded parameters and buffers before k and to every rank's recorded
micro-batches of k; its result ("bu/", the buffers after k) is written for the
judge to compare bitwise with the buffers recorded before k + 1 (or after the
last step). The rule's first docstring line names it in the verdict.

Run (sketches, or tensors every k-th step): the recorded gradients are not all
there to replay, so the reference trains the run itself in one process on the
declared objective over the recorded micro-batches, clipping by the global
norm, and writes (sketches of) its parameters and gradients at the recorded
steps: facts 3 and 4 together, within a bound. The bound is measured: the same
run from an initial state one ulp away ("np/", "ng/", "nudged_loss") shows how
far float32 round-off alone carries a run.
"""

from dormouse.gate.record.reference.error import ReferenceError
from dormouse.gate.record.reference.staleness import is_current
from dormouse.gate.record.reference.make import make_reference

__all__ = ["ReferenceError", "is_current", "make_reference"]
