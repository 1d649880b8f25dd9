"""docs/benchmarks.md's three writers (dormouse/bench/page.py): each rewrites its own part and keeps the others'."""

from __future__ import annotations

from dormouse.bench.page import SCALE, SECTION, write_head, write_section


def test_each_writer_keeps_the_others_sections_in_page_order(tmp_path):
    page = tmp_path / "benchmarks.md"
    write_head(page, "# Benchmarks\n\nhead one\n")
    write_section(page, SECTION + "\n\naccelerator one\n")
    write_section(page, SCALE + "\n\nscale one\n", heading=SCALE)
    write_head(page, "# Benchmarks\n\nhead two\n")
    write_section(page, SCALE + "\n\nscale two\n", heading=SCALE)
    text = page.read_text()
    assert "head two" in text and "head one" not in text
    assert "scale two" in text and "scale one" not in text and "accelerator one" in text
    assert text.index("head two") < text.index(SCALE) < text.index(SECTION)
    assert text.count(SCALE) == 1 and text.count(SECTION) == 1


def test_the_scale_section_merges_several_runs_by_size_and_lists_every_planted_fault(tmp_path):
    """`python -m dormouse.bench --scale --render a.json,b.json`: a size's clean figures and its faults measured
    in separate runs end in one row and one faults table; a verdict that is not the one-process one is said."""
    import json

    from dormouse.bench.scale import render_scale

    meta = {"cpus": 2, "loadavg_start": [1.0], "loadavg_end": [2.0], "check_threads": 2, "steps": 3}
    clean = {"rows": [{"size": "small", "params_m": 124, "none": {"wall_s": 50, "rc": 0, "cpu_s": 90},
                       "full": {"wall_s": 75, "rc": 0, "cpu_s": 130, "rank_peak_gb": 5.0, "disk_per_step_gb": 2.2},
                       "check": {"wall_s": 200, "cpu_s": 300, "rc": 0, "peak_gb": 5.1, "verdict": "PASS"},
                       "check_sharded": {"ranks": 2, "wall_s": 260, "peak_gb": 3.0, "verdict": "FAIL (x)",
                                         "same_verdict": False}}], "meta": meta}
    faulty = {"rows": [{"size": "small", "params_m": 124, "faults": {"local_norm": {
        "verdict": "FAIL (clip: ...)", "check_wall_s": 210, "peak_gb": 5.2,
        "fails": ["[FAIL] clip: at step 1 the loop clipped by a | local norm"]}}}], "meta": meta}
    paths = []
    for name, res in (("a", clean), ("b", faulty)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(res))
    page = tmp_path / "benchmarks.md"
    render_scale(paths, docs=page)
    text = page.read_text()
    assert text.count("| small (124M), 256 tokens |") == 2  # the clean row and the fault's row
    assert "200 s (2.67 ×" in text and "5.10 GB (1.02 ×)" in text
    assert "clipped by its local norm" not in text and "clipped by the rank's local norm | FAIL |" in text
    assert "clipped by a / local norm" in text  # a table cell never holds a bare |
    assert "(NOT the same)" in text


def test_merged_scale_runs_keep_each_planted_faults_own_steps():
    """A size's clean figures come from the last run that measured them, its faults from every run: a
    fault recorded over 2 steps stays "2 steps" on the page when a later 3-step run re-measures the size."""
    from dormouse.bench.scale import faults_table, merged

    fault = {"verdict": "FAIL (x)", "fails": ["[FAIL] gradient: off"], "peak_gb": 5.0}
    old = {"rows": [{"size": "small", "steps": 2, "faults": {"micro_mean": fault}}]}
    new = {"rows": [{"size": "small", "steps": 3, "full": {"wall_s": 60.0}}],
           "meta": {"cpus": 2, "steps": 3, "check_threads": 2, "loadavg_start": [1, 1, 1], "loadavg_end": [1, 1, 1]}}
    rows = merged([old, new])["rows"]
    assert rows[0]["steps"] == 3 and rows[0]["full"] == {"wall_s": 60.0}
    line = faults_table(rows).splitlines()[-1]
    assert ", 2 steps |" in line and "gradient: off" in line


def test_a_scale_row_measured_in_full_alone_shows_its_other_runs_as_not_measured():
    """A run with --modes full,check has no unrecorded or sketched run: the page says "—", not "failed"."""
    from dormouse.bench.scale import table

    row = {"size": "mid", "steps": 3, "full": {"wall_s": 17.0, "rc": 0, "disk_per_step_gb": 0.64, "rank_peak_gb": 1.7},
           "check": {"wall_s": 32.0, "cpu_s": 40.0, "peak_gb": 1.65, "verdict": "PASS"}}
    line = table([row]).splitlines()[-1]
    assert "— → — → 17" in line and "failed" not in line and "nan" not in line
    row["none"] = {"wall_s": 10.0, "rc": 1}
    assert "failed → — → 17" in table([row]).splitlines()[-1]
