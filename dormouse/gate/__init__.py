"""The distributed gate as a library, in three layers and one format:

    record/     the running side: fixtures, the modes, the launcher, produce
    artifacts   the only module that knows artifact names, legs and layout
    judge/      pure functions from artifacts to typed checks and a Verdict
    show/       text, verdict.json, tables, plots

Arrows: record -> artifacts <- judge <- show. `settings` (what one gate run is
asked to do) is read by every layer; only the drivers (`__main__`, `pipeline`)
import more than one layer. `python -m dormouse.gate` drives it by hand."""
