"""docs/benchmarks.md, written by three commands: `dormouse bench --docs` owns the
page up to its owned sections; `python -m dormouse.bench --scale --docs` owns
"At scale" and `python -m dormouse.bench.device --docs` "On an accelerator",
each from its heading to the next owned heading (or the page's end). Each
rewrites its own part and keeps the others', atomically."""

from __future__ import annotations

from pathlib import Path

from dormouse import atomic

SECTION = "## On an accelerator"  # the docs page's section bench.device owns
SCALE = "## At scale"  # the section `python -m dormouse.bench --scale --docs` owns
OWNED = (SCALE, SECTION)  # the kept sections, in page order, each from its heading to the next one's (or the end)


def _parts(text: str) -> tuple[str, dict[str, str]]:
    """The page's head (before any owned section) and each owned section's text."""
    cuts = sorted((text.index(h), h) for h in OWNED if h in text)
    head = text[:cuts[0][0]] if cuts else text
    got = {h: text[at:(cuts[i + 1][0] if i + 1 < len(cuts) else len(text))] for i, (at, h) in enumerate(cuts)}
    return head, got


def _join(head: str, sections: dict[str, str]) -> str:
    parts = [head.rstrip("\n") + "\n"] + [sections[h].rstrip("\n") + "\n" for h in OWNED if sections.get(h)]
    return "\n".join(parts)


def kept_section(page: Path) -> str:
    """The page's owned sections (scale, accelerator), for `dormouse bench --docs` to keep ("" when none)."""
    if not page.exists():
        return ""
    _, got = _parts(page.read_text())
    return "\n".join(got[h].rstrip("\n") + "\n" for h in OWNED if got.get(h))


def write_head(page: Path, text: str) -> None:
    """The page's text before the owned sections, keeping those as they are."""
    keep = kept_section(page)
    atomic.write_text(page, text + ("\n" + keep if keep else ""))


def write_section(page: Path, section: str, heading: str = SECTION) -> None:
    """Replace (or add) one owned section (by default the accelerator's), atomically, keeping the rest."""
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    head, got = _parts(text)
    got[heading] = section
    atomic.write_text(page, _join(head, got))
