"""The gate's modes: the running side. Each writes into the settings' out dir,
which is its fleet's recording (artifacts/layout.py), and judges nothing
(dormouse.gate.judge compares them).

rank    - one process per rank under torchrun: the fleet, recorded through the
          Recorder (record/dormouse_loop.py) into out: every step's micro-batches,
          parameters, applied gradients, buffers, loss and expert choices, with
          the gate's settings, provenance and evals in recording.json's extra.
single  - one process at the GLOBAL batch, recorded into reference/single/: the
          reference curve. Beside it, its round-off floor (reference/floor.json):
          the same run started from parameters nudged by one ulp, with ULP_RUNS
          different nudges (never a run that splits the batch: that would share
          the bugs of a split). Under reduce="exact" also the exact reference
          (reference/exact/): one process computing the fleet's own slices,
          summed in the fixed order.
gradref - from the fleet's recording, by its OWN arithmetic from the documented
          data rule: the bytes every step's windows must hold (each rank's slice
          in rank order), the tokens counted from the targets it built, and the
          held-out loss at the fleet's recorded parameters after each eval step
          (reference/gradref.json). The one-process gradient, the replay and
          the routing bias's update are the recording's own reference
          (record/reference/), which every loop's recording gets.
"""

from __future__ import annotations

from dormouse.gate.artifacts import EXACT, GRADREF, SINGLE
from dormouse.gate.record.modes.base import (  # noqa: F401  (the seams and a mode's values)
    QUIET,
    Mode,
    ModelHook,
    RunHook,
    RunScope,
    deterministic_kernels,
    install_model_hook,
    install_run_hook,
    install_run_scope,
    mode,
)
from dormouse.gate.record.modes.fleet import load_plan, rank_run, run_rank, run_rank_plan  # noqa: F401
from dormouse.gate.record.modes.gradref import (  # noqa: F401
    eval_loss,
    profile,
    run_gradref,
    span_index,
    step_windows,
    window_digest,
)
from dormouse.gate.record.modes.one_process import (  # noqa: F401
    ULP_RUNS,
    WIRE_RUNS,
    measure_floor,
    nudge,
    nudge_absolute,
    round_like_wire,
    run_exact,
    run_single,
)

MODES = {SINGLE: run_single, "rank": run_rank, GRADREF: run_gradref, EXACT: run_exact}
