"""Measurement 9: asynchronous GRPO (lookahead 1) against synchronous, on the main job itself.

Unlike measurements 1-7 this is not the control plane in isolation: every run is
the embedded default main job (no ``--config``: Workplace + simple_agent Gym on
loopback, the tiny Hugging Face model from its cached warm start, the torch
generation worker, the real ``GRPOTrainer``), started and reaped through the run
harness (``python -m testkit.run_grpo``, the product's main with no test variable
set) with config overrides only. Nothing is on the runs' ``PYTHONPATH``: the
figures come from what the run records, ``metrics.jsonl`` (``step_s``,
``training_s``, ``generation_s``, ``snapshot_coverage``, the lags, ``reward_mean``)
and ``snapshots.jsonl`` (``pause_s``, ``committed``).

Part 1, throughput. Modes, interleaved per repeat (the order reversed on odd
repeats, so a drift in the machine's load does not favour one mode): sync
(``async_rl.sampler.max_lookahead_versions=0``) and async (lookahead 1,
``async_rl.min_groups_for_streaming_train`` = half the step's groups), both with
``grpo.use_generation_logprobs=true`` so the lookahead is the only difference,
each with snapshots off (``snapshot_attempt_interval_s=null``) and every T
seconds (default: the main job's own interval, and 2 s). ``grpo.val_period=0``.
Steps per hour = 3600 x steps / sum of ``step_s`` over steps 2..N (step 1 has no
overlap and carries startup effects); snapshot overhead = 1 - rate(on) /
rate(off) of the same repeat and mode; speedup = rate(async) / rate(sync) of the
same repeat and snapshot setting; coverage = the last row's
``snapshot_coverage``.

Part 2, learning: the main job as shipped (``python examples/run_grpo.py``, its
default steps) and the same plus the async overrides, one run each: reward of the
first fifth against the last fifth of steps (as the main job's own summary
computes it), and wall time.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from bench.common import Log, fmt, fresh_dir, make_log, md_table, summary
from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.algorithms.single_controller_utils.config import DEFAULT_CONFIG
from testkit.run_harness import RunDirs, new_marker, read_jsonl, run_env, run_once

NAME = "async_throughput"
TITLE = "9. Async (lookahead 1) against sync on the main job: steps per hour, snapshot overhead, coverage, learning"
MAIN_JOB_INTERVAL_S: float = DEFAULT_CONFIG["rollout_checkpointing"]["snapshot_attempt_interval_s"]
MAIN_JOB_STEPS: int = DEFAULT_CONFIG["grpo"]["max_num_steps"]
MODES = ("sync", "async")


def mode_overrides(mode: str, prompts: int) -> list[str]:
    """What makes a run sync or async; ``prompts`` is the step's group count (streaming starts at half)."""
    if mode == "sync":
        return ["async_rl.sampler.max_lookahead_versions=0"]
    if mode == "async":
        return ["async_rl.sampler.max_lookahead_versions=1", "grpo.use_generation_logprobs=true",
                f"async_rl.min_groups_for_streaming_train={max(1, prompts // 2)}"]
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


def snap_key(interval_s: float | None) -> str:
    return "off" if interval_s is None else f"{interval_s:g}s"


