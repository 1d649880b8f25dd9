"""dormouse.gate.artifacts.layout names every file of the one run format in
one place: a recording's, its reference's, and dormouse's own gate's
references beside them; GateReferences finds the gate's by those names."""

from __future__ import annotations

import json
from pathlib import Path

from dormouse.gate.artifacts import (EXACT, FLOOR, GATE_SCHEMA, GRADREF, SINGLE, GateReferences, gate_reference_dir,
                                     gate_reference_path, rank_dir, rank_name, recording_path, reference_dir,
                                     step_tensors_path, write_gate_json)


def test_every_path_of_a_gate_run_lies_under_its_recording():
    out = Path("/o")
    assert rank_name(3) == "rank3" and rank_dir(out, 3) == out / "rank3"
    assert step_tensors_path(out, 1, 7) == out / "rank1" / "step000007.safetensors"
    assert recording_path(out) == out / "recording.json"
    assert gate_reference_dir(out, SINGLE) == reference_dir(out) / "single"
    assert gate_reference_path(out, GRADREF) == out / "reference" / "gradref.json"


def test_the_gate_references_present_are_the_files_written(tmp_path):
    refs = GateReferences(tmp_path)
    assert refs.present == [] and refs.meta(GRADREF) is None and refs.recording(SINGLE) is None
    write_gate_json(gate_reference_path(tmp_path, GRADREF), {"run": "r"}) if reference_dir(tmp_path).mkdir() is None \
        else None
    recording_path(gate_reference_dir(tmp_path, EXACT)).parent.mkdir(parents=True)
    recording_path(gate_reference_dir(tmp_path, EXACT)).write_text("{}")
    assert refs.present == [EXACT, GRADREF] and not refs.has(FLOOR) and not refs.has(SINGLE)
    assert refs.meta(GRADREF) == {"schema": GATE_SCHEMA, "run": "r"}


def test_a_gate_reference_of_another_schema_is_one_line_saying_re_run(tmp_path):
    import pytest

    from dormouse.errors import DormouseError

    reference_dir(tmp_path).mkdir()
    gate_reference_path(tmp_path, FLOOR).write_text(json.dumps({"schema": 1}))
    with pytest.raises(DormouseError, match="has schema 1, expected 3: re-run it"):
        GateReferences(tmp_path).meta(FLOOR)


def _prefix_literals(path: Path, prefixes: set[str]) -> list[tuple[int, str]]:
    """The string literals of `path`'s code (docstrings left out; an f-string by its leading text) that are a
    tensor-key prefix or start with one."""
    import ast

    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for n in ast.walk(tree):
        c = n.values[0] if isinstance(n, ast.JoinedStr) and n.values else n
        if isinstance(c, ast.Constant) and isinstance(c.value, str) and id(c) not in docs \
                and any(c.value.startswith(p) for p in prefixes):
            found.append((c.lineno, c.value))
    return sorted(set(found))


def test_every_tensor_key_prefix_is_typed_in_layout_alone(tmp_path):
    import dormouse
    from dormouse.gate.artifacts import layout

    prefixes = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str) and v.endswith("/")}
    assert {"p/", "g/", "b/", "in/", "rp/", "wa/"} <= prefixes
    package = Path(dormouse.__file__).parent
    typed = {str(p.relative_to(package)): found for p in sorted(package.rglob("*.py"))
             if p != Path(layout.__file__) and (found := _prefix_literals(p, prefixes))}
    assert typed == {}
    planted = tmp_path / "planted.py"  # the reader sees a literal and an f-string's head, not a docstring
    planted.write_text('"""g/ in a docstring."""\nA = "g/"\nB = f"in/{1}/x"\n')
    assert _prefix_literals(planted, prefixes) == [(2, "g/"), (3, "in/")]
