"""The newcomer's map in ``docs/design.md`` (§3.1 "Where things live") stays true: every path it names
exists in the repository, and every section it sends the reader to is a heading of the file.

A path is a backticked token with a ``/`` in it or a file name (``name.ext``), without spaces; a
trailing ``::name`` (a function in the file) is dropped. A map that points at a moved file fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
MAP_HEADING = "### 3.1 Where things live"
BACKTICKED = re.compile(r"`([^`\s]+)`")
FILE_NAME = re.compile(r"\.(py|md|yaml|yml|json|sh|toml)$")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,}\s+(\d+(?:\.\d+)*)\.?\s+\S", re.MULTILINE)


def _map_text() -> str:
    """The subsection's text, from its heading to the next heading of any level."""
    text = DESIGN.read_text()
    start = text.find(MAP_HEADING)
    assert start >= 0, f"{DESIGN.relative_to(REPO)} has no '{MAP_HEADING}' heading"
    body_start = start + len(MAP_HEADING)
    following = re.search(r"^#{1,6}\s", text[body_start:], re.MULTILINE)
    return text[body_start:body_start + following.start()] if following else text[body_start:]


def _paths(text: str) -> list[str]:
    """The repository paths the text names in backticks."""
    out = []
    for token in BACKTICKED.findall(text):
        path = token.split("::", 1)[0]
        if "/" in path or FILE_NAME.search(path):
            out.append(path)
    return out


def test_every_path_in_the_map_exists():
    paths = _paths(_map_text())
    missing = [p for p in paths if not (REPO / p).exists()]
    assert missing == [], f"docs/design.md §3.1 names paths that do not exist: {missing}"
    assert len(paths) >= 30  # the extraction finds the paths it checks


def test_every_section_in_the_map_exists():
    sections = set(HEADING.findall(DESIGN.read_text()))
    cited = SECTION.findall(_map_text())
    missing = sorted(set(cited) - sections)
    assert missing == [], f"docs/design.md §3.1 sends the reader to sections it lacks: {missing}"
    assert len(cited) >= 15


def test_the_map_stays_short():
    """A newcomer reads it in two minutes: about forty lines at most."""
    lines = [line for line in _map_text().splitlines() if line.strip()]
    assert len(lines) <= 40, f"docs/design.md §3.1 has {len(lines)} lines"


def test_a_missing_path_is_caught():
    """The extraction sees a path that is not there (so the first test can fail)."""
    paths = _paths("| x | `nemo_rl/no_such_module.py` (`Thing`), `--check`, `python -m a.b` |")
    assert paths == ["nemo_rl/no_such_module.py"]
    assert not (REPO / paths[0]).exists()
