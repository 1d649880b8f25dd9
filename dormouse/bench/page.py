"""docs/benchmarks.md, written by two commands: `dormouse bench --docs` owns the
page up to the accelerator section, `python -m dormouse.bench.device --docs`
owns that section, from its heading to the page's end. Each rewrites its own
part and keeps the other's, atomically."""

from __future__ import annotations

from pathlib import Path

from dormouse import atomic

SECTION = "## On an accelerator"  # the docs page's section bench.device owns, to the page's end


def kept_section(page: Path) -> str:
    """The page's accelerator section, for `dormouse bench --docs` to keep ("" when none)."""
    if not page.exists() or SECTION not in page.read_text():
        return ""
    return SECTION + page.read_text().split(SECTION, 1)[1]


def write_head(page: Path, text: str) -> None:
    """The page's text before the accelerator section, keeping that section as it is."""
    keep = kept_section(page)
    atomic.write_text(page, text + ("\n" + keep if keep else ""))


def write_section(page: Path, section: str) -> None:
    """Replace (or add) the accelerator section at the end of the page, atomically."""
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    head = text.split(SECTION)[0].rstrip("\n")
    atomic.write_text(page, head + "\n\n" + section)
