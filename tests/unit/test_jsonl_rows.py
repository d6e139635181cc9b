"""A run's JSON-lines files are read the same way everywhere: complete rows, a torn last line skipped."""

from __future__ import annotations

from nemo_rl.utils.jsonl_rows import read_rows


def test_complete_rows_only_and_nothing_for_a_missing_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_rows(path) == []
    path.write_text('{"step": 1}\n\n[1, 2]\n"text"\n{"step": 2}\n{"step": 3, "tor')  # killed mid-write
    assert read_rows(path) == [{"step": 1}, {"step": 2}]
