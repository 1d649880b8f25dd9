"""RecordingSpec and RecordedRun (dormouse.gate.artifacts.spec): recording.json is written from
them and read back into them; a wrong field, when made or when read, is one line naming it; a
recording of an older schema is one line saying to re-record."""

from __future__ import annotations

import json

import pytest

from dormouse.errors import DormouseError
from dormouse.gate.artifacts.layout import RECORDING_SCHEMA
from dormouse.gate.artifacts.spec import RecordedRun, RecorderError, RecordingSpec, read_recording, to_json

SPEC = dict(build_model="pkg.mod:build", build_optimizer="pkg.mod:opt")


def _run(**kw) -> RecordedRun:
    return RecordedRun(**{"run": "abc", "world": 2, "segments": [{"start": 1, "end": 3, "world": 2,
                                                                   "resumed": False}], "steps": [1, 2, 3],
                          "closed": True, **kw})


def test_a_spec_and_its_run_come_back_from_recording_json_equal(tmp_path):
    spec = RecordingSpec(**SPEC, objective="pkg.mod:loss", objective_scope="step", max_grad_norm=1.0,
                         dataset_len=8, sketch=16, every=2, inputs=["input_ids"], build_kwargs={"seed": 3},
                         probe_steps=[2], selfcheck=32, stop_on_fail=True, reduction="sum", start=4,
                         extra={"note": [1, 2]})
    run = _run(layout={"kind": "tp"}, frozen=["w"], stopped={"step": 3, "findings": ["x"]})
    text = json.dumps(to_json(spec, run))  # what the Recorder writes
    back_spec, back_run = read_recording(json.loads(text), tmp_path / "recording.json")
    assert back_spec == spec and back_run == run
    assert back_spec.inputs == ("input_ids",) and back_spec.probe_steps == (2,)  # lists read back as tuples
    assert json.loads(text)["schema"] == RECORDING_SCHEMA and json.loads(text)["kind"] == "recording"


@pytest.mark.parametrize("bad, words", [
    ({"sketch": "16"}, "sketch='16' is not an integer"),
    ({"every": 0}, "every=0"),
    ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0: must be >= 0"),
    ({"stop_on_fail": 1}, "stop_on_fail=1 is not true or false"),
    ({"wire": "fp16"}, "wire 'fp16' is none of fp32, bf16"),
    ({"build_model": "no_colon"}, "build_model 'no_colon' is not an import path"),
    ({"start": -1}, "start=-1"),
    ({"extra": {"t": object()}}, "extra must be a JSON object"),
])
def test_a_bad_field_is_one_line_naming_it(bad, words):
    with pytest.raises(RecorderError) as e:
        RecordingSpec(**{**SPEC, **bad})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_bad_field_in_recording_json_is_one_line_naming_the_file_and_the_field(tmp_path):
    meta = to_json(RecordingSpec(**SPEC), _run())
    path = tmp_path / "recording.json"
    for key, value, words in (("sketch", True, "field 'sketch' is True, not an integer"),
                              ("world", 3, "world is 3 but its last segment ran at world 2"),
                              ("reduction", "max", "reduction='max'")):
        with pytest.raises(DormouseError) as e:
            read_recording({**meta, key: value}, path)
        assert str(e.value).startswith(str(path)) and words in str(e.value) and "re-record" in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(DormouseError, match="field 'build_model' is missing"):
        read_recording({k: v for k, v in meta.items() if k != "build_model"}, path)


def test_a_recording_of_an_older_schema_is_one_line_saying_re_record(tmp_path):
    meta = to_json(RecordingSpec(**SPEC), _run())
    path = tmp_path / "recording.json"
    with pytest.raises(DormouseError) as e:
        read_recording({**meta, "schema": RECORDING_SCHEMA - 1}, path)
    assert str(e.value) == f"{path}: recorded by an older dormouse (schema {RECORDING_SCHEMA - 1}): re-record"
    with pytest.raises(DormouseError, match="recorded by a newer dormouse"):
        read_recording({**meta, "schema": RECORDING_SCHEMA + 1}, path)
    with pytest.raises(DormouseError, match="is not a recording"):
        read_recording({**meta, "kind": "reference"}, path)
