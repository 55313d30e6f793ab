"""BENCHMARKS.md sections: how every benchmark frames, lays out and writes its figures.

Each benchmark renders one Markdown section framed by its own ``<!-- bench:NAME:begin -->``
/ ``<!-- bench:NAME:end -->`` markers; ``write_section`` replaces just that section, so
benchmarks can be re-run one at a time without losing the others. The portal's benchmarks
(``tests/bench``, the digital twin) write through the same function.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path


def framed(name: str, lines: Iterable[str]) -> str:
    """``lines`` between the markers of section ``name``."""
    return "\n".join([f"<!-- bench:{name}:begin -->", *lines, f"<!-- bench:{name}:end -->"])


def without_markers(section: str) -> str:
    """What a benchmark prints: its section without the first and last lines (the markers)."""
    return "\n".join(section.strip().splitlines()[1:-1]).strip()


def table(columns: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A Markdown table's lines. ``align`` has one letter per column, ``l`` or ``r``; numbers
    read best right-aligned, so that is the default. Cells come formatted (``f"{x:.1f}"``)."""
    align = align or "r" * len(columns)
    if len(align) != len(columns):
        raise ValueError(f"{len(columns)} columns, {len(align)} alignments")
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def section(
    name: str,
    heading: str,
    prose: Sequence[str],
    columns: Sequence[str],
    rows: Iterable[Sequence[object]],
    align: str = "",
) -> str:
    """The usual section: a heading, a paragraph saying what was measured and how, a table."""
    return framed(name, [f"## {heading}", "", *prose, "", *table(columns, rows, align)])


def write_section(path: Path, section: str) -> None:
    """Replace the section framed by ``section``'s first and last lines (its markers)."""
    lines = section.strip().splitlines()
    begin, end = lines[0], lines[-1]
    text = path.read_text() if path.exists() else "# Benchmarks\n\nFigures measured by `make bench`.\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section.strip() + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section.strip() + "\n"
    path.write_text(text)
