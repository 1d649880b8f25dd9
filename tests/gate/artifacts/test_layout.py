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
