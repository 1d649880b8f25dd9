"""The judge's bounds are one table (dormouse/gate/judge/bounds.py): every
tolerance is defined there and nowhere else in the package, the table in its
docstring lists each one, and the floor rule is one function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dormouse.gate.judge import bounds

PACKAGE = Path(bounds.__file__).resolve().parents[2]
BOUND_NAME = re.compile(r"^[A-Z0-9_]*(_RTOL|_MULTIPLE|_CAP|_AWAY|_SIGMAS|_FLOOR|_DELTA|UNIT_ROUNDOFF)$")


def _assigned(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name) and BOUND_NAME.match(t.id)]


def test_every_tolerance_is_defined_once_in_the_bounds_table_or_the_numerics():
    owners = {PACKAGE / "gate" / "judge" / "bounds.py", PACKAGE / "numerics.py"}
    elsewhere = {str(p.relative_to(PACKAGE)): names for p in PACKAGE.rglob("*.py")
                 if p not in owners and (names := _assigned(p))}
    assert elsewhere == {}
    defined = _assigned(PACKAGE / "gate" / "judge" / "bounds.py")
    assert len(defined) == len(set(defined))


def test_the_bounds_docstring_table_lists_every_bound_it_defines():
    table = {line.split("|")[1].strip() for line in bounds.__doc__.splitlines() if line.startswith("| ")}
    assert set(_assigned(PACKAGE / "gate" / "judge" / "bounds.py")) <= table


def test_no_module_types_the_bfloat16_unit_roundoff_as_a_literal():
    literal = re.compile(r"2(\.0)?\s*\*\*\s*-\s*8\b")
    hits = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if p.name != "numerics.py" and literal.search(p.read_text())]
    assert hits == []


@pytest.mark.parametrize("floor, minimum, want", [(0.0, 1e-5, 1e-5), (3e-6, 1e-5, 3e-5), (1e-7, 1e-6, 1e-6)])
def test_a_floor_bound_is_ten_floors_at_least_its_minimum(floor, minimum, want):
    assert bounds.floor_bound(floor, minimum) == pytest.approx(want)
