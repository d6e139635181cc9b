"""The tables of the README and of docs/ render as tables (GitHub-flavoured Markdown), and the
README stays a front door: short, with the install, run and test commands near its top, and every
page it links to present.

A table is a header row, a delimiter row (``|---|``) and body rows with no
blank line between them: a blank line ends the table, and rows after it render
as plain text. Every row must have the header's column count (an unescaped
``|`` splits a cell, also inside backticks).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DELIMITER = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def cells(line: str) -> int:
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return len(re.split(r"(?<!\\)\|", inner))


def table_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every run of consecutive ``|`` lines outside code fences."""
    blocks: list[tuple[int, list[str]]] = []
    fenced = False
    current: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        is_row = not fenced and line.lstrip().startswith("|")
        if is_row:
            if not current:
                start = number
            current.append(line)
        elif current:
            blocks.append((start, current))
            current = []
    if current:
        blocks.append((start, current))
    return blocks


def problems(text: str, name: str) -> list[str]:
    found = []
    for start, rows in table_blocks(text):
        if len(rows) < 2 or not DELIMITER.match(rows[1].strip()):
            found.append(f"{name}:{start}: rows without a header and delimiter row (a blank line inside a "
                         f"table?): {rows[0][:80]!r}")
            continue
        width = cells(rows[0])
        if cells(rows[1]) != width:
            found.append(f"{name}:{start + 1}: delimiter row has {cells(rows[1])} columns, the header {width}")
        for offset, row in enumerate(rows[2:], 2):
            if cells(row) != width:
                found.append(f"{name}:{start + offset}: {cells(row)} columns, the header has {width}: {row[:80]!r}")
    return found


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_readme_and_docs_tables_parse_as_tables():
    found = []
    for page in PAGES:
        found += problems(page.read_text(), str(page.relative_to(REPO)))
    assert found == []
    assert len(table_blocks((REPO / "README.md").read_text())) >= 1
    # the checker saw the tables: those that moved from the README to docs/ are counted there
    assert sum(len(table_blocks(page.read_text())) for page in PAGES) >= 4


def test_the_readme_is_a_front_door():
    """At most 200 lines; the install, the main job and the test command (exactly what CI runs) in
    its first 60; every relative link points at a file that exists."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:60])
    for command in ('python -m pip install -e ".[test]"', "python examples/run_grpo.py\n",
                    "python -m pytest -q\n"):
        assert command in head + "\n", f"README.md lacks {command!r} in its first 60 lines"
    assert len(LINK.findall(text)) >= 5
    assert broken_links(REPO / "README.md") == []


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def broken_links(page: Path) -> list[str]:
    """The relative links of a Markdown page that point at nothing, from the page's own folder."""
    return [f"{page.relative_to(REPO)} -> {link}" for link in LINK.findall(page.read_text())
            if "://" not in link and not (page.parent / link).exists()]


def test_the_docs_links_resolve():
    """A page moved to docs/ keeps its links working (they are relative to docs/ there)."""
    assert [b for page in PAGES for b in broken_links(page)] == []
    assert broken_links_in_text("[x](../no_such_file.md)") == ["x.md -> ../no_such_file.md"]


def broken_links_in_text(text: str) -> list[str]:
    page = REPO / "docs" / "x.md"
    return [f"x.md -> {link}" for link in LINK.findall(text) if not (page.parent / link).exists()]


def test_the_checker_catches_a_blank_line_and_a_short_row():
    good = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert problems(good, "x") == []
    assert problems(good + "\n| 3 | 4 |\n", "x")  # a blank line split the table: its last row is plain text
    assert problems("| a | b |\n|---|---|\n| 1 |\n", "x")
    assert problems("| a | b |\n|---|---|\n| `x | y` | 2 |\n", "x")  # a pipe in a code span splits the cell
    assert problems("```\n| not | a table |\n```\n", "x") == []
