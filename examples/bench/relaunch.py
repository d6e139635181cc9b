"""Measurement 7: relaunch after a SIGKILL, from launch to the first dispatched rollout.

Each repeat is two real ``examples/run_grpo.py`` processes on
``examples/configs/grpo_workplace_turn.yaml`` (scripted backend, recording
trainer), started and reaped through the run harness, with the same command:

1. the first launch (fresh checkpoint directory), SIGKILLed as a whole process
   group as soon as ``snapshots.jsonl`` shows a committed Gym snapshot
   (``commit_mode`` other than ``ledger_only``) of trainer step >= 1 that saved
   rollouts; the benchmark then waits until no process carrying the run's
   marker is left;
2. the relaunch, which resumes from that trainer checkpoint and snapshot; it
   is SIGKILLed (and reaped) as soon as its ``startup.json`` exists.

``startup.json`` is written by the run itself (``nemo_rl/utils/startup_clock.py``)
when its first rollout is dispatched: seconds from process start to that
dispatch, split into phases (config, ray, gym, model, trainer_load, restore,
first_dispatch; each runs from the previous mark), and whether the run
resumed. The first launch's file is read (and kept as
``startup-first-launch.json``) before the relaunch starts. The benchmark
also records when it saw each file appear, counted from its own launch of
the process, as a cross-check of the run's own clock.

No instrumentation is on these runs' ``PYTHONPATH``: they are the product as
shipped (the harness's ``python -m testkit.run_grpo`` with no test variable set,
so no hook acts), with the scripted backend's reply delay
(``policy.scripted_backend.delay_s``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from bench.common import SCRIPTED, Log, fmt, fresh_dir, in_flight, make_log, md_table, summary
from testkit.run_harness import JsonlFollower, new_marker, run_env, run_once, scripted_overrides
from nemo_rl.utils.startup_clock import PHASES

NAME = "relaunch"
TITLE = "7. Relaunch after a SIGKILL: launch to the first dispatched rollout, by phase"
CONFIG = "examples/configs/grpo_workplace_turn.yaml"
KINDS = (("first", "first launch"), ("relaunch", "relaunch after SIGKILL"))
PHASE_LABELS = {
    "config": "Python, imports, config",
    "ray": "Ray start",
    "gym": "Gym servers",
    "model": "policy + trainer",
    "trainer_load": "trainer checkpoint load",
    "restore": "snapshot restore",
    "first_dispatch": "then first dispatch",
}
GOAL_S = 15.0
POLL_S = 0.02


def measure(*, repeats: int, workdir: Path, steps: int = 3, prompts: int | None = None,
            generations: int | None = None, delay_s: float = 0.5, interval_s: float = 0.5,
            goal_s: float = GOAL_S, overrides: list[str] | None = None, timeout_s: float = 240.0,
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("relaunch")
    results = []
    for r in range(repeats):
        run_dir = fresh_dir(Path(workdir).resolve() / f"relaunch-{r}")
        res = run_repeat(run_dir, steps=steps, prompts=prompts, generations=generations, delay_s=delay_s,
                         interval_s=interval_s, overrides=list(overrides or []), timeout_s=timeout_s)
        res["repeat"] = r
        results.append(res)
        if res.get("error"):
            log(f"repeat {r + 1}/{repeats}: {res['error']}")
        else:
            log(f"repeat {r + 1}/{repeats}: first launch {res['first']['to_first_dispatch_s']:.1f}s to the first "
                f"dispatch; killed at step {res['crash']['snapshot']['step']} after a snapshot of "
                f"{res['crash']['snapshot']['in_flight']} rollouts; relaunch "
                f"{res['relaunch']['to_first_dispatch_s']:.1f}s (load {res['loadavg_1m_at_relaunch']:.2f})")
    rows = rows_of(results)
    return {"name": NAME, "title": TITLE, "rows": rows, "repeats": results, "goal": goal_of(rows, results, goal_s),
            "config": {"repeats": repeats, "max_num_steps": steps, "prompts": prompts, "generations": generations,
                       "backend_delay_s": delay_s, "snapshot_interval_s": interval_s,
                       "overrides": list(overrides or []),
                       "setup": f"{CONFIG}, scripted backend, recording trainer; killed once a Gym snapshot of "
                                "step >= 1 that saved rollouts was committed"}}


def _args(run_dir: Path, steps: int, prompts: int | None, generations: int | None, interval_s: float,
          overrides: list[str]) -> list[str]:
    args = ["--config", CONFIG, SCRIPTED, f"grpo.max_num_steps={steps}",
            f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
            f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            "logger.progress_bar=false", "logger.plot=false"]
    if prompts is not None:
        args.append(f"grpo.num_prompts_per_step={prompts}")
    if generations is not None:
        args.append(f"grpo.num_generations_per_prompt={generations}")
    return args + overrides


def read_startup(path: Path) -> dict[str, Any] | None:
    """``startup.json`` once complete (the run writes it in place: a half-written file reads as absent)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or "phases_s" not in record or "to_first_dispatch_s" not in record:
        return None
    return record


