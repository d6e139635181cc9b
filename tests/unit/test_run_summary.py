"""The end-of-run table and its no-signal warning (``nemo_rl/utils/plots.py``)."""

from nemo_rl.utils.plots import no_reward_signal, summary_table


def _rows(*advantages):
    return [{"step": i + 1, "reward_mean": 0.5, "advantage_abs_mean": a, "snapshot_coverage": 0.5 + i / 10}
            for i, a in enumerate(advantages)]


def test_no_reward_signal_only_when_every_step_had_zero_advantage():
    assert no_reward_signal(_rows(0.0, 0.0, 0.0))
    assert not no_reward_signal(_rows(0.0, 0.2, 0.0))
    assert not no_reward_signal([{"step": 1, "reward_mean": 1.0}])  # a trainer that reports no advantages
    assert not no_reward_signal([])


def test_summary_shows_coverage_wall_time_and_directories(tmp_path):
    table = summary_table(_rows(0.1, 0.2), tmp_path, wall_s=42.25, checkpoint_dir="results/x")
    lines = dict(tuple(c.strip() for c in line.strip("|").split("|")) for line in table.splitlines()[2:])
    assert lines["steps trained"] == "2"
    assert lines["snapshot coverage (share of wall time)"] == "0.600"  # the last row's running share
    assert lines["wall time s (this start)"] == "42.2"
    assert lines["log dir"] == str(tmp_path) and lines["checkpoint dir"] == "results/x"


def _table(tmp_path, rows, tail=""):
    import json

    (tmp_path / "snapshots.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    table = summary_table(_rows(0.1), tmp_path)
    return dict(tuple(c.strip() for c in line.strip("|").split("|")) for line in table.splitlines()[2:])


def test_summary_counts_distinct_rollouts_not_saves_per_snapshot(tmp_path):
    rows = [{"committed": True, "saved": 8, "unsaved": 3, "new_saved": 8, "new_unsaved": 3},
            {"committed": True, "saved": 8, "unsaved": 3, "new_saved": 2, "new_unsaved": 0},
            {"committed": False, "saved": 9, "unsaved": 3, "new_saved": 0, "new_unsaved": 0}]
    lines = _table(tmp_path, rows, tail='{"committed": tr')  # the last line torn by a kill
    assert lines["snapshots committed / attempted"] == "2 / 3"
    assert lines["rollouts saved at turn level (distinct)"] == "10"
    assert lines["rollouts unsaved on restart-only servers (distinct)"] == "3"
    assert lines["rollout saves, all snapshots (one per rollout per snapshot)"] == "16"


def test_summary_says_when_older_rows_have_no_first_counts(tmp_path):
    rows = [{"committed": True, "saved": 5, "unsaved": 0},  # written before new_saved existed
            {"committed": True, "saved": 5, "unsaved": 0, "new_saved": 1, "new_unsaved": 0}]
    lines = _table(tmp_path, rows)
    assert lines["rollouts saved at turn level (distinct)"] == "1 (+ 1 older snapshot(s) that did not record it)"
