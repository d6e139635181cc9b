"""The rows of a JSON-lines file a run appends to (``metrics.jsonl``, ``snapshots.jsonl``, ...).

A kill can tear the last line, and a file may not exist yet: readers take every complete row and skip
the rest, in one place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every complete JSON object line of ``path``, in order ([] when the file is absent); a torn,
    blank or non-object line is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