def measure(*, repeats: int, workdir: Path, steps: int = 16, intervals: tuple[float, ...] | None = None,
            prompts: int | None = None, generations: int | None = None, micro_batch: int | None = None,
            overrides: list[str] | None = None, learning: bool = True, learning_steps: int | None = None,
            learning_overrides: list[str] | None = None, goal_speedup: float = 1.3, goal_overhead_pct: float = 3.0,
            goal_coverage: float = 0.99, goal_reward_gain: float = 0.2, timeout_s: float = 900.0,
            learning_timeout_s: float = 1800.0, log: Log | None = None) -> dict[str, Any]:
    log = log or make_log(NAME)
    if steps < 2:
        raise ValueError(f"async_throughput steps={steps}: at least 2 (steps 2..N are measured)")
    intervals = tuple(intervals) if intervals is not None else (MAIN_JOB_INTERVAL_S, 2.0)
    snaps: list[float | None] = [None, *intervals]
    shape = [*([f"grpo.num_prompts_per_step={prompts}"] if prompts else []),
             *([f"grpo.num_generations_per_prompt={generations}"] if generations else []),
             *([f"policy.train_micro_batch_size={micro_batch}"] if micro_batch else []), *(overrides or [])]
    groups = _groups_in(shape, groups_default())
    base = [f"grpo.max_num_steps={steps}", "grpo.val_period=0", *shape]
    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        order = [(m, t) for t in snaps for m in (MODES if r % 2 == 0 else MODES[::-1])]
        for mode, interval in order:
            # sync uses the generation logprobs too, so the lookahead is the only difference
            over = [*base, *(["grpo.use_generation_logprobs=true"] if mode == "sync" else []),
                    *mode_overrides(mode, groups),
                    f"rollout_checkpointing.snapshot_attempt_interval_s={'null' if interval is None else interval}"]
            root = Path(workdir) / f"{NAME}-{mode}-{snap_key(interval)}-{r}"
            run = main_job_run(root, over, timeout_s)
            w = {"repeat": r, "mode": mode, "snapshots": snap_key(interval), "interval_s": interval,
                 **throughput_of(run)}
            runs.append(w)
            log(f"repeat {r + 1}/{repeats} {mode:5s} snapshots {w['snapshots']:>4s}: {w['steps_per_hour']:,.0f} "
                f"steps/h (step {w['mean_step_s']:.2f} s, training {w['training_share'] * 100:.0f}%), coverage "
                f"{w['coverage'] * 100:.1f}%, {w['committed']}/{w['attempts']} snapshots committed, lag "
                f"{w['max_group_version_lag']}/{w['max_weight_version_lag']:g} (load {w['loadavg_1m'][0]:.2f})")
    rows = rows_of(runs, snaps)
    learn: list[dict[str, Any]] = []
    if learning:
        for mode in MODES:
            over = [*([f"grpo.max_num_steps={learning_steps}"] if learning_steps else []), *(learning_overrides or []),
                    *([] if mode == "sync" else mode_overrides(mode, _groups_in(learning_overrides, groups_default())))]
            run = main_job_run(Path(workdir) / f"{NAME}-learning-{mode}", over, learning_timeout_s)
            learn.append({"mode": mode, **learning_of(run)})
            w = learn[-1]
            log(f"learning {mode:5s}: {w['steps']} steps, reward {w['reward_first_fifth']:.3f} -> "
                f"{w['reward_last_fifth']:.3f} ({w['reward_gain']:+.3f}) in {w['wall_s']:.0f} s "
                f"(load {w['loadavg_1m'][0]:.2f})")
    goal = goal_of(rows, runs, learn, intervals, goal_speedup=goal_speedup, goal_overhead_pct=goal_overhead_pct,
                   goal_coverage=goal_coverage, goal_reward_gain=goal_reward_gain)
    return {"name": NAME, "title": TITLE, "rows": rows, "runs": runs, "learning": learn, "goal": goal,
            "config": {"repeats": repeats, "steps": steps, "intervals_s": list(intervals), "prompts": prompts,
                       "generations": generations, "micro_batch": micro_batch, "overrides": list(overrides or []),
                       "shape_overrides": shape, "base_overrides": base,
                       "mode_overrides": {m: mode_overrides(m, groups) for m in MODES},
                       "learning_steps": learning_steps or MAIN_JOB_STEPS,
                       "learning_overrides": list(learning_overrides or []),
                       "main_job_interval_s": MAIN_JOB_INTERVAL_S,
                       "setup": "embedded default main job (Workplace + simple_agent, tiny HF model, torch "
                                "generation worker, GRPOTrainer), config overrides only"}}


def groups_default() -> int:
    """The main job's groups per step (its own value, else the schema's)."""
    return int(DEFAULT_CONFIG["grpo"].get("num_prompts_per_step", GRPOConfig().num_prompts_per_step))


def _groups_in(overrides: list[str] | None, default: int) -> int:
    """The step's group count an override list sets (the last one wins), else ``default``."""
    for o in reversed(overrides or []):
        if o.startswith("grpo.num_prompts_per_step="):
            return int(o.split("=", 1)[1])
    return default


