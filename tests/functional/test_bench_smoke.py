"""Smoke test of ``examples/bench_recovery.py``: the tiniest configuration of every
measurement, in-process, against real runs; checks each result's structure and the
invariants the numbers must satisfy (not the numbers themselves).

Every measurement but the rejected-alternative baseline runs ``examples/run_grpo.py``
through the shared run harness and reads the controller's own snapshot records, so
this is a chain of short real GRPO runs, one at a time.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from bench import alternative, overhead, setup_check, snapshot_cost, stall, work_lost  # noqa: E402
from bench.plots import plot  # noqa: E402
from bench.presets import TINY  # noqa: E402

pytestmark = [pytest.mark.functional, pytest.mark.timeout(420)]


def _quiet(_: str) -> None:
    pass


def _finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_every_measurement_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    results = {}
    for module in (snapshot_cost, stall, work_lost, alternative, overhead, setup_check):
        results[module.NAME] = module.measure(workdir=tmp_path / module.NAME, log=_quiet, **TINY[module.NAME])

    check_snapshot_cost(results["snapshot_cost"])
    check_stall(results["stall"])
    check_work_lost(results["work_lost"])
    check_alternative(results["alternative"])
    check_overhead(results["overhead"])
    check_setup(results["setup_check"])
    for module in (snapshot_cost, stall, work_lost, alternative, overhead, setup_check):
        res = results[module.NAME]
        assert res["name"] == module.NAME
        assert module.table(res).startswith("|")
        assert plot(module.NAME, res, tmp_path).stat().st_size > 1000


def check_snapshot_cost(res: dict[str, Any]) -> None:
    (row,) = res["rows"]
    n = TINY["snapshot_cost"]["sizes"][0]
    assert (row["variant"], row["n"], row["storage"], row["replicas"]) == ("default", n, "disk", 1)
    idle, tool = row["idle"], row["tool"]
    assert idle["stragglers"] == [] and tool["stragglers"] == []  # the harness reaped every run
    assert len(idle["attempts"]) >= 1 and len(tool["with_tool"]) >= 1
    for snap in idle["attempts"] + tool["attempts"]:
        assert snap["in_flight"] == n  # the controller's own count: every rollout of the step
        assert snap["prepare_s"] > 0 and snap["resume_s"] > 0  # the coordinator's own calls, timed
        assert snap["prepare_s"] < snap["pause_s"]  # inside the pause the controller recorded
        assert snap["bytes"] > 1000 * n  # published snapshot directory, read back
    # the controller's pause waited for the tool call still running when prepare began
    tool_s = res["config"]["tool_s"]
    for snap in tool["with_tool"]:
        assert 0 < snap["tool_left_s"] <= tool_s + 0.05
        assert snap["pause_s"] >= snap["tool_left_s"] - 0.05
        assert math.isclose(snap["excess_s"], snap["pause_s"] - snap["tool_left_s"])
    assert res["goal"]["pause_met"] is None  # N=512 is not part of the tiny run


def check_stall(res: dict[str, Any]) -> None:
    rows = {r["policy"]: r for r in res["rows"]}
    deadline = res["config"]["prepare_deadline_s"]
    block, best = rows["block"], rows["best_effort"]
    assert block["committed"] == 0 and block["attempts"] == TINY["stall"]["attempts"]
    assert block["reasons"] == ["gym_unavailable"]
    assert block["time_per_attempt_s"]["min"] >= deadline * 0.9  # each attempt waited out the deadline
    assert set(block["blocking_servers"]) & {"workplace_restart_only_agent", "python_sandbox"}
    assert best["committed"] == best["attempts"] == TINY["stall"]["attempts"]
    assert best["time_per_attempt_s"]["max"] < block["time_per_attempt_s"]["min"]
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
    assert set(rows) == {"none", "alternative", "controller_none", "best_effort"}
    assert res["config"]["interval_s"] < res["config"]["rollout_s_median"]  # shorter than a rollout
    assert rows["alternative"]["snapshots"]["min"] >= 1
    assert rows["alternative"]["retired_total"]["min"] > 0  # every snapshot cancels the rollouts in flight
    assert rows["best_effort"]["snapshots"]["min"] >= 1
    assert rows["best_effort"]["committed"]["min"] == rows["best_effort"]["snapshots"]["min"]
    assert rows["best_effort"]["retired_total"]["max"] == 0 and rows["none"]["retired_total"]["max"] == 0
    assert all(r["rollouts_per_min"]["median"] >= 0 for r in rows.values())
    c = res["comparison"]
    assert _finite(c["best_effort_vs_none"], c["alternative_vs_none"])


def check_overhead(res: dict[str, Any]) -> None:
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"none", "T3"}
    turn = res["config"]["typical_turn_s"]
    assert 0 < turn < 5
    assert rows["none"]["rollouts_per_min"]["median"] > 0
    assert math.isclose(rows["T3"]["interval_s"], 3 * turn, rel_tol=1e-2)
    assert _finite(rows["T3"]["overhead_pct"]["median"])


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
