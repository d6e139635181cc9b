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