# -- one run -----------------------------------------------------------------------------------------
def main_job_run(root: Path, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """One main-job process (embedded default + ``overrides``) to its end; every process of it is gone
    when this returns. Raises naming the run's output if it did not finish."""
    root = fresh_dir(Path(root))
    dirs = RunDirs(root)
    args = [*dirs.overrides(), "logger.plot=false", *overrides]
    load_before = os.getloadavg()[0]
    outcome = run_once(args, env=run_env(marker=new_marker()), stdout_path=root / "run.out",
                       stderr_path=root / "run.out", timeout_s=timeout_s)
    command = " ".join(["python", "examples/run_grpo.py", *args])
    if outcome.returncode != 0 or outcome.killed_by:
        why = f"stopped after {timeout_s:g} s" if outcome.killed_by == "timeout" else f"exited {outcome.returncode}"
        raise RuntimeError(f"{NAME}: main job run {why}; see {root / 'run.out'}:\n{outcome.tail()}")
    return {"command": command, "wall_s": outcome.wall_s, "stragglers": list(outcome.leftover),
            "loadavg_1m": [load_before, os.getloadavg()[0]],
            "metrics": [m for m in dirs.records("metrics.jsonl") if m.get("step", 0) >= 1 and "reward_mean" in m],
            "snapshot_records": read_jsonl(dirs.logs / "snapshots.jsonl")}


def throughput_of(run: dict[str, Any]) -> dict[str, Any]:
    """Steps/hour and shares over steps 2..N, coverage at the end, lags, snapshots, reward."""
    metrics = run["metrics"]
    later = [m for m in metrics if m["step"] >= 2]
    if not later:
        raise RuntimeError(f"{NAME}: no step after the first in metrics.jsonl of `{run['command']}`")
    step_s = sum(float(m["step_s"]) for m in later)
    snaps = run["snapshot_records"]
    return {
        "command": run["command"], "wall_s": run["wall_s"], "loadavg_1m": run["loadavg_1m"],
        "stragglers": run["stragglers"], "steps": len(metrics), "measured_steps": len(later),
        "steps_per_hour": 3600.0 * len(later) / step_s if step_s > 0 else None,
        "mean_step_s": step_s / len(later),
        "training_share": sum(float(m.get("training_s", 0)) for m in later) / step_s,
        "waiting_share": sum(float(m.get("generation_s", 0)) for m in later) / step_s,
        "refit_s_mean": statistics.fmean(float(m.get("refit_s", 0)) for m in later),
        "checkpoint_s_mean": statistics.fmean(float(m.get("checkpoint_s", 0)) for m in later),
        "coverage": float(metrics[-1]["snapshot_coverage"]),
        "max_group_version_lag": max(int(m.get("max_group_version_lag", 0)) for m in metrics),
        "max_weight_version_lag": max(float(m.get("max_weight_version_lag", 0)) for m in metrics),
        "inflight_at_step_end_mean": statistics.fmean(float(m.get("inflight_rollouts", 0)) for m in later),
        "reward_mean": statistics.fmean(float(m["reward_mean"]) for m in metrics),
        "attempts": len(snaps), "committed": sum(1 for s in snaps if s.get("committed")),
        "pauses_s": [float(s["pause_s"]) for s in snaps if s.get("pause_s") is not None],
        "per_step": [{k: m.get(k) for k in ("step", "step_s", "generation_s", "training_s", "refit_s", "checkpoint_s",
                                             "inflight_rollouts", "max_group_version_lag", "max_weight_version_lag",
                                             "snapshot_coverage", "reward_mean")} for m in metrics],
    }


def learning_of(run: dict[str, Any]) -> dict[str, Any]:
    """Reward of the first fifth against the last fifth of steps (the main job's own summary), wall time."""
    metrics = run["metrics"]
    n = len(metrics)
    fifth = max(1, n // 5)
    rewards = [float(m["reward_mean"]) for m in metrics]
    first = sum(rewards[:fifth]) / fifth if n else 0.0
    last = sum(rewards[-fifth:]) / fifth if n else 0.0
    vals = [(m["step"], m["val_reward_mean"]) for m in metrics if m.get("val_reward_mean") is not None]
    step_s = sum(float(m.get("step_s", 0)) for m in metrics)
    return {"command": run["command"], "wall_s": run["wall_s"], "loadavg_1m": run["loadavg_1m"],
            "stragglers": run["stragglers"], "steps": n, "fifth": fifth, "reward_first_fifth": first,
            "reward_last_fifth": last, "reward_gain": last - first, "rewards": rewards, "val_rewards": vals,
            "sum_step_s": step_s, "steps_per_hour": 3600.0 * n / step_s if step_s else None,
            "coverage": float(metrics[-1]["snapshot_coverage"]) if metrics else None,
            "max_weight_version_lag": max((float(m.get("max_weight_version_lag", 0)) for m in metrics), default=0.0),
            "snapshots_committed": len([s for s in run["snapshot_records"] if s.get("committed")])}


# -- results ----------------------------------------------------------------------------------------------
def held_share(w: dict[str, Any]) -> float:
    """Share of the run's step time in which a snapshot held dispatch (sum of ``pause_s`` over every
    step's ``step_s``): a noise-free bound on what the pauses alone can cost, next to the overhead
    measured from rates, which varies with the load between runs."""
    total = sum(float(m.get("step_s") or 0) for m in w["per_step"])
    return sum(w["pauses_s"]) / total if total else 0.0


def rederive(res: dict[str, Any]) -> dict[str, Any]:
    """Rows and goals again from the stored runs (``--render`` of an older result)."""
    c, g = res["config"], res["goal"]
    res["rows"] = rows_of(res["runs"], [None, *c["intervals_s"]])
    res["goal"] = goal_of(res["rows"], res["runs"], res["learning"], tuple(c["intervals_s"]),
                          goal_speedup=g["speedup_min"], goal_overhead_pct=g["overhead_max_pct"],
                          goal_coverage=g["coverage_min"], goal_reward_gain=g["reward_gain_min"])
    return res


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return a["steps_per_hour"] / b["steps_per_hour"] if a["steps_per_hour"] and b["steps_per_hour"] else None


def rows_of(runs: list[dict[str, Any]], snaps: list[float | None]) -> list[dict[str, Any]]:
    """One row per (mode, snapshot setting), with the same-repeat speedup and overhead."""
    by = {(w["repeat"], w["mode"], w["snapshots"]): w for w in runs}
    rows = []
    for interval in snaps:
        key = snap_key(interval)
        for mode in MODES:
            ws = [w for w in runs if w["mode"] == mode and w["snapshots"] == key]
            vs_sync = [x for w in ws if mode == "async" and (s := by.get((w["repeat"], "sync", key)))
                       and (x := _ratio(w, s)) is not None]
            overhead = [100 * (1 - x) for w in ws if interval is not None and (o := by.get((w["repeat"], mode, "off")))
                        and (x := _ratio(w, o)) is not None]
            rows.append({
                "mode": mode, "snapshots": key, "interval_s": interval, "runs": len(ws),
                "steps_per_hour": summary(w["steps_per_hour"] for w in ws),
                "step_s": summary(w["mean_step_s"] for w in ws),
                "training_share": summary(w["training_share"] for w in ws),
                "waiting_share": summary(w["waiting_share"] for w in ws),
                "speedup_vs_sync": summary(vs_sync) if mode == "async" else None,
                "overhead_pct": summary(overhead) if interval is not None else None,
                "coverage": summary(w["coverage"] for w in ws),
                "attempts": summary(w["attempts"] for w in ws), "committed": summary(w["committed"] for w in ws),
                "pause_s": summary(p for w in ws for p in w["pauses_s"]),
                "held_pct": summary(100 * held_share(w) for w in ws) if interval is not None else None,
                "max_group_version_lag": max((w["max_group_version_lag"] for w in ws), default=None),
                "max_weight_version_lag": max((w["max_weight_version_lag"] for w in ws), default=None),
                "reward_mean": summary(w["reward_mean"] for w in ws),
                "loadavg_1m": summary(x for w in ws for x in w["loadavg_1m"]),
            })
    return rows


def _row(rows: list[dict[str, Any]], mode: str, key: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["mode"] == mode and r["snapshots"] == key), None)


def _med(s: dict[str, Any] | None) -> float | None:
    return None if not s else s.get("median")


def goal_of(rows: list[dict[str, Any]], runs: list[dict[str, Any]], learn: list[dict[str, Any]],
            intervals: tuple[float, ...], *, goal_speedup: float, goal_overhead_pct: float, goal_coverage: float,
            goal_reward_gain: float) -> dict[str, Any]:
    """The issue's goals at the main job's interval (else the first measured), and the default's verdict.

    The verdict's rule: lookahead 1 becomes the default only if async learns (reward gain at least the
    goal), is faster in at least three quarters of the same-repeat pairs of every snapshot setting
    (their lower quartile above 1: the pauses cost at most a few percent, so every pair measures the
    lookahead, and one pair under a load spike does not decide), and covers at least as much wall time
    as sync at the main job's interval; otherwise the default stays synchronous."""
    key = snap_key(MAIN_JOB_INTERVAL_S if MAIN_JOB_INTERVAL_S in intervals else (intervals[0] if intervals else None))
    a, s = _row(rows, "async", key), _row(rows, "sync", key)
    speed = _med(a["speedup_vs_sync"]) if a else None
    speed_min = (a["speedup_vs_sync"] or {}).get("min") if a else None
    pairs = summary(x for r in rows if r["speedup_vs_sync"] for x in r["speedup_vs_sync"]["values"])
    over = _med(a["overhead_pct"]) if a and a["overhead_pct"] else None
    cov_a, cov_s = (_med(a["coverage"]) if a else None), (_med(s["coverage"]) if s else None)
    sync_off = _row(rows, "sync", "off")
    share = _med(sync_off["training_share"]) if sync_off else None
    gains = {w["mode"]: w["reward_gain"] for w in learn}
    learns = {m: (None if m not in gains else gains[m] >= goal_reward_gain) for m in MODES}
    spreads = {}
    for mode in MODES:
        ref = [w["steps_per_hour"] for w in runs
               if w["mode"] == mode and w["snapshots"] == "off" and w["steps_per_hour"]]
        spreads[mode] = (max(ref) - min(ref)) / statistics.median(ref) * 100 if len(ref) >= 2 else None
    reasons = []
    if learns["async"] is not True:
        reasons.append("async did not reach the reward gain" if learns["async"] is False else "learning not measured")
    if pairs["q1"] is None or pairs["q1"] <= 1.0:
        reasons.append("async was not faster in three quarters of the same-repeat pairs")
    if cov_a is None or cov_s is None or cov_a < cov_s:
        reasons.append("async covered less wall time than sync")
    return {
        "at_interval": key,
        "speedup_min": goal_speedup, "speedup_median": speed, "speedup_lowest_repeat": speed_min,
        "speedup_met": None if speed is None else speed >= goal_speedup,
        "speedup_median_snapshots_off": _med((_row(rows, "async", "off") or {}).get("speedup_vs_sync")),
        "speedup_all_pairs": pairs,
        "overhead_max_pct": goal_overhead_pct, "async_overhead_pct_median": over,
        "async_held_pct_median": _med(a.get("held_pct")) if a else None,
        "overhead_met": None if over is None else over <= goal_overhead_pct,
        "overhead_pct_median_by_interval": {f"{r['mode']}/{r['snapshots']}": _med(r["overhead_pct"])
                                            for r in rows if r["overhead_pct"]},
        "coverage_min": goal_coverage, "async_coverage_median": cov_a, "sync_coverage_median": cov_s,
        "coverage_met": None if cov_a is None else cov_a >= goal_coverage,
        "coverage_median_by_interval": {f"{r['mode']}/{r['snapshots']}": _med(r["coverage"]) for r in rows},
        "sync_training_share_median": share,
        "training_share_in_30_50": None if share is None else 0.30 <= share <= 0.50,
        "reference_spread_pct": spreads,
        "reward_gain_min": goal_reward_gain, "reward_gain": gains, "learning_met": learns,
        "default": "lookahead 1" if not reasons else "synchronous", "default_reasons": reasons,
    }


def table(res: dict[str, Any]) -> str:
    head = ["mode", "snapshots every", "steps / hour (steps 2–N)", "step s", "training share", "waiting share",
            "async / sync (same repeat)", "overhead vs off (same repeat)", "snapshots committed / attempted",
            "pause per snapshot ms", "held by pauses", "coverage", "max lag group / weight", "reward mean"]
    body = []
    for r in res["rows"]:
        body.append([
            r["mode"], "never" if r["interval_s"] is None else f"{r['interval_s']:g} s", fmt(r["steps_per_hour"]),
            fmt(r["step_s"], 1, 2), fmt(r["training_share"], 100, 0) + " %", fmt(r["waiting_share"], 100, 0) + " %",
            "—" if not r["speedup_vs_sync"] else "x" + fmt(r["speedup_vs_sync"], 1, 2),
            "—" if not r["overhead_pct"] else fmt(r["overhead_pct"], 1, 1) + " %",
            f"{fmt(r['committed'])} / {fmt(r['attempts'])}", fmt(r["pause_s"], 1e3) if r["pause_s"]["n"] else "—",
            "—" if not r.get("held_pct") else fmt(r["held_pct"], 1, 2) + " %",
            fmt(r["coverage"], 100, 1) + " %", f"{r['max_group_version_lag']} / {r['max_weight_version_lag']:g}",
            fmt(r["reward_mean"], 1, 3)])
    c, g = res["config"], res["goal"]
    spread = ", ".join(f"{m} {v:.1f}%" for m, v in g["reference_spread_pct"].items() if v is not None)
    loads = [x for w in res["runs"] for x in w["loadavg_1m"]]
    out = ["**Part 1: throughput** (" + f"{c['repeats']} repeat(s) of {c['steps']} steps; "
           + (", ".join(c["shape_overrides"]) or "the main job's step shape") + ")", "", md_table(head, body), "",
           f"Training share = training_s / step_s over steps 2–N; waiting share = generation_s / step_s (time the "
           f"step waited for its groups); held by pauses = sum of the snapshots' pause_s over the run's step time "
           f"(what the pauses alone could cost). 1-minute load average around the runs: "
           f"{fmt(summary(loads), 1, 2)}."
           + (f" The no-snapshot runs alone differ between repeats by {spread} (max − min over median)."
              if spread else "")]
    if res["learning"]:
        lhead = ["mode", "steps", "reward, first fifth", "reward, last fifth", "gain", "validation reward (step)",
                 "wall s (process)", "sum of step_s", "steps / hour", "coverage", "max weight lag"]
        lbody = [[w["mode"], w["steps"], f"{w['reward_first_fifth']:.3f}", f"{w['reward_last_fifth']:.3f}",
                  f"{w['reward_gain']:+.3f}", ", ".join(f"{v:.3f} ({s})" for s, v in w["val_rewards"]) or "—",
                  f"{w['wall_s']:.0f}", f"{w['sum_step_s']:.0f}", f"{w['steps_per_hour']:,.0f}",
                  f"{w['coverage'] * 100:.1f} %" if w["coverage"] is not None else "—",
                  f"{w['max_weight_version_lag']:g}"] for w in res["learning"]]
        out += ["", f"**Part 2: learning** (the main job, {c['learning_steps']} steps, one run per mode"
                + (f"; {', '.join(c['learning_overrides'])}" if c["learning_overrides"] else "") + ")", "",
                md_table(lhead, lbody)]
    out += ["", verdict(g)]
    return "\n".join(out)


def verdict(g: dict[str, Any]) -> str:
    def pct(v: float | None, digits: int = 1) -> str:
        return "—" if v is None else f"{v:.{digits}f}%"

    def yes(v: bool | None) -> str:
        return "not measured" if v is None else ("met" if v else "NOT met")

    gains = "; ".join(f"{m} {yes(g['learning_met'].get(m))} ({v:+.3f})" for m, v in g["reward_gain"].items())
    speed = "—" if g["speedup_median"] is None else f"x{g['speedup_median']:.3f}"
    every = "never" if g["at_interval"] == "off" else f"every {g['at_interval'][:-1]} s"
    return (f"Goals with snapshots {every}: async / sync at least x{g['speedup_min']:g}: "
            f"{yes(g['speedup_met'])} ({speed}; every same-repeat pair: {fmt(g.get('speedup_all_pairs'), 1, 2)}, "
            f"lower quartile {fmt({'n': 1, 'median': (g.get('speedup_all_pairs') or {}).get('q1')}, 1, 2)}); "
            f"snapshot overhead in async at most {g['overhead_max_pct']:g}%: "
            f"{yes(g['overhead_met'])} ({pct(g['async_overhead_pct_median'])} from the rates; the pauses held dispatch "
            f"{pct(g.get('async_held_pct_median'), 2)} of the step time); coverage in async at least "
            f"{g['coverage_min'] * 100:g}%: {yes(g['coverage_met'])} ("
            f"{pct(None if g['async_coverage_median'] is None else g['async_coverage_median'] * 100)}; sync "
            f"{pct(None if g['sync_coverage_median'] is None else g['sync_coverage_median'] * 100)}); reward gain at "
            f"least +{g['reward_gain_min']:g}: {gains or 'not measured'}. Training share in sync (snapshots off): "
            f"{pct(None if g['sync_training_share_median'] is None else g['sync_training_share_median'] * 100, 0)}. "
            f"Default from these measurements: **{g['default']}**"
            + (f" ({'; '.join(g['default_reasons'])})" if g["default_reasons"] else "") + ".")
