"""Measurement 3: work lost per crash, per recovery level and Gym setup.

Each experiment is two real ``examples/run_grpo.py`` processes (Ray, Gym
servers, the scripted backend as policy, the recording trainer):

1. the run, killed with SIGKILL of its whole process group at a seeded random
   moment in step 2: ``delay`` seconds after step 1's metrics line appears
   (turn levels additionally wait until a snapshot of step 2 is committed);
2. the same command again, which restores and runs to completion.

Counting: ``bench/instrument/sitecustomize.py`` makes the Gym policy model
server of both runs append one line per finished generation (capture key,
turn index, generated tokens, time). A rollout *slot* is (prompt group,
generation index); every attempt of a slot (restored ``-a1`` or restarted
from the prompt under a new id) maps to it. A crash-free run generates every
(slot, turn) exactly once, so a slot regenerated ``sum(count(turn) - 1)``
calls and the matching tokens. For every rollout restored at turn level the
saved state's ``model_calls`` (from the snapshot's agent records, copied
right after the kill) gives the first turn it had to redo; the goal counts
the redone calls that had finished before the restored snapshot ended.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from bench.common import INSTRUMENT, Log, fmt, fresh_dir, make_log, md_table, summary
from testkit.run_harness import JsonlFollower, RunOutcome, new_marker, run_env, run_once, scripted_overrides

NAME = "work_lost"
TITLE = "3. Work lost per crash"
SETUPS = {
    "workplace": "examples/configs/grpo_workplace_turn.yaml",
    "mixed": "examples/configs/grpo_mixed_turn.yaml",
}
LEVELS = ("turn", "sibling", "prompt_group")
_SLOT = re.compile(r"^(?P<group>.+)_g(?P<g>\d+)_a(?P<uuid>[0-9a-f]{32})(?:-a(?P<attempt>\d+))?$")
POLL_S = 0.02


def measure(*, experiments: list[tuple[str, str]], seeds: list[int], workdir: Path, delay_s: float = 0.6,
            interval_s: float = 0.4, steps: int = 3, crash_window: tuple[float, float] = (0.5, 1.5),
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("work-lost")
    results = []
    for setup, level in experiments:
        for seed in seeds:
            d = random.Random(seed).uniform(*crash_window)  # the same crash moment for every config of a seed
            run_dir = fresh_dir(Path(workdir).resolve() / f"{setup}-{level}-s{seed}")
            started = time.monotonic()
            res = run_experiment(setup, level, seed, d, run_dir, delay_s=delay_s, interval_s=interval_s, steps=steps,
                                 log=log)
            res["seconds"] = time.monotonic() - started
            results.append(res)
            if res.get("error"):
                log(f"{setup}/{level} seed {seed}: {res['error']}")
            else:
                log(f"{setup}/{level} seed {seed}: crash {res['crash_after_step1_s']:.2f}s into step 2; "
                    f"{res['in_flight']} in flight -> {res['restored']} restored, {res['restarted']} restarted, "
                    f"{res['kept']} kept; regenerated {res['regen_calls']} calls / {res['regen_tokens']} tokens "
                    f"({res['seconds']:.0f}s)")
    return _finish(results, experiments, seeds, delay_s, interval_s, steps, crash_window)


# -- one experiment ------------------------------------------------------------------------------
def _args(setup: str, level: str, run_dir: Path, interval_s: float, steps: int, delay_s: float) -> list[str]:
    args = ["--config", SETUPS[setup], "policy.model_name=scripted-test-backend", *scripted_overrides(delay_s),
            f"grpo.max_num_steps={steps}", f"rollout_recovery.target_level={level}",
            f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
            f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            "logger.progress_bar=false", "logger.plot=false"]
    if setup == "mixed" and level == "turn":
        args.append("rollout_recovery.allow_restart_only_gym_servers=true")
    return args


def _env(audit_dir: Path, marker: str) -> dict[str, str]:
    return run_env(marker=marker, pythonpath=[INSTRUMENT], extra={"BENCH_AUDIT_DIR": str(audit_dir)})


# How the run is stopped at the crash point instead of SIGKILL of its group (``bench/preemption.py``):
# ``stop(args, env, output_path, stop_when, timeout_s)`` runs it, stops it once ``stop_when(elapsed_s)``
# holds, reaps it and returns its outcome (``killed_by`` None or "timeout": never stopped) and what it
# measured about the stop.
Stopper = Callable[[list[str], dict[str, str], Path, Callable[[float], bool], float], tuple[RunOutcome, dict[str, Any]]]


def run_experiment(setup: str, level: str, seed: int, delay: float, run_dir: Path, *, delay_s: float,
                   interval_s: float, steps: int, log: Log, timeout_s: float = 240, stop: Stopper | None = None,
                   wait_for_snapshot: bool = True) -> dict[str, Any]:
    """One crash and its relaunch. ``stop``: how the run is stopped (default: SIGKILL of its group);
    ``wait_for_snapshot``: at turn level, the crash waits for a committed snapshot of step 2 too."""
    args = _args(setup, level, run_dir, interval_s, steps, delay_s)
    marker = new_marker()
    base = {"setup": setup, "level": level, "seed": seed, "planned_delay_s": delay,
            "command": " ".join(["python", "examples/run_grpo.py", *args])}
    logs = run_dir / "logs"
    snaps, metrics = JsonlFollower(logs / "snapshots.jsonl"), JsonlFollower(logs / "metrics.jsonl")
    seen: dict[str, float] = {}

    def crash_point(_elapsed: float) -> bool:
        snaps.poll()
        metrics.poll()
        if "step1" not in seen:
            at = next((t for t, m in metrics.items if m.get("step") == 1), None)
            if at is None:
                return False
            seen["step1"] = at
        if time.time() < seen["step1"] + delay:
            return False
        if wait_for_snapshot and level == "turn" and not any(s.get("committed") and s.get("step") == 1
                                                              for _, s in snaps.items):
            return False  # turn recovery needs a committed snapshot of step 2's rollouts
        return True

    stopped: dict[str, Any] = {}
    if stop is None:
        crashed = run_once(args, env=_env(run_dir / "audit-crash", marker),
                           stdout_path=run_dir / "crash-run.out", stderr_path=run_dir / "crash-run.out",
                           kill_when=crash_point, timeout_s=timeout_s, poll_s=POLL_S)
    else:
        crashed, stopped = stop(args, _env(run_dir / "audit-crash", marker), run_dir / "crash-run.out", crash_point,
                                timeout_s)
    left = list(crashed.leftover)
    if crashed.killed_by in (None, "timeout"):
        why = ("crash point never reached" if crashed.killed_by == "timeout"
               else f"run ended (rc {crashed.returncode}) before the crash point; see {crashed.stdout_path}")
        return {**base, "error": why, "stragglers": left, **({"stop": stopped} if stop else {})}
    snaps.poll()
    crashed_at, step1_at = crashed.killed_at, seen["step1"]
    crash_copy = run_dir / "ckpt-at-crash"
    shutil.copytree(run_dir / "ckpt", crash_copy)
    rerun = run_once(args, env=_env(run_dir / "audit-rerun", marker),
                     stdout_path=run_dir / "rerun.out", stderr_path=run_dir / "rerun.out", timeout_s=timeout_s)
    left += rerun.leftover
    rc = rerun.returncode if rerun.killed_by is None else None
    if rc != 0:
        tail = "\n".join((run_dir / "rerun.out").read_text(errors="replace").splitlines()[-12:])
        return {**base, "error": f"rerun exited {rc}; see {run_dir / 'rerun.out'}", "output_tail": tail,
                "stragglers": left, **({"stop": stopped} if stop else {})}
    res = analyse(run_dir, crash_copy, snaps.items, steps)
    cut = res.pop("snapshot_seen_at")
    res.update(base, crash_after_step1_s=crashed_at - step1_at, stragglers=left,
               crash_after_snapshot_s=None if cut is None else crashed_at - cut)
    if stop is not None:
        res["stop"] = stopped
    return res


# -- analysis ---------------------------------------------------------------------------------------
def _read_audit(directory: Path) -> list[dict[str, Any]]:
    calls = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                calls.append(json.loads(line))
    return [c for c in calls if c.get("status") == 200 and c.get("key")]


def _slot(key: str) -> tuple[str, int, str, int]:
    m = _SLOT.match(key)
    if not m:
        raise ValueError(f"unexpected rollout id {key!r}")
    return m["group"], int(m["g"]), m["uuid"], int(m["attempt"] or 0)


def _step_of(group_id: str) -> int:
    """Groups are named ``s<step>p<dataloader position>`` by the controller."""
    m = re.match(r"^s(\d+)p\d+$", group_id)
    return int(m.group(1)) if m else -1


def _trained(ckpt: Path) -> tuple[list[str], list[str]]:
    """Groups and rollout ids the newest trainer step's recording-trainer state was trained on."""
    steps = sorted((int(p.name[5:]), p) for p in ckpt.glob("step_*") if p.name[5:].isdigit()
                   and (p / "recording_trainer.json").exists())
    if not steps:
        return [], []
    state = json.loads((steps[-1][1] / "recording_trainer.json").read_text())
    groups = [g for b in state["batches"] for g in b["groups"]]
    rollouts = [r for b in state["batches"] for r in b["rollout_ids"]]
    return groups, rollouts


