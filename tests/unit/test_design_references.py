"""Every section a docstring or comment cites as ``docs/design.md §N[.M]`` (also each ``§`` listed right after
it: ``docs/design.md §5.3, §5.5``) is a section heading of ``docs/design.md``, and no old-style ``DESIGN §``
reference is left."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("nemo_rl", "gym_patches", "testkit", "examples")
REFERENCE = re.compile(r"docs/design\.md\s+(§\d+(?:\.\d+)*(?:\s*(?:,|;|and)\s*§\d+(?:\.\d+)*)*)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,}\s+(\d+(?:\.\d+)*)\.?\s+\S", re.MULTILINE)


def _sources() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py"))


def _sections() -> set[str]:
    return set(HEADING.findall((REPO / "docs" / "design.md").read_text()))


def test_every_design_section_cited_exists():
    sections = _sections()
    cited, missing = 0, []
    for path in _sources():
        text = path.read_text()
        for match in REFERENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            for number in SECTION.findall(match.group(1)):
                cited += 1
                if number not in sections:
                    missing.append(f"{path.relative_to(REPO)}:{line} cites docs/design.md §{number}")
    assert missing == [], (f"sections docs/design.md does not have (it has {sorted(sections)}):\n"
                           + "\n".join(missing))
    assert cited > 30  # the scan finds the references it checks


def test_no_old_style_design_reference_is_left():
    old = [f"{p.relative_to(REPO)}:{n}" for p in _sources()
           for n, line in enumerate(p.read_text().splitlines(), 1) if "DESIGN §" in line]
    assert old == [], "cite docs/design.md §N instead of DESIGN §N:\n" + "\n".join(old)


def test_the_headings_are_read():
    sections = _sections()
    assert {"1", "4.4", "4.5", "5.10", "5.11"} <= sections and "3.4" not in sections
