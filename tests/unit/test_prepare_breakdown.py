"""``examples/bench/prepare_breakdown.py`` on the raw logs kept in ``docs/benchmarks/`` (§1c): the
attempts it classes and the figures the table in docs/benchmarks.md §1c was read from."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from bench.prepare_breakdown import breakdown  # noqa: E402


def median_ms(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row.get(key, 0.0) for row in rows) * 1e3


@pytest.mark.parametrize("name, bursts, resources_close_ms", [("before", 16, 20.3), ("after", 14, 0.0)])
def test_the_kept_logs_give_the_documented_breakdown(name: str, bursts: int, resources_close_ms: float):
    base = ROOT / "docs" / "benchmarks" / f"prepare_breakdown_{name}"
    rows = breakdown(base / "run", base / "control")
    assert len(rows["burst"]) == bursts and len(rows["steady"]) == 3
    assert median_ms(rows["burst"], "resources: close") == pytest.approx(resources_close_ms, abs=0.05)
    for row in rows["burst"] + rows["steady"]:
        # The handlers and the gaps between them lie inside the controller's call.
        parts = [v for k, v in row.items() if k == "to the first handler" or k.endswith(("gap before", ": handler"))
                 or k == "tail after the last"]
        assert sum(parts) == pytest.approx(row["prepare call"], abs=1e-6)
        assert {"model: handler", "agent: handler", "resources: handler"} <= set(row)