def saved_calls(snapshot: Path) -> dict[str, int]:
    """Base rollout id -> model calls in its saved agent state."""
    saved: dict[str, int] = {}
    for records in snapshot.rglob("records-*.jsonl"):
        if records.parent.parent.name != "agent":
            continue
        for line in records.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                saved[rec["episode_id"]["rollout_id"]] = int(rec["state"]["model_calls"])
    return saved


def analyse(run_dir: Path, crash_copy: Path, snap_lines: list[tuple[float, dict]], steps: int) -> dict[str, Any]:
    pre, post = _read_audit(run_dir / "audit-crash"), _read_audit(run_dir / "audit-rerun")
    if not pre or not post:
        raise RuntimeError(
            f"the model-server audit recorded no generations in {run_dir} (crash run: {len(pre)}, rerun: "
            f"{len(post)}); bench/instrument/sitecustomize.py wraps VLLMModelServer._generate, was it renamed?")
    restore = json.loads((run_dir / "logs" / "restore.json").read_text())
    trained_before = set(_trained(crash_copy)[0])
    final_groups, final_rollouts = _trained(run_dir / "ckpt")
    # every prompt group trained exactly once, no sample twice, and every step complete
    lineage_ok = (len(final_groups) == len(set(final_groups)) and len(final_rollouts) == len(set(final_rollouts))
                  and len(final_groups) > 0 and len(final_rollouts) % len(final_groups) == 0)
    by_slot: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for phase, calls in (("pre", pre), ("post", post)):
        for c in calls:
            group, g, uid, attempt = _slot(c["key"])
            by_slot[(group, g)].append({**c, "phase": phase, "uuid": uid, "attempt": attempt})
    regen_calls: dict[tuple[str, int], int] = {}
    regen_tokens: dict[tuple[str, int], int] = {}
    for slot, calls in by_slot.items():
        per_turn: dict[int, list[int]] = defaultdict(list)
        for c in calls:
            per_turn[c["turn"]].append(c["tokens"])
        regen_calls[slot] = sum(len(v) - 1 for v in per_turn.values())
        regen_tokens[slot] = sum(sum(v) - v[-1] for v in per_turn.values())
    # rollouts in flight at the crash: every slot of the step being generated (all are dispatched at once)
    crash_step = max((_step_of(g) for g in trained_before), default=0) + 1
    in_flight = {(_slot(k)[0], _slot(k)[1]) for k in final_rollouts if _step_of(_slot(k)[0]) == crash_step}
    restored_ids = restore.get("restored_rollout_ids") or []
    kept_ids = restore.get("kept_rollout_ids") or []
    restored = {(_slot(k)[0], _slot(k)[1]): k for k in restored_ids}
    kept = {(_slot(k)[0], _slot(k)[1]) for k in kept_ids}
    restarted = in_flight - set(restored) - kept
    # the goal: redone calls of a turn-restored rollout that had finished before its snapshot ended
    per_restored = []
    cut = None
    if restored:
        snap_path = Path(restore["snapshot"])
        snapshot = crash_copy / snap_path.relative_to(run_dir / "ckpt")
        saved = saved_calls(snapshot)
        cut = next((t for t, s in snap_lines if s.get("path") == restore["snapshot"]), None)
        for slot, new_key in restored.items():
            group, g, uid, _ = _slot(new_key)
            base = f"{group}_g{g}_a{uid}"
            s = saved.get(base)
            old = [c for c in by_slot[slot] if c["phase"] == "pre" and c["uuid"] == uid]
            new = [c for c in by_slot[slot] if c["phase"] == "post" and c["uuid"] == uid]
            redone = [c for c in old if s is not None and c["turn"] >= s]
            per_restored.append({
                "slot": f"{group}_g{g}", "saved_calls": s, "regen_calls": regen_calls.get(slot, 0),
                "regen_tokens": regen_tokens.get(slot, 0),
                "regen_before_snapshot_end": sum(1 for c in redone if cut is not None and c["t"] <= cut),
                "first_turn_after_restore": min((c["turn"] for c in new), default=None),
            })
    needed = sum(len({c["turn"] for c in calls}) for calls in by_slot.values())
    generated = len(pre) + len(post)
    return {
        "in_flight": len(in_flight), "restored": len(restored), "restarted": len(restarted), "kept": len(kept),
        "regen_calls": sum(regen_calls.values()), "regen_tokens": sum(regen_tokens.values()),
        "generated_calls": generated, "needed_calls": needed,
        "per_restored": per_restored,
        "per_restarted_calls": [regen_calls.get(s, 0) for s in sorted(restarted)],
        "per_restarted_tokens": [regen_tokens.get(s, 0) for s in sorted(restarted)],
        "restore_record": {k: restore.get(k) for k in ("trainer_step", "snapshot", "restored_turn",
                                                         "restarted_from_prompt", "kept_siblings", "redone_groups")},
        "lineage_ok": lineage_ok and len(final_groups) > 0,
        "snapshots_committed_before_crash": sum(1 for _, s in snap_lines if s.get("committed")),
        "snapshot_seen_at": cut,
    }


