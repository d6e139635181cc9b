"""Smoke test of ``examples/bench/replay_records.py`` (what ``record_calls`` costs the model server) at its
tiniest: its structure and the invariants its numbers must keep, not the numbers themselves."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "bench"))

import replay_records  # noqa: E402


def test_recording_adds_about_one_call_per_turn_to_a_capture_and_nothing_without_it():
    random.seed(0)
    res = replay_records.measure([6], turns=4, moved=0.5, repeats=1)
    rows = {(r["record_calls"], int(r["interval"])): r for r in res["results"]}
    assert set(rows) == {(on, i) for on in (False, True) for i in range(4)}
    for i in range(1, 4):
        off, on = rows[False, i], rows[True, i]
        assert off["kb_per_turn"] < 0.01  # a count changes, the record does not grow
        # what a turn adds is that turn's call (a few KB here), not the episode's history again
        assert 0.5 < on["kb_per_turn"] < 2 * rows[True, 1]["kb_per_turn"] + 0.5, (i, on)
        assert on["persisted_kb"] > off["persisted_kb"] and on["moved"] == 3
    assert replay_records.table(res).startswith("| N | record_calls |")
