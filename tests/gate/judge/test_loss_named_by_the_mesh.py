"""The loss check's naming by the mesh (facts/loss.py mesh_named), on numbers alone: a logged loss that is
the objective + log(TP), or the objective times TP, 1/TP, DP or 1/DP, at every step that logged one, within
the loss's bound; anything else left unnamed. The fleet case is in
tests/gate/catches/test_tensor_and_pipeline_parallel.py (a vocabulary-parallel cross-entropy on gathered
logits)."""

from __future__ import annotations

import math

from dormouse.gate.judge.facts.loss import mesh_named

OBJ = [4.17, 4.02, 3.9]


def test_a_logged_loss_the_objective_plus_log_tp_at_every_step_is_named_by_the_tp_size():
    words = mesh_named([(r + math.log(4), r, 1e-5) for r in OBJ], 4, 1)
    assert words.startswith("the declared objective + log(4) = + 1.3863, log of the TP size 4, at every step")


def test_a_logged_loss_the_objective_times_a_mesh_size_is_named_by_it_and_coinciding_sizes_both_listed():
    assert "times 2 = the TP size 2 at every step" in mesh_named([(2 * r, r, 1e-5) for r in OBJ], 2, 1)
    assert "times 0.5 = 1 / the TP size 2 at every" in mesh_named([(r / 2, r, 1e-5) for r in OBJ], 2, 1)
    assert "times 4 = the DP size 4 at every" in mesh_named([(4 * r, r, 1e-5) for r in OBJ], 2, 4)
    assert "times 2 = the TP size 2 = the DP size 2 at" in mesh_named([(2 * r, r, 1e-5) for r in OBJ], 2, 2)


def test_an_offset_that_holds_at_one_step_only_or_without_a_mesh_is_not_named():
    pairs = [(r + math.log(2), r, 1e-5) for r in OBJ]
    assert mesh_named(pairs[:1] + [(OBJ[1] + 0.7, OBJ[1], 1e-5)], 2, 1) is None  # 0.7 is not log 2 within the bound
    assert mesh_named(pairs, 1, 1) is None  # no model-parallel group: nothing to name it by
    assert mesh_named(pairs, 4, 1) is None  # log 2 is not log 4
    assert mesh_named([(3 * r, r, 1e-5) for r in OBJ], 2, 2) is None
