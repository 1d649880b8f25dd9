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
