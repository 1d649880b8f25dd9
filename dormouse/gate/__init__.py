"""The distributed gate as a library, in three layers and one format:

    record/     the running side: the modes, the launcher, produce
    artifacts   the only module that knows artifact names, legs and layout
    judge/      pure functions from artifacts to typed checks and a Verdict
    show/       text, verdict.json, tables, plots

Arrows: record -> artifacts <- judge <- show, and record -> settings:
`settings` (what one gate run is asked to do), `fixtures` (the network, corpus
and run it derives) and `cli` (its flags) sit below the running side and
import none of the layers; the judge and the show read settings only as the
artifacts record them. Only the drivers (`__main__`, `pipeline`) import more
than one layer. `python -m dormouse.gate` drives it by hand."""


def __getattr__(name):
    # `from dormouse.gate import Recorder` without importing torch for the rest of the gate.
    if name == "Recorder":
        from dormouse.gate.record.recorder import Recorder

        return Recorder
    if name == "RecordingSpec":  # what a Recorder records (artifacts/spec.py)
        from dormouse.gate.artifacts.spec import RecordingSpec

        return RecordingSpec
    if name == "shard":  # a declared sharding's entry (record/declared.py)
        from dormouse.gate.record.declared import shard

        return shard
    raise AttributeError(f"module 'dormouse.gate' has no attribute {name!r}")