# -- results ----------------------------------------------------------------------------------------
def _finish(results, experiments, seeds, delay_s, interval_s, steps, crash_window) -> dict[str, Any]:
    rows = []
    for setup, level in experiments:
        mine = [r for r in results if r["setup"] == setup and r["level"] == level and not r.get("error")]
        restored = [p for r in mine for p in r["per_restored"]]
        rows.append({
            "setup": setup, "level": level, "crashes": len(mine),
            "errors": [r["error"] for r in results if r["setup"] == setup and r["level"] == level and r.get("error")],
            "in_flight": summary(r["in_flight"] for r in mine),
            "restored": summary(r["restored"] for r in mine),
            "restarted": summary(r["restarted"] for r in mine),
            "kept": summary(r["kept"] for r in mine),
            "crash_after_snapshot_s": summary(r["crash_after_snapshot_s"] for r in mine
                                              if r.get("crash_after_snapshot_s") is not None),
            "regen_calls": summary(r["regen_calls"] for r in mine),
            "regen_tokens": summary(r["regen_tokens"] for r in mine),
            "regen_calls_per_affected": summary(r["regen_calls"] / r["in_flight"] for r in mine if r["in_flight"]),
            "per_restored_calls": summary(p["regen_calls"] for p in restored),
            "per_restored_tokens": summary(p["regen_tokens"] for p in restored),
            "per_restored_before_snapshot_end_max": max((p["regen_before_snapshot_end"] for p in restored),
                                                        default=None),
            "per_restarted_calls": summary(c for r in mine for c in r["per_restarted_calls"]),
            "per_restarted_tokens": summary(c for r in mine for c in r["per_restarted_tokens"]),
            "resumed_at_saved_turn": all(p["first_turn_after_restore"] in (None, p["saved_calls"]) for p in restored),
            "lineage_ok": all(r["lineage_ok"] for r in mine),
        })
    restored_all = [p for r in results if not r.get("error") for p in r["per_restored"]]
    worst = max((p["regen_before_snapshot_end"] for p in restored_all), default=None)
    goal = {"saved_rollout_regenerates_at_most": 1,
            "restored_rollouts": len(restored_all),
            "max_regenerated_before_snapshot_end": worst,
            "met": None if worst is None else worst <= 1,
            "max_regenerated_including_after_snapshot": max((p["regen_calls"] for p in restored_all), default=None)}
    return {"name": NAME, "title": TITLE, "rows": rows, "goal": goal, "experiments": results,
            "config": {"seeds": seeds, "backend_delay_s": delay_s, "snapshot_interval_s": interval_s,
                       "max_num_steps": steps, "crash_window_after_step1_s": list(crash_window),
                       "backend": "scripted (plays each row's demonstration), recording trainer"}}


def table(res: dict[str, Any]) -> str:
    head = ["setup", "level", "crashes", "crash after the restored snapshot s", "rollouts in flight at crash",
            "restored at turn level",
            "restarted from prompt", "sealed kept", "model calls regenerated", "tokens regenerated",
            "calls regenerated per restored rollout", "…of them finished before the snapshot ended (max)",
            "calls regenerated per restarted rollout"]
    body = []
    for r in res["rows"]:
        body.append([r["setup"], r["level"], r["crashes"],
                     fmt(r["crash_after_snapshot_s"], 1, 2) if r["crash_after_snapshot_s"]["n"] else "—",
                     fmt(r["in_flight"]), fmt(r["restored"]),
                     fmt(r["restarted"]), fmt(r["kept"]), fmt(r["regen_calls"]), fmt(r["regen_tokens"]),
                     fmt(r["per_restored_calls"], 1, 2) if r["per_restored_calls"]["n"] else "—",
                     "—" if r["per_restored_before_snapshot_end_max"] is None
                     else r["per_restored_before_snapshot_end_max"],
                     fmt(r["per_restarted_calls"], 1, 2) if r["per_restarted_calls"]["n"] else "—"])
    return md_table(head, body)