def _restart_point(snapshot: dict[str, Any]) -> bool:
    """A snapshot the relaunch will restore rollouts from: Gym's (not ledger only), of a trained step."""
    return (bool(snapshot.get("committed")) and snapshot.get("commit_mode") != "ledger_only"
            and int(snapshot.get("step") or 0) >= 1 and int(snapshot.get("saved") or 0) > 0)


def run_repeat(run_dir: Path, *, steps: int, prompts: int | None, generations: int | None, delay_s: float,
               interval_s: float, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    args = [*_args(run_dir, steps, prompts, generations, interval_s, overrides), *scripted_overrides(delay_s)]
    logs = run_dir / "logs"
    startup = logs / "startup.json"
    base: dict[str, Any] = {"command": " ".join(["python", "examples/run_grpo.py", *args])}
    snaps = JsonlFollower(logs / "snapshots.jsonl")
    chosen: list[tuple[float, dict[str, Any]]] = []

    def crash_point(_elapsed: float) -> bool:
        for seen_at, s in snaps.poll():
            if not chosen and _restart_point(s):
                chosen.append((seen_at, s))
        return bool(chosen)

    first_launched = time.time()
    first = run_once(args, env=run_env(marker=new_marker()), stdout_path=run_dir / "first.out",
                     stderr_path=run_dir / "first.out", kill_when=crash_point, timeout_s=timeout_s, poll_s=POLL_S)
    stragglers = list(first.leftover)
    if first.killed_by != "group":
        why = ("no committed snapshot of step >= 1 within the timeout" if first.killed_by == "timeout"
               else f"run ended (rc {first.returncode}) before a snapshot of step >= 1 committed")
        return {**base, "error": f"first launch: {why}; see {run_dir / 'first.out'}", "stragglers": stragglers}
    first_startup = read_startup(startup)
    if first_startup is None:
        return {**base, "error": f"first launch wrote no complete {startup}", "stragglers": stragglers}
    first_seen = startup.stat().st_mtime - first_launched
    startup.rename(logs / "startup-first-launch.json")  # the relaunch writes its own

    seen: dict[str, float] = {}

    def dispatched(elapsed: float) -> bool:
        if read_startup(startup) is None:
            return False
        seen["elapsed"] = elapsed
        return True

    load = os.getloadavg()[0]
    relaunched = time.time()
    second = run_once(args, env=run_env(marker=new_marker()), stdout_path=run_dir / "relaunch.out",
                      stderr_path=run_dir / "relaunch.out", kill_when=dispatched, timeout_s=timeout_s, poll_s=POLL_S)
    stragglers += second.leftover
    relaunch_startup = read_startup(startup)
    if second.killed_by != "group" or relaunch_startup is None:
        why = ("no startup.json within the timeout" if second.killed_by == "timeout"
               else f"exited (rc {second.returncode}) without a first dispatch")
        tail = "\n".join((run_dir / "relaunch.out").read_text(errors="replace").splitlines()[-12:])
        return {**base, "error": f"relaunch: {why}; see {run_dir / 'relaunch.out'}", "output_tail": tail,
                "first": {**first_startup, "seen_after_launch_s": first_seen}, "stragglers": stragglers}
    restore_path = logs / "restore.json"
    restore = json.loads(restore_path.read_text()) if restore_path.exists() else {}
    seen_at, snap = chosen[0]
    return {
        **base,
        "first": {**first_startup, "seen_after_launch_s": first_seen},
        "relaunch": {**relaunch_startup, "seen_after_launch_s": startup.stat().st_mtime - relaunched,
                     "polled_after_launch_s": seen.get("elapsed")},
        "crash": {"snapshot": {"checkpoint_id": snap.get("checkpoint_id"), "step": snap.get("step"),
                               "commit_mode": snap.get("commit_mode"), "saved": snap.get("saved", 0),
                               "in_flight": in_flight(snap), "pause_s": snap.get("pause_s")},
                  "killed_after_snapshot_seen_s": None if first.killed_at is None else first.killed_at - seen_at,
                  "first_launch_wall_s": first.wall_s, "reap_s": first.cleanup_s},
        "restore": {k: restore.get(k) for k in ("trainer_step", "snapshot", "restored_turn", "restarted_from_prompt",
                                                "kept_siblings")},
        "loadavg_1m_at_relaunch": load,
        "relaunch_reap_s": second.cleanup_s,
        "stragglers": stragglers,
    }


# -- results ----------------------------------------------------------------------------------------
def phases_of(results: list[dict[str, Any]]) -> list[str]:
    """The startup clock's phases, then any other phase a run recorded (a newer clock)."""
    extra = sorted({p for r in results for k, _ in KINDS if r.get(k) for p in r[k].get("phases_s", {})} - set(PHASES))
    return [*PHASES, *extra]


def rows_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = [r for r in results if not r.get("error")]
    phases = phases_of(ok)
    rows = []
    for kind, label in KINDS:
        recs = [r[kind] for r in ok]
        rows.append({
            "kind": kind, "label": label, "runs": len(recs),
            "resumed": [rec.get("resumed") for rec in recs],
            "to_first_dispatch_s": summary(rec["to_first_dispatch_s"] for rec in recs),
            "seen_after_launch_s": summary(rec["seen_after_launch_s"] for rec in recs),
            # > 0: the run's clock began before the benchmark spawned the process (impossible: a clock error)
            "run_clock_ahead_s": summary(rec["to_first_dispatch_s"] - rec["seen_after_launch_s"] for rec in recs),
            "phases_s": {p: summary(rec["phases_s"][p] for rec in recs if p in rec["phases_s"]) for p in phases},
        })
    return rows


def goal_of(rows: list[dict[str, Any]], results: list[dict[str, Any]], goal_s: float = GOAL_S) -> dict[str, Any]:
    relaunch = next((r for r in rows if r["kind"] == "relaunch"), None)
    med = relaunch["to_first_dispatch_s"]["median"] if relaunch else None
    ok = [r for r in results if not r.get("error")]
    return {"relaunch_to_first_dispatch_max_s": goal_s, "median_s": med,
            "met": None if med is None else med <= goal_s,
            "every_relaunch_resumed": None if not ok else all(r["relaunch"].get("resumed") is True for r in ok),
            "loadavg_1m_at_relaunch": summary(r["loadavg_1m_at_relaunch"] for r in ok),
            "errors": [r["error"] for r in results if r.get("error")]}


def table(res: dict[str, Any]) -> str:
    phases = phases_of(res["repeats"])
    head = ["launch", "runs", "resumed", "total: process start → first dispatch s",
            *(f"{PHASE_LABELS.get(p, p)} s" for p in phases),
            "spawn → file seen by the benchmark s"]
    body = []
    for r in res["rows"]:
        resumed = sorted({str(v).lower() for v in r["resumed"]}) or ["—"]
        body.append([r["label"], r["runs"], "/".join(resumed), fmt(r["to_first_dispatch_s"], 1, 2),
                     *(fmt(r["phases_s"].get(p), 1, 2) for p in phases), fmt(r["seen_after_launch_s"], 1, 2)])
    ok = [r for r in res["repeats"] if not r.get("error")]
    notes = []
    if ok:
        notes.append(
            "Killed once a snapshot of step "
            + "/".join(sorted({str(r["crash"]["snapshot"]["step"]) for r in ok}))
            + f" had committed ({fmt(summary(r['crash']['snapshot']['in_flight'] for r in ok))} rollouts in flight); "
            f"the relaunch restored {fmt(summary(r['restore'].get('restored_turn') or 0 for r in ok))} at turn level "
            f"and restarted {fmt(summary(r['restore'].get('restarted_from_prompt') or 0 for r in ok))} from the "
            f"prompt. 1-minute load average at relaunch: "
            f"{fmt(summary(r['loadavg_1m_at_relaunch'] for r in ok), 1, 2)}.")
        ahead = [r["run_clock_ahead_s"] for r in res["rows"] if (r.get("run_clock_ahead_s") or {}).get("n")]
        worst = max((a["max"] for a in ahead), default=None)
        if worst is not None and worst > 0.05:
            notes.append(
                f"*Seen by the benchmark* = from its spawn of the process to the file's mtime; the run's own total "
                f"exceeds it by up to {worst:.2f} s, i.e. the run's clock puts its process start before the "
                f"spawn (its start time comes from /proc: boot time, in whole seconds, plus start ticks), so its "
                f"first phase and total are overstated by about that much.")
    errors = res["goal"].get("errors") or []
    if errors:
        notes.append(f"{len(errors)} repeat(s) failed: " + "; ".join(errors))
    return md_table(head, body) + ("\n\n" + " ".join(notes) if notes else "")
