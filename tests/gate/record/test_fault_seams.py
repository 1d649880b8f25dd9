"""Planted faults act only through the seams the loop and the gate's modes
offer (hooks, run hooks, model hooks, run scopes), never by replacing a
module attribute; fleet_faults.scoped then undoes a fault after its run
(several faulted fleets share one torchrun launch) by emptying those seams.
No test file replaces an attribute of dormouse either (read statically:
monkeypatch.setattr, setattr, assignment), but for the exceptions listed
with their reason."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import torch

import fleet_faults


def _attributes() -> list[tuple[object, dict]]:
    """The attributes of every module and class of dormouse's trainer, model
    and running gate (what a fleet or a mode runs), torch's public functions
    (torch, torch.nn.functional, torch.distributed), torch.nn.Module's and
    torch.Tensor's: what a fault that replaced an attribute would change."""
    import dormouse.model
    import dormouse.train

    for pkg in (dormouse.train, dormouse.model):
        for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(m.name)
    for name in RUNNING:
        importlib.import_module(name)
    owners = [sys.modules[n] for n in ("torch", "torch.nn.functional", "torch.distributed")]
    owners += [torch.nn.Module, torch.Tensor]
    for name, mod in sorted(sys.modules.items()):
        if name == "dormouse" or name.startswith("dormouse."):
            owners.append(mod)
            owners += [o for o in vars(mod).values() if isinstance(o, type) and o.__module__ == name]
    return [(o, dict(vars(o))) for o in owners]


RUNNING = ("dormouse.gate.record.modes", "dormouse.gate.record.dormouse_loop", "dormouse.gate.record.recorder",
           "dormouse.gate.record.reference", "dormouse.gate.fixtures")


def _changed(before: list[tuple[object, dict]]) -> list[str]:
    return [f"{getattr(o, '__name__', o)}.{k}" for o, attrs in before
            for k in set(attrs) | set(vars(o)) if vars(o).get(k, None) is not attrs.get(k, None)
            and k not in ("__dict__", "__weakref__", "__slotnames__")]


def test_no_fault_replaces_a_module_attribute(monkeypatch):
    monkeypatch.setenv("DORMOUSE_TEST_FAULT_SCALE", "1")
    before = _attributes()
    try:
        for fault, plant in fleet_faults.FAULTS.items():
            plant()  # unscoped: whatever it changes stays until the end of this test
            assert not _changed(before), f"{fault} replaced {_changed(before)}: plant it through a hook"
    finally:
        for seam in fleet_faults.seams():
            seam.clear()


def test_scoped_removes_every_hook_a_fault_installed_and_unscoped_they_stay(monkeypatch):
    monkeypatch.setenv("DORMOUSE_TEST_FAULT_SCALE", "1")
    before = [list(s) for s in fleet_faults.seams()]
    for fault in fleet_faults.FAULTS:
        with fleet_faults.scoped(fault):
            installed = [list(s) for s in fleet_faults.seams()]
        assert [list(s) for s in fleet_faults.seams()] == before, f"{fault} left a hook behind"
        assert installed != before or fault in NOT_A_HOOK, f"{fault} installed nothing"
    fleet_faults.FAULTS["grad_x2"]()  # planted without the scope: its hook stays (what a leak would be)
    try:
        assert [list(s) for s in fleet_faults.seams()] != before
    finally:
        for seam, items in zip(fleet_faults.seams(), before):
            seam[:] = items


NOT_A_HOOK: set[str] = set()  # every fault acts through at least one seam


# Where a test replaces an attribute of dormouse for a reason other than a fault, and why.
NOT_A_FAULT = {
    ("tests/train/test_resume_parity.py", "measure_floor"): "skips the ulp floor of a run whose checkpoint "
                                                            "and tensors alone are used (time, not a fault)",
}


def _replaced_attributes(path) -> list[tuple[int, str]]:
    """(line, attribute) of every `setattr(X, "name", ...)` (monkeypatch's or the builtin) and every
    `X.name = ...` in `path` where X is a module or name the file imported from dormouse."""
    import ast

    tree = ast.parse(path.read_text())
    ours: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            ours |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("dormouse")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dormouse"):
            ours |= {a.asname or a.name for a in node.names}

    def root(e) -> str | None:
        while isinstance(e, ast.Attribute):
            e = e.value
        return e.id if isinstance(e, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "setattr"
                and len(node.args) >= 2 and root(node.args[0]) in ours and isinstance(node.args[1], ast.Constant)):
            found.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.Assign):
            found += [(node.lineno, t.attr) for t in node.targets
                      if isinstance(t, ast.Attribute) and root(t.value) in ours]
    return sorted(found)


def test_no_test_replaces_an_attribute_of_dormouse_to_plant_a_fault():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    found = [(str(p.relative_to(root)), line, attr) for p in sorted((root / "tests").rglob("*.py"))
             for line, attr in _replaced_attributes(p)]
    assert [f for f in found if (f[0], f[2]) not in NOT_A_FAULT] == [], "plant it through a hook"
    assert {(f, a) for f, _, a in found} == set(NOT_A_FAULT)  # each exception still needed


def test_the_attribute_reader_sees_a_planted_replacement(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("import dormouse.train.loop as loop\nfrom dormouse.train.data import ByteCorpus\n"
                       "def test_x(monkeypatch):\n    monkeypatch.setattr(ByteCorpus, 'read', None)\n"
                       "    loop.save_checkpoint = None\n    setattr(loop.torch, 'x', 1)\n")
    assert sorted(_replaced_attributes(planted)) == [(4, "read"), (5, "save_checkpoint"), (6, "x")]
