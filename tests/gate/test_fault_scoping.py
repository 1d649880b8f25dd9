"""fleet_faults.scoped undoes a fault after its run (several faulted fleets
share one torchrun launch): in process, faults of the three kinds a shallow
snapshot of dormouse's module attributes once missed, each of which leaked into
the next run of a launch (review2, measured in a real world-2 launch: the clean
run after it failed the gate for the fault's reason)."""

from __future__ import annotations

import subprocess
import sys

import torch.nn.functional as F

import dormouse.gate.record.fixtures as fixtures
import fleet_faults
from gatekit import SUPPORT


def test_an_in_place_edit_of_the_recipe_is_undone():
    with fleet_faults.scoped("recipe_inplace"):
        assert fixtures.RECIPE["grad_clip"] == 0.0
    assert fixtures.RECIPE["grad_clip"] == 0.05


def test_a_replaced_torch_function_is_put_back():
    ce = F.cross_entropy
    with fleet_faults.scoped("torch_ce_patch"):
        assert F.cross_entropy is not ce
    assert F.cross_entropy is ce


def test_a_fault_on_a_module_a_run_imports_lazily_is_undone():
    # a fresh process: the Recorder's module is not yet imported when the first run's snapshot is taken
    code = ("import fleet_faults, sys; assert 'dormouse.gate.record.recorder' not in sys.modules\n"
            "with fleet_faults.scoped('recorder_lr_patch'): pass\n"
            "import dormouse.gate.record.recorder as r, inspect\n"
            "assert inspect.getmodule(r.Recorder.step) is r, 'the patched Recorder.step outlived its run'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=SUPPORT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1500:]


def test_every_fault_scoped_to_one_run_is_undone_after_it_and_unscoped_it_stays(monkeypatch):
    """The mechanism behind the shared launch, in this process: after
    `scoped(fault)` every dormouse attribute and installed hook is the one
    before it; planted without the scope, the fault's changes stay (what a
    leak into the next run would be)."""
    import fleet_faults

    monkeypatch.setenv("DORMOUSE_TEST_FAULT_SCALE", "1")

    def state():  # per owner: its attributes by name, a hook list's items by position, a container's contents
        out = []
        for o, a in fleet_faults._snapshot():
            if isinstance(o, tuple):  # ("contents", obj): a deep copy, compared by what it holds
                out.append((o[1], {"contents": repr(a)}))
            else:
                out.append((o, dict(enumerate(a)) if isinstance(a, list) else a))
        return out

    def same(a, b):
        return len(a) == len(b) and all(
            oa is ob and da.keys() == db.keys() and all(da[k] is db[k] or (k == "contents" and da[k] == db[k])
                                                        for k in da)
            for (oa, da), (ob, db) in zip(a, b))

    state()  # the first snapshot's deep copies cache copyreg's __slotnames__ on classes: not a fault's
    before = state()
    for fault in fleet_faults.FAULTS:
        with fleet_faults.scoped(fault):
            pass
        assert same(state(), before), f"{fault} left a change behind"
    saved = fleet_faults._snapshot()
    try:
        fleet_faults.FAULTS["grad_x2"]()  # an installed hook
        fleet_faults.FAULTS["capacity_moe"]()  # a replaced builder and a replaced module constant
        assert not same(state(), before)
    finally:
        fleet_faults._restore(saved)
    assert same(state(), before)
