"""Smoke test of ``examples/bench_recovery.py``: the tiniest configuration of every
measurement, in-process, against real servers; checks each result's structure and
the invariants the numbers must satisfy (not the numbers themselves).

The two measurements that run ``run_grpo.py`` processes (work lost, setup check)
run in background threads while the Gym-level ones run, to stay under 40 s.
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from bench import alternative, overhead, setup_check, snapshot_cost, stall, work_lost  # noqa: E402
from bench.common import SharedGym  # noqa: E402
from bench.plots import plot  # noqa: E402
from bench.presets import TINY  # noqa: E402

pytestmark = [pytest.mark.functional, pytest.mark.timeout(150)]


def _quiet(_: str) -> None:
    pass


def _finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_every_measurement_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        lost_future = pool.submit(work_lost.measure, workdir=tmp_path / "lost", log=_quiet, **TINY["work_lost"])
        setup_future = pool.submit(setup_check.measure, workdir=tmp_path / "setup", log=_quiet,
                                   **TINY["setup_check"])
        try:
            cost = snapshot_cost.measure(workdir=tmp_path / "cost", log=_quiet, **TINY["snapshot_cost"])
            with SharedGym(tmp_path / "shared") as env:
                stalled = stall.measure(workdir=tmp_path / "shared", env=env, log=_quiet, **TINY["stall"])
                alt = alternative.measure(workdir=tmp_path / "shared", env=env, log=_quiet, **TINY["alternative"])
                ovh = overhead.measure(workdir=tmp_path / "shared", env=env, log=_quiet, **TINY["overhead"])
        finally:
            lost, setup = lost_future.result(), setup_future.result()

    check_snapshot_cost(cost)
    check_stall(stalled)
    check_work_lost(lost)
    check_alternative(alt)
    check_overhead(ovh)
    check_setup(setup)
    for module, res in ((snapshot_cost, cost), (stall, stalled), (work_lost, lost), (alternative, alt),
                        (overhead, ovh), (setup_check, setup)):
        assert res["name"] == module.NAME
        assert module.table(res).startswith("|")
        assert plot(module.NAME, res, tmp_path).stat().st_size > 1000


def check_snapshot_cost(res: dict[str, Any]) -> None:
    (row,) = res["rows"]
    n = TINY["snapshot_cost"]["sizes"][0]
    assert (row["n"], row["storage"], row["agents"]) == (n, "disk", 1)
    (idle,), (tool,) = row["raw"]["idle"], row["raw"]["tool"]
    assert idle["committed"] and tool["committed"]
    assert idle["saved"] == n and tool["saved"] == n + 1  # every parked session, plus the probe
    for snap in (idle, tool):
        parts = snap["prepare_s"] + snap["commit_s"] + snap["publish_s"] + snap["resume_s"]
        assert 0 < parts <= snap["pause_s"] + 1e-6
        assert snap["bytes"] > 1000 * n
    # the probe's slow tool call was in flight: the pause waited for what was left of it
    assert 0 < tool["tool_remaining_min_s"] <= res["config"]["tool_s"]
    assert tool["pause_s"] >= tool["tool_remaining_min_s"]  # prepare waited for the rest of the call
    assert math.isclose(tool["excess_s"], tool["pause_s"] - tool["tool_remaining_min_s"])
    assert res["goal"]["pause_met"] is None  # N=512 is not part of the tiny run


def check_stall(res: dict[str, Any]) -> None:
    rows = {r["policy"]: r for r in res["rows"]}
    deadline = res["config"]["prepare_deadline_s"]
    block, best = rows["block"], rows["best_effort"]
    assert block["committed"] == 0 and block["attempts"] == TINY["stall"]["attempts"]
    assert block["time_per_attempt_s"]["min"] >= deadline * 0.9  # each attempt waited out the deadline
    assert block["blocking_servers"] == [SharedGym.PLAIN]
    assert best["committed"] == best["attempts"] == TINY["stall"]["attempts"]
    assert best["time_per_attempt_s"]["max"] < block["time_per_attempt_s"]["min"]
    assert best["unsaved"]["min"] >= 1 and best["saved"]["min"] >= 1
    assert res["goal"] == {"block_commits_none": True, "best_effort_commits_all": True}


def check_work_lost(res: dict[str, Any]) -> None:
    (exp,) = res["experiments"]
    assert not exp.get("error"), exp
    assert exp["stragglers"] == []  # the killed run left no process behind
    assert exp["lineage_ok"]
    assert exp["in_flight"] > 0 and exp["restored"] > 0
    assert exp["restored"] + exp["restarted"] + exp["kept"] == exp["in_flight"]
    assert exp["generated_calls"] - exp["needed_calls"] == exp["regen_calls"] >= 0
    for p in exp["per_restored"]:
        assert p["saved_calls"] is not None
        assert p["first_turn_after_restore"] in (None, p["saved_calls"])  # continued where it was saved
        assert 0 <= p["regen_before_snapshot_end"] <= p["regen_calls"]
    (row,) = res["rows"]
    assert row["crashes"] == 1 and row["lineage_ok"] and row["resumed_at_saved_turn"]
    assert res["goal"]["met"] is True


def check_alternative(res: dict[str, Any]) -> None:
    rows = {r["mode"]: r for r in res["rows"]}
    assert res["config"]["interval_s"] < res["config"]["rollout_s_median"]  # shorter than a rollout
    assert rows["best_effort"]["snapshots"]["min"] >= 1
    assert rows["best_effort"]["committed"]["min"] == rows["best_effort"]["snapshots"]["min"]
    assert rows["alternative"]["snapshots"]["min"] >= 1
    assert rows["alternative"]["retired_total"]["min"] > 0  # every snapshot cancels the rollouts in flight
    assert rows["best_effort"]["retired_total"]["max"] == 0 and rows["none"]["retired_total"]["max"] == 0
    assert all(r["rollouts_per_min"]["median"] >= 0 for r in rows.values())


def check_overhead(res: dict[str, Any]) -> None:
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"none", "T10", "T3"}
    turn = res["config"]["typical_turn_s"]
    assert 0 < turn < 5
    assert rows["none"]["rollouts_per_min"]["median"] > 0
    assert math.isclose(rows["T3"]["interval_s"], 3 * turn)
    assert rows["T3"]["snapshots"]["median"] >= 1
    assert _finite(rows["T3"]["overhead_pct"]["median"], rows["T10"]["overhead_pct"]["median"])
    assert res["goal"]["met"] in (True, False)


def check_setup(res: dict[str, Any]) -> None:
    (run,) = res["runs"]
    assert run["rc"] != 0
    assert res["goal"] == {"error_names_every_restart_only_server": True, "no_rollout_ran": True}
    parts = ("python_imports_config_s", "ray_init_s", "before_gym_s", "gym_start_s", "discover_and_check_s",
             "shutdown_s")
    assert all(run[p] >= 0 for p in parts) and run["ray_init_s"] > 0 and run["gym_start_s"] > 0
    assert math.isclose(sum(run[p] for p in parts), run["total_s"], rel_tol=1e-6)
    assert run["gym_deployment_start_s"] <= run["gym_start_s"]
    assert run["to_error_s"] < run["total_s"]
