"""Smoke test of ``examples/bench_recovery.py``: the tiniest configuration of every
measurement, in-process, against real runs; checks each result's structure and the
invariants the numbers must satisfy (not the numbers themselves).

Every measurement but the rejected-alternative baseline runs GRPO (``python -m
testkit.run_grpo``) through the shared run harness and reads the controller's own
snapshot records, so this is a chain of short real GRPO runs, one at a time.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import bench_recovery  # noqa: E402
from bench import (  # noqa: E402
    alternative,
    bookkeeping,
    overhead,
    relaunch,
    setup_check,
    snapshot_cost,
    stall,
    work_lost,
)
from bench import async_throughput, generation_recovery, gym_recovery, prefix_work_lost, recovery_scale, restore_io  # noqa: E402
from bench import deterministic_cost  # noqa: E402
from bench import replay_recovery  # noqa: E402
from bench.common import summary  # noqa: E402
from bench.plots import PLOTTERS, plot  # noqa: E402
from bench.presets import FULL, N8192, QUICK, TINY  # noqa: E402
from bench.presets import ASYNC_TINY, GYM_RECOVERY_SMOKE, PREFIX_TINY, RESTORE_IO, RESTORE_IO_SMOKE  # noqa: E402
from bench.presets import DETERMINISTIC_COST_SMOKE, GENERATION_RECOVERY_SMOKE  # noqa: E402
from nemo_rl.utils.startup_clock import PHASES  # noqa: E402

pytestmark = [pytest.mark.functional, pytest.mark.timeout(600)]
MODULES = (snapshot_cost, stall, work_lost, alternative, overhead, setup_check, relaunch, bookkeeping)


def _quiet(_: str) -> None:
    pass


def _finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@pytest.mark.parametrize("module", MODULES, ids=[m.NAME for m in MODULES])
def test_each_measurement_runs_and_keeps_its_invariants(module, tmp_path: Path) -> None:
    """One measurement at its tiniest (one test each: they are independent runs, and each keeps to the
    suite's time budget): its invariants, its table, its plot and its section of the report."""
    res = module.measure(workdir=tmp_path / module.NAME, log=_quiet, **TINY[module.NAME])
    CHECKS[module.NAME](res)
    assert res["name"] == module.NAME
    assert module.table(res).startswith("|")
    if module.NAME in PLOTTERS:
        assert plot(module.NAME, res, tmp_path).stat().st_size > 1000
    md = bench_recovery.render_markdown({module.NAME: res}, {
        "preset": "tiny", "command": "test", "machine": {}, "seconds": 0,
        "git": {"head": None, "modified_tracked_files": []}})
    assert "## " + module.TITLE in md
    assert (f"![{module.NAME}]" in md) == (module.NAME in PLOTTERS)  # snapshot_cost has one, bookkeeping none
    assert bench_recovery.goal_lines({module.NAME: res})  # every measurement states its goal
    if module is bookkeeping:
        assert any(line.startswith("8. trainer-checkpoint bookkeeping")
                   for line in bench_recovery.goal_lines({module.NAME: res}))


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
        assert snap["commit_mode"] == "staged"  # the default commit mode, as the controller recorded it
        assert snap["captured_bytes"] > 0  # the in-memory copies the staged cut took
        by_server = snap["captured_bytes_by_server"]
        assert isinstance(by_server, dict) and all(v >= 0 for v in by_server.values())
        assert sum(by_server.values()) <= snap["captured_bytes"]  # the total also holds the data plane
    memory = row["staged_memory"]
    assert memory["attempts"] == len(idle["attempts"]) + len(tool["attempts"])
    assert memory["total_peak_bytes"] == max(s["captured_bytes"] for s in idle["attempts"] + tool["attempts"])
    assert snapshot_cost.memory_table(res).count("| default | ") >= 1
    # every attempt of each run is counted by what became of it, and each kept one carries its class
    for kind, run in (("idle", idle), ("tool", tool)):
        c = row["attempt_counts"][kind]
        assert c["kept"] == len(run["attempts"]) == c["kept_steady"] + c["kept_burst"]
        assert c["attempts"] == run["all_attempts"] == c["committed"] + c["failed"] + c["superseded"]
        assert c["committed"] >= c["kept"] + c["committed_under_fill"]
        assert len(run["failed"]) == c["failed"] + c["superseded"]
        assert all(a["class"] in ("steady", "burst") for a in run["attempts"])
        assert all((a["class"] == "burst") == (a["burst_reason"] is not None) for a in run["attempts"])
    assert row["steady"]["pause_s"]["n"] >= 1  # each run waited for steady attempts
    assert row["steady"]["pause_s"]["n"] + row["burst"]["pause_s"]["n"] == row["pause_s"]["n"]
    assert row["steady"]["excess_s"]["n"] >= 1
    assert res["goal"]["basis"].startswith("steady")
    assert "| idle |" in snapshot_cost.attempts_table(res) and "| tool |" in snapshot_cost.attempts_table(res)
    # the controller's pause waited for the tool call still running when prepare began
    tool_s = res["config"]["tool_s"]
    for snap in tool["with_tool"]:
        assert 0 < snap["tool_left_s"] <= tool_s + 0.05
        assert snap["pause_s"] >= snap["tool_left_s"] - 0.05
        assert math.isclose(snap["excess_s"], snap["pause_s"] - snap["tool_left_s"])
    assert res["goal"]["pause_met"] is None  # N=512 is not part of the tiny run
    assert res["goal"]["growth_met"] is None  # nor N=2048
    assert res["goal"]["staged_over_blocking"]["met"] is None  # one variant, no commit_mode override


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
    assert set(rows) == {"none", "T3", "S1"}
    turn = res["config"]["typical_turn_s"]
    assert 0 < turn < 5
    assert rows["none"]["rollouts_per_min"]["median"] > 0
    assert math.isclose(rows["T3"]["interval_s"], 3 * turn, rel_tol=1e-2)
    assert rows["S1"]["interval_s"] == 1.0 and rows["S1"]["turns"] is None  # a fixed interval, not in turns
    for mode in ("T3", "S1"):
        assert _finite(rows[mode]["overhead_pct"]["median"])
        (run,) = rows[mode]["raw"]
        assert f"rollout_checkpointing.snapshot_attempt_interval_s={rows[mode]['interval_s']}" in run["command"]
    assert "every 1 s" in overhead.table(res)
    assert set(res["goal"]["fixed_interval_overhead_pct_median"]) == {"default/1s"}


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


def check_relaunch(res: dict[str, Any]) -> None:
    (rep,) = res["repeats"]
    assert not rep.get("error"), rep
    assert rep["stragglers"] == []  # both launches were reaped
    snap = rep["crash"]["snapshot"]
    assert snap["step"] >= 1 and snap["commit_mode"] != "ledger_only" and snap["saved"] > 0
    first, again = rep["first"], rep["relaunch"]
    assert first["resumed"] is False and again["resumed"] is True
    assert rep["restore"]["trainer_step"] >= 1 and rep["restore"]["restored_turn"] >= 1
    for rec in (first, again):
        phases = rec["phases_s"]
        assert set(phases) <= set(PHASES) and all(v >= 0 for v in phases.values())
        assert rec["to_first_dispatch_s"] > 0 and rec["seen_after_launch_s"] > 0
        assert math.isclose(sum(phases.values()), rec["to_first_dispatch_s"], abs_tol=0.01)  # marks rounded to ms
    assert set(again["phases_s"]) == set(PHASES)  # a resumed run passes every phase, trainer load included
    assert {"config", "ray", "gym", "model", "restore", "first_dispatch"} <= set(first["phases_s"])
    rows = {r["kind"]: r for r in res["rows"]}
    assert set(rows) == {"first", "relaunch"} and all(r["runs"] == 1 for r in rows.values())
    assert rows["relaunch"]["to_first_dispatch_s"]["median"] == again["to_first_dispatch_s"]
    g = res["goal"]
    assert g["median_s"] == again["to_first_dispatch_s"]
    assert g["met"] is (again["to_first_dispatch_s"] <= g["relaunch_to_first_dispatch_max_s"])
    assert g["every_relaunch_resumed"] is True and g["errors"] == []
    assert g["loadavg_1m_at_relaunch"]["median"] >= 0


def check_bookkeeping(res: dict[str, Any]) -> None:
    sizes = TINY["bookkeeping"]["sizes_mb"]
    assert [(r["size_mb"], r["mode"]) for r in res["results"]] == [(s, m) for s in sizes
                                                                    for m in ("trust", "full_verify")]
    for r in res["results"]:
        assert len(r["saves"]) == TINY["bookkeeping"]["saves"] and r["restore"]["step"] == len(r["saves"])
        assert all(s["bookkeeping_read"] == s["seal_read"] + s["prune_read"] for s in r["saves"])
    trust, full = res["results"][0]["saves"], res["results"][1]["saves"]
    assert max(s["bookkeeping_read"] for s in trust) < max(s["bookkeeping_read"] for s in full)  # kept steps reread
    assert res["goal"]["save_reads_own_bytes_at_most_once"] is True
    assert res["goal"]["prune_rereads_no_kept_step"] is True
    assert res["goal"]["restore_hashes_only_the_restored_step"] is True


CHECKS = {"snapshot_cost": check_snapshot_cost, "stall": check_stall, "work_lost": check_work_lost,
          "alternative": check_alternative, "overhead": check_overhead, "setup_check": check_setup,
          "relaunch": check_relaunch, "bookkeeping": check_bookkeeping}


def test_every_measurement_has_its_check() -> None:
    assert set(CHECKS) == {m.NAME for m in MODULES}
    assert "snapshot_cost" in PLOTTERS and "bookkeeping" not in PLOTTERS  # the report test relies on both kinds


def test_presets_list_all_measurements() -> None:
    for preset in (FULL, QUICK, TINY):
        assert set(preset) == {m.NAME for m in MODULES}
    assert (FULL["relaunch"]["repeats"], QUICK["relaunch"]["repeats"], TINY["relaunch"]["repeats"]) == (3, 1, 1)
    # issue 21's scale: both N on one replica, both commit modes, and the bookkeeping rows
    assert set(N8192) == {"snapshot_cost", "bookkeeping"}
    cost = N8192["snapshot_cost"]
    assert cost["sizes"] == [2048, 8192] and cost["per_replica"] >= max(cost["sizes"])
    assert set(snapshot_cost.commit_modes(cost["variants"]).values()) == {"staged", "blocking"}
    assert N8192["bookkeeping"]["sizes_mb"] == [10, 100, 1024] and N8192["bookkeeping"]["keep"] == 3


def test_plan_of_the_command_line() -> None:
    name, preset, chosen = bench_recovery.plan(bench_recovery.parse_args(["--preset", "n8192"]))
    assert (name, chosen) == ("n8192", ["snapshot_cost", "bookkeeping"])
    _, preset, chosen = bench_recovery.plan(bench_recovery.parse_args(
        ["--only", "snapshot_cost", "--sizes", "2048,8192", "--per-replica", "8192", "--repeats", "2"]))
    assert chosen == ["snapshot_cost"]
    assert {k: preset["snapshot_cost"][k] for k in ("sizes", "per_replica", "repeats")} == {
        "sizes": [2048, 8192], "per_replica": 8192, "repeats": 2}
    for argv, names in ((["--preset", "n8192", "--only", "stall"], "stall"), (["--per-replica", "0"], "--per-replica"),
                        (["--only", "nope"], "nope"), (["--sizes", "8,x"], "--sizes")):
        with pytest.raises(ValueError, match=names):
            bench_recovery.plan(bench_recovery.parse_args(argv))


def test_attempt_classes_burst_then_steady() -> None:
    def snap(step: int, committed: bool, not_admitted: int = 0, reason: str = "committed") -> dict[str, Any]:
        return {"step": step, "committed": committed, "not_admitted": not_admitted, "saved": 10,
                "reason": reason if not committed else "committed"}

    records = [snap(0, False, reason="gym_unavailable"), snap(0, True), snap(0, True, not_admitted=5),
               snap(0, True), snap(0, False, reason="timeout"), snap(0, False, reason="gym_unavailable"), snap(0, True),
               snap(1, True), snap(1, True, not_admitted=1), snap(2, True)]
    assert snapshot_cost.attempt_classes(records) == [
        ("burst", "gym_unavailable"),
        ("burst", "before_not_admitted"),  # a later attempt of step 0 still found rollouts Gym never saw
        ("burst", "not_admitted"),
        ("steady", None), ("steady", None),
        ("burst", "gym_unavailable"),  # a failure does not reclassify the attempts before it
        ("steady", None),
        ("burst", "before_not_admitted"), ("burst", "not_admitted"),
        ("steady", None),  # another step: its own ramp
    ]


def test_goals_use_steady_attempts() -> None:
    def row(n: int, steady_ms: float, all_ms: float, excess_ms: float | None = None) -> dict[str, Any]:
        r = _cost_row("staged", n, all_ms, excess_ms=None if excess_ms is None else excess_ms * 10)
        r["steady"] = {"pause_s": summary([steady_ms / 1e3])}
        if excess_ms is not None:
            r["steady"]["excess_s"] = summary([excess_ms / 1e3])
        r["burst"] = {"pause_s": summary([all_ms / 1e3])}
        return r

    rows = [row(512, 20, 25, excess_ms=19), row(2048, 40, 3000), row(8192, 170, 1300, excess_ms=90)]
    g = snapshot_cost.goal_of(rows, [("staged", [])])
    assert g["basis"].startswith("steady")
    assert g["pause_met"] is True and g["by_variant"]["staged"]["disk"]["excess_ms_median"] == 19
    assert math.isclose(g["by_variant"]["staged"]["growth"]["ratio"], 2.0) and g["growth_met"] is True
    large = g["by_variant"]["staged"]["large"]
    assert math.isclose(large["growth"]["ratio"], 4.25) and g["large_growth_met"] is True
    assert large["disk"]["excess_ms_median"] == 90 and g["large_pause_met"] is True
    rows[2]["steady"]["pause_s"] = summary([200 / 1e3])
    rows[2]["steady"]["excess_s"] = summary([120 / 1e3])
    g = snapshot_cost.goal_of(rows, [("staged", [])])
    assert g["large_growth_met"] is False and g["large_pause_met"] is False  # x5; 120 ms > 100 ms
    rows[2]["steady"] = {"pause_s": summary([])}  # no steady attempt at 8192: not measured, not all kept
    assert snapshot_cost.goal_of(rows, [("staged", [])])["large_growth_met"] is None


def _cost_row(variant: str, n: int, pause_ms: float, excess_ms: float | None = None) -> dict[str, Any]:
    row = {"variant": variant, "n": n, "storage": "disk", "pause_s": summary([pause_ms / 1e3])}
    if excess_ms is not None:
        row["excess_s"] = summary([excess_ms / 1e3])
    return row


def test_snapshot_cost_goals_from_rows() -> None:
    # labels that say the opposite of their overrides: the commit mode is read from the override
    variants = [("blocking", ["rollout_checkpointing.commit_mode=staged"]),
                ("staged", ["grpo.seed=1", "rollout_checkpointing.commit_mode=blocking"])]
    rows = [_cost_row("blocking", 512, 100, excess_ms=40), _cost_row("blocking", 2048, 440),
            _cost_row("staged", 512, 200, excess_ms=60), _cost_row("staged", 2048, 1000)]
    g = snapshot_cost.goal_of(rows, variants)
    assert g["by_variant"]["blocking"]["disk"]["met"] is True  # 40 ms <= 50 ms
    assert g["by_variant"]["staged"]["disk"]["met"] is False  # 60 ms > 50 ms
    assert math.isclose(g["by_variant"]["blocking"]["growth"]["ratio"], 4.4)
    assert g["by_variant"]["blocking"]["growth"]["met"] is True
    assert g["by_variant"]["staged"]["growth"]["met"] is False  # x5
    sb = g["staged_over_blocking"]
    assert (sb["staged"], sb["blocking"]) == ("blocking", "staged")
    assert math.isclose(sb["ratio"], 0.44) and sb["met"] is False
    rows[1] = _cost_row("blocking", 2048, 250)
    sb = snapshot_cost.goal_of(rows, [{"label": v[0], "overrides": v[1]} for v in variants])["staged_over_blocking"]
    assert math.isclose(sb["ratio"], 0.25) and sb["met"] is True
    assert snapshot_cost.goal_of(rows, [("a", []), ("b", [])])["staged_over_blocking"]["met"] is None


def test_staged_memory_per_participant() -> None:
    attempts = [
        {"commit_mode": "staged", "in_flight": 10, "captured_bytes": 2000,
         "captured_bytes_by_server": {"nemo_gym/replica-0/agent": 300, "nemo_gym/replica-1/agent": 500,
                                      "nemo_gym/replica-0/workplace": 100}},
        {"commit_mode": "staged", "in_flight": 20, "captured_bytes": 3000,
         "captured_bytes_by_server": {"nemo_gym/replica-0/agent": 400, "nemo_gym/replica-1/agent": 400,
                                      "nemo_gym/replica-0/workplace": 900}},
        {"commit_mode": "staged", "in_flight": 20, "captured_bytes": 5000},  # a controller without the field
        {"commit_mode": "blocking", "in_flight": 20, "captured_bytes": 0, "captured_bytes_by_server": {}},
    ]
    m = snapshot_cost.staged_memory(attempts)
    assert m["attempts"] == 3 and m["attempts_with_participants"] == 2
    agent, workplace = m["participants"]["agent"], m["participants"]["workplace"]
    assert agent["peak_bytes"] == 500 and agent["bytes"]["values"] == [400, 500]  # replicas by max
    assert agent["bytes_per_rollout"]["values"] == [40, 80]  # every replica over the rollouts in flight
    assert workplace["peak_bytes"] == 900
    assert m["total_peak_bytes"] == 5000
    assert m["controller_bytes"]["values"] == [1100, 1300]  # total minus the participants
    assert snapshot_cost.staged_memory(attempts[3:]) is None  # blocking only: no staged copies


@pytest.mark.alone  # CPU-bound (training, decoding): shares no core under xdist
def test_async_throughput_runs_and_keeps_its_invariants(tmp_path: Path, embedded_model_cache: Path) -> None:
    """Measurement 9 on its own (real model and trainer, so not in the chain above): 4 throughput runs of
    the main job (sync and async, snapshots off and every 1 s) and its two learning runs, all shortened."""
    params = ASYNC_TINY["async_throughput"]
    # A short warm start in the session's cache: a fresh machine (CI) has no cached embedded model.
    cache = ["policy.warm_start.steps=30", f"policy.cache_dir={embedded_model_cache}"]
    res = async_throughput.measure(workdir=tmp_path / "async", log=_quiet, **{
        **params, "overrides": [*params.get("overrides", []), *cache],
        "learning_overrides": [*params["learning_overrides"], *cache]})
    assert res["name"] == async_throughput.NAME
    runs = {(w["mode"], w["snapshots"]): w for w in res["runs"]}
    assert set(runs) == {(m, s) for m in ("sync", "async") for s in ("off", "1s")}
    for (mode, snaps), w in runs.items():
        assert w["stragglers"] == []  # the harness reaped every run
        assert w["steps"] == params["steps"] and w["measured_steps"] == params["steps"] - 1  # step 1 left out
        assert w["steps_per_hour"] > 0 and 0 < w["training_share"] < 1 and 0 <= w["waiting_share"] < 1
        assert 0.0 <= w["coverage"] <= 1.0
        assert "--config" not in w["command"]  # the embedded default main job
        assert "grpo.use_generation_logprobs=true" in w["command"]  # in both modes: only the lookahead differs
        lookahead = 1 if mode == "async" else 0
        assert f"async_rl.sampler.max_lookahead_versions={lookahead}" in w["command"]
        assert w["max_group_version_lag"] <= lookahead and w["max_weight_version_lag"] <= lookahead
        if snaps == "off":
            assert w["attempts"] == 0 and "snapshot_attempt_interval_s=null" in w["command"]
        else:
            assert "rollout_checkpointing.snapshot_attempt_interval_s=1.0" in w["command"]
            assert w["committed"] <= w["attempts"] and len(w["pauses_s"]) <= w["attempts"]
    assert "async_rl.min_groups_for_streaming_train=1" in runs[("async", "off")]["command"]  # half of 2 groups
    rows = {(r["mode"], r["snapshots"]): r for r in res["rows"]}
    assert rows[("sync", "off")]["speedup_vs_sync"] is None and rows[("sync", "off")]["overhead_pct"] is None
    for snaps in ("off", "1s"):
        s = rows[("async", snaps)]["speedup_vs_sync"]
        assert math.isclose(s["median"], runs[("async", snaps)]["steps_per_hour"]
                            / runs[("sync", snaps)]["steps_per_hour"])
    for mode in ("sync", "async"):
        assert rows[(mode, "off")]["held_pct"] is None and 0 <= rows[(mode, "1s")]["held_pct"]["median"] < 100
        o = rows[(mode, "1s")]["overhead_pct"]["median"]
        assert math.isclose(o, 100 * (1 - runs[(mode, "1s")]["steps_per_hour"] / runs[(mode, "off")]["steps_per_hour"]))
    learn = {w["mode"]: w for w in res["learning"]}
    assert set(learn) == {"sync", "async"}
    assert "async_rl.sampler.max_lookahead_versions" not in learn["sync"]["command"]  # the main job as shipped
    assert "async_rl.sampler.max_lookahead_versions=1" in learn["async"]["command"]
    for w in learn.values():
        assert w["steps"] == params["learning_steps"] == len(w["rewards"]) and w["stragglers"] == []
        assert math.isclose(w["reward_gain"], w["reward_last_fifth"] - w["reward_first_fifth"])
        assert w["wall_s"] > w["sum_step_s"] > 0  # the process also starts Ray, Gym and the model
    g = res["goal"]
    assert g["at_interval"] == "1s" and g["default"] in ("synchronous", "lookahead 1")
    assert (g["default"] == "lookahead 1") == (not g["default_reasons"])
    assert set(g["reward_gain"]) == {"sync", "async"} and _finite(g["speedup_median"], g["async_overhead_pct_median"])
    table = async_throughput.table(res)
    assert table.startswith("**Part 1") and "| async | 1 s |" in table and "**Part 2" in table
    assert plot(async_throughput.NAME, res, tmp_path).stat().st_size > 1000
    assert any(line.startswith("9. Goals with snapshots every 1 s") for line in bench_recovery.goal_lines({async_throughput.NAME: res}))


@pytest.mark.alone  # CPU-bound (training, decoding): shares no core under xdist
def test_prefix_work_lost_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    """Measurement 10 on its own (the torch worker, not the scripted backend): one crash, one pause size."""
    params = PREFIX_TINY["prefix_work_lost"]
    res = prefix_work_lost.measure(workdir=tmp_path, log=_quiet, **params)
    assert res["name"] == prefix_work_lost.NAME and len(res["crashes"]) == params["crashes"]
    for crash in res["crashes"]:
        assert crash["problems"] == []  # every restored call continued its cut: prefix + tail, max_tokens in all
        assert crash["cuts"] >= 2 and crash["interval_tokens"] > 0
        assert len(crash["lost_prefix"]) == len(crash["lost_turn"]) == params["calls"]
        # a restored call never regenerates more at prefix than at turn, and at turn it redoes everything
        assert all(0 <= p <= t for p, t in zip(crash["lost_prefix"], crash["lost_turn"]))
        assert max(crash["lost_turn"]) > 0
    (pause,) = res["pauses"]
    assert pause["calls"] == params["pause_calls"][0] and pause["cut_ms"]["n"] == params["repeats"]
    assert pause["tokens"]["min"] >= params["pause_tokens"] * pause["calls"]
    assert _finite(pause["cut_ms"]["median"], pause["fetch_ms"]["median"])
    assert res["goal"]["pause_met"] is None  # no N = 512 in the smoke configuration
    assert "prefix" in prefix_work_lost.table(res) and plot(prefix_work_lost.NAME, res, tmp_path).exists()


def test_gym_recovery_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    """Measurement 14 at its smallest: one server loss and one replica loss, each run going on by itself."""
    res = gym_recovery.measure(workdir=tmp_path, log=_quiet, **GYM_RECOVERY_SMOKE["gym_recovery"])
    assert [r["kind"] for r in res["repeats"]] == ["server", "replica"]
    for run in res["repeats"]:
        assert not run.get("error") and run["returncode"] == 0 and run["seconds_to_redispatch"] is not None, run
        assert run["action"] == ("restarted" if run["kind"] == "server" else "replaced"), run
        assert run["seconds_to_start"] is not None and run["seconds_to_start"] <= run["seconds_to_redispatch"]
        assert run["continued"] >= 1 and run["per_rollout"], run
        assert all(0 <= p["kept"] <= p["made"] for p in run["per_rollout"]), run
        assert _finite(run["other_calls_per_s_before"])
    assert res["goal"]["met"] is True, res["goal"]
    assert gym_recovery.table(res).startswith("|")
    assert any(line.startswith("14. ") for line in bench_recovery.goal_lines({gym_recovery.NAME: res}))


def test_recovery_scale_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    """Measurement 18 at its smallest: one replica lost with rollouts in flight, stopped once its row is written;
    every affected rollout's lost turns are counted against what the restored snapshot kept."""
    from bench.presets import RECOVERY_SCALE_SMOKE

    res = recovery_scale.measure(workdir=tmp_path, log=_quiet, **RECOVERY_SCALE_SMOKE["recovery_scale"])
    [run] = res["repeats"]
    assert not run.get("error") and run["seconds_to_redispatch"] is not None, run
    assert run["action"] == "replaced" and run["snapshot_age_s"] is not None and run["snapshot_age_s"] >= 0, run
    assert run["affected"] == run["continued"] + run["restarted_from_prompt"] >= 1, run
    assert all(x >= 0 for x in run["lost_turns"]), run
    assert res["goal"]["met"] is True, res["goal"]
    assert recovery_scale.table(res).startswith("|")
    assert any(line.startswith("18. ") for line in bench_recovery.goal_lines({recovery_scale.NAME: res}))


def test_replay_recovery_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    """Measurement 19 at its smallest: each arm killed once at its holds and relaunched; replay generates no
    finished turn again, a restart from the prompt generates each again; the snapshots with every rollout held
    hold their calls with records, none without; the capture table."""
    from bench.presets import REPLAY_RECOVERY_SMOKE

    params = REPLAY_RECOVERY_SMOKE["replay_recovery"]
    res = replay_recovery.measure(workdir=tmp_path, log=_quiet, **params)
    runs = {r["arm"]: r for r in res["repeats"]}
    assert set(runs) == {"replay", "restart"} and not any(r.get("error") for r in runs.values()), runs
    held = params["prompts"] * params["generations"]
    replay, restart = runs["replay"], runs["restart"]
    assert (replay["restored_replay"], replay["restarted_from_prompt"]) == (held, 0), replay
    assert restart["restored_replay"] == 0 and restart["restarted_from_prompt"] == held, restart
    for run in (replay, restart):
        assert len(run["rollouts"]) == held and all(x["finished"] == 2 for x in run["rollouts"]), run
        assert all(x["to_first_live_s"] is not None and x["to_first_live_s"] >= 0 for x in run["rollouts"]), run
    assert all(x["regenerated"] == 0 for x in replay["rollouts"]), replay["rollouts"]
    assert all(x["regenerated"] == 2 for x in restart["rollouts"]), restart["rollouts"]
    pauses = {r["arm"]: r for r in res["pause_rows"]}  # the snapshots the killed runs took at their holds
    assert all(r["snapshots"] == params["snapshots_after_hold"] for r in pauses.values()), pauses
    assert pauses["replay"]["recorded_calls"]["min"] == held * 2, pauses["replay"]
    assert pauses["restart"]["recorded_calls"]["max"] == 0, pauses["restart"]
    assert pauses["replay"]["model_bytes"]["median"] > pauses["restart"]["model_bytes"]["median"], pauses
    assert pauses["replay"]["added_bytes_per_turn"] > 0, pauses["replay"]
    assert {r["record_calls"] for r in res["micro"]["results"]} == {False, True}
    assert res["goal"]["complete"] is True and res["goal"]["replay_regenerated_max"] == 0, res["goal"]
    assert replay_recovery.table(res).startswith("|")
    assert any(line.startswith("19. ") for line in bench_recovery.goal_lines({replay_recovery.NAME: res}))


@pytest.mark.alone  # CPU-bound: the real trainer and the torch worker
def test_generation_recovery_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    """Measurement 16 at its smallest: one prefix-level run whose worker is killed goes on by itself, its calls
    sent again continue from cuts of themselves, and nothing goes back to its prompt. The run's torch worker
    holds each batch mid-decode until snapshots pinned its calls (the decode hold), so calls are in flight at
    the loss however fast the machine decodes 96 tokens."""
    from tests.functional.test_prefix_recovery import assert_held, hold_env_kw

    res = generation_recovery.measure(workdir=tmp_path, log=_quiet, run_env_kw=hold_env_kw(),
                                      **GENERATION_RECOVERY_SMOKE["generation_recovery"])
    assert_held(tmp_path / "prefix-0" / "logs")
    (run,) = res["repeats"]
    assert not run.get("error") and run["returncode"] == 0, run
    assert run["seconds_to_start"] <= run["seconds_to_redispatch"], run
    assert run["calls_resent"] >= run["calls_continued_from_cut"] > 0 and run["tokens_kept"] > 0, run
    assert run["per_call"] and all(p["kept"] > 0 and p["tail"] >= 0 for p in run["per_call"]), run
    assert res["goal"]["met"] is True, res["goal"]
    assert generation_recovery.table(res).startswith("|")
    assert any(line.startswith("16. ") for line in bench_recovery.goal_lines({generation_recovery.NAME: res}))


@pytest.mark.alone  # CPU-bound: the real trainer and the torch worker
def test_restore_io_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    """Measurement 15 with a 1 MB model: the relaunch read each state file of the restored step twice (the
    lookup's hash, one load) and shipped the weights to generation once, counted from outside the run."""
    res = restore_io.measure(workdir=tmp_path, log=_quiet, **RESTORE_IO_SMOKE["restore_io"])
    assert res["name"] == restore_io.NAME
    (rep,) = res["repeats"]
    assert not rep.get("error"), rep
    assert rep["stragglers"] == [] and rep["crash"]["snapshot"]["step"] >= 1
    assert rep["first"]["resumed"] is False and rep["relaunch"]["resumed"] is True
    assert set(rep["relaunch"]["phases_s"]) == set(PHASES)  # the trainer load included
    files = rep["reads"]["files"]
    step = rep["restored_step"]
    weights = rep["reads"]["weights_bytes"]
    assert weights == res["model"]["weights_bytes"] and files[f"{step}/model.safetensors"]["opens"] == 2
    assert {files[f"{step}/{name}"]["opens"] for name in ("optimizer.pt", "reference.pt", "rng.pt")} == {2}
    assert files[f"{step}/optimizer.pt"]["size"] > weights  # Adam's two moments: a real step was saved
    assert rep["reads"]["other_steps_read_bytes"] == 0
    shipped = rep["shipped"]
    assert [e["event"] for e in shipped["events"]] == ["construct"] and shipped["bytes"] > weights * 0.9
    assert rep["rchar"]["driver"] > 0 and rep["loadavg_1m_at_relaunch"] >= 0
    g = res["goal"]
    assert g["reads_met"] is True and g["ships_met"] is True and (g["most_reads"], g["most_ships"]) == (2, 1)
    assert g["every_relaunch_resumed"] is True and g["errors"] == []
    table = restore_io.table(res)
    assert table.startswith("|") and "load average at relaunch" in table
    md = bench_recovery.render_markdown({restore_io.NAME: res}, {
        "preset": "restore_io_smoke", "command": "test", "machine": {}, "seconds": 0,
        "git": {"head": None, "modified_tracked_files": []}})
    assert "## " + restore_io.TITLE in md
    assert any(line.startswith("15. a relaunch reads") for line in bench_recovery.goal_lines({restore_io.NAME: res}))
    assert RESTORE_IO["restore_io"]["model_mb"] == 1024  # the measurement itself: a model of about 1 GB


def test_product_flag_sets_the_checkout_of_restore_io() -> None:
    _, preset, chosen = bench_recovery.plan(bench_recovery.parse_args(
        ["--preset", "restore_io", "--product", "/tmp/before"]))
    assert chosen == ["restore_io"] and preset["restore_io"]["product"] == "/tmp/before"
    with pytest.raises(ValueError, match="--product"):
        bench_recovery.plan(bench_recovery.parse_args(["--preset", "n8192", "--product", "/tmp/before"]))


@pytest.mark.alone  # CPU-bound: the real trainer and the torch worker
def test_deterministic_cost_runs_and_keeps_its_invariants(tmp_path: Path) -> None:
    """Measurement 17 at its smallest: one pair of 2-step main-job runs, deterministic mode off and on; both
    finish, both rates are finite, only the deterministic run records what each step trained, and the table
    prints the load average beside the rates."""
    params = dict(DETERMINISTIC_COST_SMOKE["deterministic_cost"])
    params["overrides"] = (*params["overrides"], f"policy.cache_dir={tmp_path / 'model_cache'}")
    res = deterministic_cost.measure(workdir=tmp_path / "runs", log=_quiet, **params)
    assert res["name"] == deterministic_cost.NAME
    by_mode = {w["mode"]: w for w in res["runs"]}
    assert set(by_mode) == {"off", "on"}
    for mode, run in by_mode.items():
        assert run["measured_steps"] == 1 and _finite(run["steps_per_hour"], run["mean_step_s"]), run
        assert len(run["loadavg_1m"]) == 2 and not run["stragglers"], run
    assert by_mode["on"]["trained_records"] == 2 and by_mode["off"]["trained_records"] == 0
    assert res["goal"]["pct"]["n"] == 1
    table = deterministic_cost.table(res)
    assert "1-min load average" in table and "| on |" in table and "| off |" in table
    assert any(line.startswith("17. Deterministic mode costs") for line in
               bench_recovery.goal_lines({deterministic_cost.NAME: res}))
