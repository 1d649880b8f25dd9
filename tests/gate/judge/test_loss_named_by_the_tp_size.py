"""The loss check's naming by the TP size (facts/loss.py tp_named), on numbers alone: a logged loss that is
the objective + log(TP), or the objective times TP or 1/TP, at every step that logged one, within the
loss's bound; anything else left unnamed. The fleet case is in
tests/gate/catches/test_tensor_and_pipeline_parallel.py (a vocabulary-parallel cross-entropy on gathered
logits)."""

from __future__ import annotations

import math

from dormouse.gate.judge.facts.loss import tp_named

OBJ = [4.17, 4.02, 3.9]


def test_a_logged_loss_the_objective_plus_log_tp_at_every_step_is_named_by_the_tp_size():
    words = tp_named([(r + math.log(4), r, 1e-5) for r in OBJ], 4)
    assert words.startswith("the declared objective + log(4) = + 1.3863, log of the TP size 4, at every step")


def test_a_logged_loss_the_objective_times_tp_or_over_tp_is_named_as_that_factor():
    assert "times 2 = the TP size 2" in tp_named([(2 * r, r, 1e-5) for r in OBJ], 2)
    assert "times 0.5 = 1 / the TP size 2" in tp_named([(r / 2, r, 1e-5) for r in OBJ], 2)


def test_an_offset_that_holds_at_one_step_only_or_without_tp_is_not_named():
    pairs = [(r + math.log(2), r, 1e-5) for r in OBJ]
    assert tp_named(pairs[:1] + [(OBJ[1] + 0.7, OBJ[1], 1e-5)], 2) is None  # 0.7 is not log 2 within the bound
    assert tp_named(pairs, 1) is None  # no model-parallel group: nothing to name it by
    assert tp_named([(r + math.log(2), r, 1e-5) for r in OBJ], 4) is None  # log 2 is not log 4
