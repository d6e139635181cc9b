"""Measurement 1: snapshot cost versus rollouts in flight, through the controller.

Each point is a real GRPO run (``examples/run_grpo.py``, Workplace config,
turn-level recovery, the scripted backend as policy, the recording trainer)
whose steps each dispatch N = prompts x generations rollouts at once. The
controller takes its own snapshots (``RolloutSnapshotter.attempt``, every
``interval_s``) while they run; the benchmark reads ``snapshots.jsonl`` and
keeps the attempts that dealt with (nearly) all N rollouts (``saved +
unsaved + not_admitted >= fill x N``), then stops the run.

- ``idle``: tools return at once; a snapshot finds rollouts waiting on the
  model (the backend replies after ``delay_s``), so the pause is the control
  plane plus the controller's own work (drain, cut, capture, publish).
- ``tool``: every Workplace tool takes ``tool_s`` (``tool_delay_s``), so
  snapshots find tool calls in flight and prepare waits for them. Each
  resources server logs when every tool call returns; a call was in flight
  at prepare if it returned after prepare began and began (return minus
  ``tool_s``) before. *excess over tool* = the attempt's pause minus the
  longest such call's time left at prepare: the pause the tool did not hide.

Phases come from ``instrument/sitecustomize.py``, which times the product's
own calls (``GymCheckpointCoordinator._collect`` per operation across the
replicas, ``commit_snapshot``); ``pause_s`` and ``persist_s`` are what the
controller recorded. Bytes: the size of each published snapshot directory
(``keep_latest_k`` is raised so none is pruned before it is measured).
Memory of a staged commit: ``captured_bytes`` (every in-memory copy the cut
took, Gym's and the controller's data plane) and, where the run records it,
``captured_bytes_by_server`` (``"<gym instance id>/<server>"`` -> bytes of
that participant's staged copy), both from ``snapshots.jsonl``.

Burst and steady attempts. While Gym is still receiving the step's ``/run``
calls (at N = 8192 on 2 cores, the first 35-70 s of a step), an attempt either
fails (``gym_unavailable``: the agent, busy seeding rollouts, cannot answer a
status probe within ``gym_park_grace_s``) or waits out the drain for rollouts
the controller dispatched and Gym never saw (``not_admitted``). Those attempts
are **burst** (``attempt_classes``): ``not_admitted > 0``, a ``gym_unavailable``
failure, or an attempt that a later attempt of the same step shows started
before the step's last rollout reached Gym (that later one still found
``not_admitted > 0``). Every other attempt is **steady**. Rows report medians
for steady, burst and all kept attempts, and count every attempt of a run by
class, failed ones included (a failed attempt held rollouts too, for its
``pause_s``). The goals are evaluated on steady attempts (``basis`` in the goal;
rows stored before the classes existed fall back to all kept attempts).

Goals: at ``goal_n`` (512) the median excess over the tool is at most
``GOAL_EXCESS_MS``; the idle pause (disk) grows at most ``GROWTH_MAX`` from
N = 512 to 2048; and at N = 2048 (idle, disk) the staged pause is at most
``STAGED_OVER_BLOCKING_MAX`` of the blocking one, where two variants set
``rollout_checkpointing.commit_mode`` to ``staged`` and ``blocking``. At the
scale users run (512 prompts x 16 generations: ``LARGE_N`` = 8192 rollouts in
flight) the median excess over the tool is at most ``LARGE_EXCESS_MS`` and the
idle pause grows at most ``LARGE_GROWTH_MAX`` from N = 2048 to 8192.

Every N up to ``per_replica`` (2048; ``bench_recovery.py --per-replica``)
runs on one Gym replica, so the growth with N is not mixed with a change of
topology (a replica's ``NemoGym`` actor serves up to 100,000 ``/run`` calls, and
its checkpoint calls run in its ``NemoGymControl`` actor); N above ``per_replica``
uses ``ceil(N / per_replica)`` replicas of the one shard (every snapshot spans
all of them). Each row records its replica count.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import (
    DEFAULT_VARIANTS,
    ControllerRun,
    timed_attempts,
    Log,
    Variant,
    committed_count,
    controller_run,
    dir_bytes,
    fmt,
    growth,
    in_flight,
    make_log,
    md_table,
    summary,
    workplace_tool_delays,
)
from testkit.run_harness import read_jsonl

NAME = "snapshot_cost"
TITLE = "1. Snapshot cost versus rollouts in flight (the controller's snapshots)"
CONFIG = "examples/configs/grpo_workplace_turn.yaml"
PHASES = ("prepare", "commit", "publish", "resume")
GOAL_N, GOAL_EXCESS_MS = 512, 50.0  # median pause over the longest tool call in flight, disk
GROWTH_FROM_N, GROWTH_TO_N, GROWTH_MAX = 512, 2048, 4.5  # idle pause (disk), ratio of medians
RATIO_AT_N, STAGED_OVER_BLOCKING_MAX = 2048, 0.3  # idle pause (disk), staged / blocking
LARGE_N, LARGE_EXCESS_MS = 8192, 100.0  # users run 512 prompts x 16 generations: median excess over the tool
LARGE_GROWTH_FROM_N, LARGE_GROWTH_MAX = 2048, 4.5  # idle pause (disk), ratio of medians, 2048 -> LARGE_N
COMMIT_MODE = "rollout_checkpointing.commit_mode="
BURST, STEADY = "burst", "steady"
# Laid over every run: a burst of failed attempts must not stop the run (the product stops after
# max_consecutive_failures in a row), and a prepare may wait long on a saturated agent.
RUN_SETTINGS = ("rollout_checkpointing.max_consecutive_failures=1000", "rollout_recovery.gym_prepare_timeout_s=60")
# The scripted backend works on at most this many replies at once, as a generation server's batch does
# (vLLM's max_num_seqs): replies come back at a bounded rate, not all N at once. 100 is what every figure
# measured before the model server's connection fix ran at by accident (aiohttp's default cap of 100
# connections to the backend), so figures stay comparable; without a bound the fake backend answers
# thousands of calls at once and the 2 cores only measure its CPU load.
BACKEND_BATCH = 100


def tmpfs_root() -> Path | None:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def measure(*, sizes: list[int], repeats: int, workdir: Path, tool_s: float = 0.5, delay_s: float = 3.0,
            tool_delay_s: float = 1.5, interval_s: float = 1.0, generations: int = 8, fill: float = 0.95, steps: int = 3,
            per_replica: int = 2048, tmpfs_sizes: list[int] | tuple[int, ...] = (), kinds: tuple[str, ...] = ("idle", "tool"),
            variants: list[Variant] | None = None, goal_n: int = GOAL_N, goal_ms: float = GOAL_EXCESS_MS,
            timeout_s: float | dict[int, float] = 420.0, log: Log | None = None) -> dict[str, Any]:
    """Every (variant, N, storage) row, idle and tool runs; ``timeout_s``: per run, or per N (a dict)."""
    log = log or make_log("snapshot-cost")
    variants = variants or DEFAULT_VARIANTS
    shm = tmpfs_root()
    log(f"run config laid over every run: {', '.join(RUN_SETTINGS)} (so a burst of failed attempts does not "
        f"stop the run; rollout_recovery.gym_park_grace_s left at its default); N > {per_replica} uses "
        f"ceil(N / {per_replica}) Gym replicas")
    rows = []
    for label, extra in variants:
        for n in sizes:
            storages = ["disk"] + (["tmpfs"] if n in tmpfs_sizes and shm is not None else [])
            for storage in storages:
                row = {"variant": label, "n": n, "storage": storage}
                for kind in kinds:
                    row[kind] = _one(Path(workdir) / f"cost-{label}-{n}-{storage}-{kind}", n, kind, storage, shm,
                                     extra, repeats=repeats, steps=steps, tool_s=tool_s,
                                     delay_s=tool_delay_s if kind == "tool" else delay_s, interval_s=interval_s,
                                     generations=generations, fill=fill, per_replica=per_replica,
                                     timeout_s=_timeout(timeout_s, n), log=log)
                rows.append(_row(row, kinds))
    fits = {}
    for label, _ in variants:
        for storage in ("disk", "tmpfs"):
            mine = [r for r in rows if r["variant"] == label and r["storage"] == storage and r.get("idle")]
            if len(mine) >= 2:
                fits[f"{label}/{storage}"] = {
                    f: growth([r["n"] for r in mine], [(basis(r).get(f) or {}).get("median") for r in mine])
                    for f in ("pause_s", *(f"{p}_s" for p in PHASES), "bytes")}
    return {"name": NAME, "title": TITLE, "rows": rows, "fits": fits,
            "goal": goal_of(rows, variants, goal_n, goal_ms),
            "config": {"sizes": sizes, "repeats": repeats, "tool_s": tool_s, "backend_delay_s": delay_s,
                       "backend_delay_s_tool_runs": tool_delay_s,
                       "backend_max_num_seqs": BACKEND_BATCH, "snapshot_interval_s": interval_s,
                       "generations": generations, "fill": fill, "per_replica": per_replica,
                       "tmpfs_sizes": list(tmpfs_sizes), "kinds": list(kinds),
                       "variants": [{"label": v[0], "overrides": v[1]} for v in variants],
                       "max_num_steps": steps, "run_settings": list(RUN_SETTINGS),
                       "timeout_s": {str(k): v for k, v in timeout_s.items()} if isinstance(timeout_s, dict)
                       else timeout_s,
                       "setup": f"{CONFIG}, scripted backend, recording trainer, steps of N rollouts each "
                                "(stopped once enough snapshots are in)"}}


def _timeout(timeout_s: float | dict[int, float], n: int) -> float:
    """A run's limit: ``timeout_s``, or its entry for N (an N it does not list gets the largest)."""
    if not isinstance(timeout_s, dict):
        return float(timeout_s)
    return float(timeout_s.get(n, max(timeout_s.values())))


def _shape(n: int, generations: int) -> tuple[int, int]:
    gens = min(generations, n)
    return max(1, n // gens), gens


def _one(root: Path, n: int, kind: str, storage: str, shm: Path | None, extra: list[str], *, repeats: int, steps: int,
         tool_s: float, delay_s: float, interval_s: float, generations: int, fill: float, per_replica: int,
         timeout_s: float, log: Log) -> dict[str, Any]:
    prompts, gens = _shape(n, generations)
    replicas = max(1, math.ceil(n / per_replica))
    overrides = [
        f"grpo.max_num_steps={steps}", f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={gens}",
        f"rollout_checkpointing.snapshot_attempt_interval_s={interval_s}",
        "rollout_checkpointing.keep_latest_k=100000", *RUN_SETTINGS,
        f"policy.scripted_backend.max_num_seqs={BACKEND_BATCH}",
    ]
    if replicas > 1:
        overrides.append(f"env.nemo_gym.shards=[{{name: nemo_gym, replicas: {replicas}}}]")
    if kind == "tool":
        overrides.append(workplace_tool_delays(tool_s))
    overrides += extra
    ckpt = None
    if storage == "tmpfs":
        assert shm is not None
        ckpt = shm / f"bench-recovery-{os.getpid()}-{root.name}"
    full = math.ceil(fill * n)
    checked = {"at": 0.0, "done": False}
    every_s = max(0.5, n / 4096)  # reading the run's files is work on the cores the run uses

    def enough(dirs, elapsed: float) -> bool:
        """``repeats`` steady committed snapshots of >= ``full`` rollouts (tool runs: each with a tool
        call in flight)."""
        if elapsed - checked["at"] < every_s:
            return checked["done"]
        checked["at"] = elapsed
        snaps = dirs.records("snapshots.jsonl")
        kept = [s for s, (c, _) in zip(snaps, attempt_classes(snaps))
                if c == STEADY and s.get("committed") and in_flight(s) >= full]
        if len(kept) >= repeats:  # then also their timing lines (and, for tool runs, a tool call in flight)
            timed = _analyse_files(root, snaps, full, tool_s, kind == "tool")
            checked["done"] = sum(1 for a in timed if a["class"] == STEADY
                                  and (kind != "tool" or a.get("excess_s") is not None)) >= repeats
        return checked["done"]

    log(f"N={n} ({prompts}x{gens}, {replicas} replica(s)) {kind} {storage}: run until {repeats} steady snapshots "
        f"of >= {full} rollouts" + (" with a tool call in flight" if kind == "tool" else ""))
    try:
        run = controller_run(root, config=CONFIG, overrides=overrides, delay_s=delay_s, timeout_s=timeout_s,
                             kill_when=enough, tool_log=kind == "tool", checkpoint_dir=ckpt)
        res = _analyse(run, n, full, kind, tool_s)
    finally:
        if ckpt is not None:
            import shutil

            shutil.rmtree(ckpt, ignore_errors=True)
    res.update(prompts=prompts, generations=gens, replicas=replicas, per_replica=per_replica, command=run.command,
               stragglers=run.outcome.leftover, ended=run.outcome.killed_by or f"exit {run.outcome.returncode}")
    c = res["counts"]
    steady = [a["pause_s"] for a in res["attempts"] if a["class"] == STEADY]
    burst = [a["pause_s"] for a in res["attempts"] if a["class"] == BURST]
    log(f"  {len(res['attempts'])} snapshots at N >= {full} ({c['kept_steady']} steady, {c['kept_burst']} burst) "
        f"of {len(run.snapshots)} attempts ({committed_count(run.dirs)} committed, {c['failed']} failed"
        + (f": {_reasons(c['failed_by_reason'])}" if c["failed"] else "") + "); pause median steady "
        f"{_ms(steady)}, burst {_ms(burst)}"
        + (f"; {len(res['with_tool'])} with a tool in flight ({c['kept_steady_with_tool']} steady)"
           if kind == "tool" else "") + f"; ended: {res['ended']}")
    return res


def _ms(values: list[float]) -> str:
    med = summary(values)["median"]
    return "—" if med is None else f"{med * 1e3:.0f} ms"


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {k}" for reason, k in sorted(counts.items()))


def attempt_classes(snapshots: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """``(class, why)`` per ``snapshots.jsonl`` record, in the order the controller took them.

    ``burst`` (Gym had not yet received every rollout the step dispatched) with why:
    ``not_admitted`` (the cut found rollouts dispatched that Gym never saw), ``gym_unavailable`` (the
    attempt failed: a replica could not answer or be parked in time), ``before_not_admitted`` (a later
    attempt of the same step still found ``not_admitted > 0``: this one started before the step's
    last rollout reached Gym). Every other attempt is ``steady`` (why None). A ``gym_unavailable``
    failure does not reclassify the attempts before it: it can also have other causes."""
    signal: list[str | None] = []
    last_not_admitted: dict[Any, int] = {}
    for i, s in enumerate(snapshots):
        if int(s.get("not_admitted") or 0) > 0:
            signal.append("not_admitted")
            last_not_admitted[s.get("step")] = i
        elif not s.get("committed") and s.get("reason") == "gym_unavailable":
            signal.append("gym_unavailable")
        else:
            signal.append(None)
    out: list[tuple[str, str | None]] = []
    for i, s in enumerate(snapshots):
        if signal[i] is not None:
            out.append((BURST, signal[i]))
        elif i < last_not_admitted.get(s.get("step"), -1):
            out.append((BURST, "before_not_admitted"))
        else:
            out.append((STEADY, None))
    return out


def _analyse(run: ControllerRun, n: int, full: int, kind: str, tool_s: float) -> dict[str, Any]:
    chosen = _attempt_records(run.snapshots, run.attempts, run.tool_calls if kind == "tool" else None, full, tool_s)
    with_tool = [a for a in chosen if a.get("excess_s") is not None]
    classes = attempt_classes(run.snapshots)
    failed = [{"reason": s.get("reason"), "pause_s": s.get("pause_s"), "step": s.get("step"),
               "class": c, "burst_reason": why}
              for s, (c, why) in zip(run.snapshots, classes) if not s.get("committed")]
    return {"attempts": chosen, "with_tool": with_tool, "all_attempts": len(run.snapshots), "failed": failed,
            "counts": attempt_counts(run.snapshots, classes, chosen, with_tool, full)}


def attempt_counts(snapshots: list[dict[str, Any]], classes: list[tuple[str, str | None]],
                   kept: list[dict[str, Any]], with_tool: list[dict[str, Any]], full: int) -> dict[str, Any]:
    """Every attempt of a run by what became of it: kept (committed, >= ``full`` rollouts, timed) by
    class; committed with fewer rollouts; failed by reason and class; superseded (training moved on:
    not a failure)."""
    failed = [(s, c) for s, (c, _) in zip(snapshots, classes)
              if not s.get("committed") and s.get("reason") != "superseded"]
    under = [s for s in snapshots if s.get("committed") and in_flight(s) < full]
    return {
        "attempts": len(snapshots),
        "committed": sum(1 for s in snapshots if s.get("committed")),
        "kept": len(kept),
        "kept_steady": sum(1 for a in kept if a["class"] == STEADY),
        "kept_burst": sum(1 for a in kept if a["class"] == BURST),
        "kept_burst_because": dict(Counter(a["burst_reason"] for a in kept if a["class"] == BURST)),
        "kept_steady_with_tool": sum(1 for a in with_tool if a["class"] == STEADY),
        "committed_under_fill": len(under),
        "max_in_flight": max((in_flight(s) for s in snapshots), default=0),
        "failed": len(failed),
        "failed_burst": sum(1 for _, c in failed if c == BURST),
        "failed_by_reason": dict(Counter(str(s.get("reason")) for s, _ in failed)),
        "failed_pause_s": summary(float(s.get("pause_s") or 0.0) for s, _ in failed),
        "superseded": sum(1 for s in snapshots if not s.get("committed") and s.get("reason") == "superseded"),
    }


def _analyse_files(root: Path, snapshots: list[dict[str, Any]], full: int, tool_s: float,
                   tools: bool) -> list[dict[str, Any]]:
    """The same records from the files of a run still going (for its stop condition)."""
    return _attempt_records(snapshots, timed_attempts(read_jsonl(root / "snapshot-timing.jsonl")),
                            read_jsonl(root / "tool-calls.jsonl") if tools else None, full, tool_s, with_bytes=False)


def _attempt_records(snapshots, attempts, tool_calls, full: int, tool_s: float,
                     with_bytes: bool = True) -> list[dict[str, Any]]:
    """One record per committed snapshot of >= ``full`` rollouts: pause, phases, bytes, its class
    (``attempt_classes`` over every record of the run) and, given the tool calls, the longest call
    still running when prepare began and the pause beyond it."""
    by_id = {a.get("checkpoint_id"): a for a in attempts}
    out = []
    for s, (cls, why) in zip(snapshots, attempt_classes(snapshots)):
        if not s.get("committed") or in_flight(s) < full:
            continue
        a = by_id.get(s["checkpoint_id"])
        if not a or not a.get("phases_s"):
            continue  # its timing lines are not written yet: the stop condition waits for them
        phases = a.get("phases_s", {})
        path = Path(s["path"]) if s.get("path") else None
        by_server = s.get("captured_bytes_by_server")
        rec = {"checkpoint_id": s["checkpoint_id"], "in_flight": in_flight(s), "saved": s.get("saved", 0),
               "not_admitted": int(s.get("not_admitted") or 0), "step": s.get("step"), "class": cls,
               "burst_reason": why, "started_at": a.get("start"), "pause_s": s["pause_s"],
               "persist_s": s.get("persist_s"), "commit_mode": s.get("commit_mode"),
               "captured_bytes": s.get("captured_bytes"),
               "captured_bytes_by_server": {str(k): v for k, v in by_server.items() if isinstance(v, (int, float))}
               if isinstance(by_server, dict) else {},
               **{f"{p}_s": phases.get(p) for p in PHASES},
               "other_phases_s": {k: v for k, v in phases.items() if k not in PHASES},
               "bytes": dir_bytes(path) if with_bytes and path is not None and path.exists() else None}
        prepare_at = a.get("first_start", {}).get("prepare")
        if tool_calls is not None and prepare_at is not None:
            left = [c["end"] - prepare_at for c in tool_calls
                    if c.get("status") == 200 and c["end"] > prepare_at and c["end"] - tool_s < prepare_at]
            rec["tools_in_flight"] = len(left)
            rec["tool_left_s"] = max(left) if left else None
            if left:
                rec["excess_s"] = s["pause_s"] - max(left)
        out.append(rec)
    return out


def _idle_figures(a: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "in_flight": summary(x["in_flight"] for x in a),
        "pause_s": summary(x["pause_s"] for x in a),
        "persist_s": summary(x["persist_s"] for x in a if x.get("persist_s") is not None),
        **{f"{p}_s": summary(x[f"{p}_s"] for x in a if x.get(f"{p}_s") is not None) for p in PHASES},
        "bytes": summary(x["bytes"] for x in a if x.get("bytes")),
        "bytes_per_rollout": summary(x["bytes"] / x["in_flight"] for x in a if x.get("bytes") and x["in_flight"]),
    }


def _tool_figures(with_tool: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tool_pause_s": summary(x["pause_s"] for x in with_tool),
            "tool_left_s": summary(x["tool_left_s"] for x in with_tool),
            "excess_s": summary(x["excess_s"] for x in with_tool)}


def _classified(runs: list[dict[str, Any]]) -> bool:
    """Whether every kept attempt carries its class (rows stored before the classes existed do not)."""
    return all("class" in x for r in runs for x in r["attempts"])


def _row(row: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, Any]:
    """The row's figures over all kept attempts (top-level keys) and, where the attempts are
    classified, the same figures over its ``steady`` and its ``burst`` attempts apart."""
    idle, tool = row.get("idle"), row.get("tool")
    runs = [r for r in (idle, tool) if r is not None]
    if idle is not None:
        row.update(_idle_figures(idle["attempts"]), replicas=idle["replicas"])
    if tool is not None:
        row.update(_tool_figures(tool["with_tool"]))
        row["replicas"] = row.get("replicas", tool["replicas"])
    if runs and _classified(runs):
        for cls in (STEADY, BURST):
            part: dict[str, Any] = {}
            if idle is not None:
                part.update(_idle_figures([x for x in idle["attempts"] if x["class"] == cls]))
            if tool is not None:
                part.update(_tool_figures([x for x in tool["with_tool"] if x["class"] == cls]))
            row[cls] = part
    row["attempt_counts"] = {k: row[k]["counts"] for k in kinds if row.get(k) is not None and "counts" in row[k]}
    measured = [x for k in kinds if row.get(k) is not None for x in row[k]["attempts"]]
    row["staged_memory"] = staged_memory(measured)
    return row


def basis(row: dict[str, Any]) -> dict[str, Any]:
    """The figures the goals use: the row's steady attempts, or all kept ones for a row stored before
    attempts were classified."""
    steady = row.get(STEADY)
    return steady if isinstance(steady, dict) else row


def participant_of(key: str) -> str:
    """``"<gym instance id>/<server>"`` -> the server (an instance id holds a ``/`` itself)."""
    return str(key).rsplit("/", 1)[-1]


def staged_memory(attempts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the staged copies held, over the attempts committed in ``staged`` mode (None: there were none).

    Per participant (server name; replicas aggregated by max): ``peak_bytes`` = the largest copy one
    replica of it held in any attempt, ``bytes`` = that per attempt, ``bytes_per_rollout`` = its copies
    on every replica over the rollouts the attempt dealt with. ``total_*``: ``captured_bytes`` (every
    participant plus the controller's data plane); ``controller_bytes``: what the total holds beyond the
    participants (only where both were recorded)."""
    staged = [a for a in attempts if a.get("commit_mode") == "staged"]
    if not staged:
        return None
    per: dict[str, dict[str, list[float]]] = {}
    controller = []
    for a in staged:
        by_key = a.get("captured_bytes_by_server") or {}
        peak: dict[str, float] = {}
        total: dict[str, float] = {}
        for key, size in by_key.items():
            server = participant_of(key)
            peak[server] = max(peak.get(server, 0), size)
            total[server] = total.get(server, 0) + size
        for server in peak:
            d = per.setdefault(server, {"bytes": [], "per_rollout": []})
            d["bytes"].append(peak[server])
            if a.get("in_flight"):
                d["per_rollout"].append(total[server] / a["in_flight"])
        if by_key and isinstance(a.get("captured_bytes"), (int, float)):
            controller.append(a["captured_bytes"] - sum(by_key.values()))
    totals = [a for a in staged if isinstance(a.get("captured_bytes"), (int, float))]
    return {
        "attempts": len(staged),
        "attempts_with_participants": sum(1 for a in staged if a.get("captured_bytes_by_server")),
        "participants": {server: {"attempts": len(d["bytes"]), "peak_bytes": max(d["bytes"]),
                                  "bytes": summary(d["bytes"]), "bytes_per_rollout": summary(d["per_rollout"])}
                         for server, d in sorted(per.items())},
        "total_peak_bytes": max((a["captured_bytes"] for a in totals), default=None),
        "total_bytes": summary(a["captured_bytes"] for a in totals),
        "total_bytes_per_rollout": summary(a["captured_bytes"] / a["in_flight"] for a in totals if a.get("in_flight")),
        "controller_bytes": summary(controller),
    }


def commit_modes(variants: list[Any]) -> dict[str, str]:
    """Variant label -> the commit mode its overrides set (``rollout_checkpointing.commit_mode=...``;
    the last such override wins). Variants are ``(label, overrides)`` or ``{"label", "overrides"}``."""
    out = {}
    for v in variants:
        label, overrides = (v["label"], v.get("overrides") or []) if isinstance(v, dict) else (v[0], v[1])
        for o in overrides:
            o = str(o).strip().lstrip("+")
            if o.startswith(COMMIT_MODE):
                out[label] = o[len(COMMIT_MODE):].strip().strip("'\"")
    return out


def _idle_pause(rows: list[dict[str, Any]], variant: str, n: int) -> float | None:
    r = next((r for r in rows if r["variant"] == variant and r["n"] == n and r["storage"] == "disk"
              and (basis(r).get("pause_s") or {}).get("n")), None)
    return None if r is None else basis(r)["pause_s"]["median"]


def _excess_goal(rows: list[dict[str, Any]], variant: str, n: int, goal_ms: float, storage: str) -> dict[str, Any]:
    r = next((r for r in rows if r["variant"] == variant and r["n"] == n and r["storage"] == storage
              and (basis(r).get("excess_s") or {}).get("n")), None)
    if r is None:
        return {"met": None, "note": f"N={n} not measured"}
    e = basis(r)["excess_s"]
    return {"excess_ms_median": e["median"] * 1e3, "excess_ms_max": e["max"] * 1e3, "attempts": e["n"],
            "met": e["median"] * 1e3 <= goal_ms}


def _growth_goal(rows: list[dict[str, Any]], variant: str, lo_n: int, hi_n: int, most: float) -> dict[str, Any]:
    lo, hi = _idle_pause(rows, variant, lo_n), _idle_pause(rows, variant, hi_n)
    ratio = hi / lo if lo and hi is not None else None
    return {"pause_ms_from": None if lo is None else lo * 1e3, "pause_ms_to": None if hi is None else hi * 1e3,
            "ratio": ratio, "met": None if ratio is None else ratio <= most}


def goal_of(rows: list[dict[str, Any]], variants: list[Any], goal_n: int = GOAL_N,
            goal_ms: float = GOAL_EXCESS_MS) -> dict[str, Any]:
    """The issue's goals, per variant. Pause: the median excess over the tool call in flight at
    ``goal_n`` is at most ``goal_ms`` (worst attempt reported too). Growth: the idle pause's median
    (disk) grows at most ``GROWTH_MAX`` from N = ``GROWTH_FROM_N`` to ``GROWTH_TO_N`` (the log-log slope
    over all N and the per-step check are kept alongside). Staged versus blocking: at
    ``RATIO_AT_N`` the idle pause (disk) of the variant whose overrides set ``commit_mode=staged``
    over that of the one setting ``blocking`` is at most ``STAGED_OVER_BLOCKING_MAX``. ``large``: the
    same pause goal at ``LARGE_N`` within ``LARGE_EXCESS_MS`` (disk), and the growth from
    ``LARGE_GROWTH_FROM_N`` to ``LARGE_N`` at most ``LARGE_GROWTH_MAX``. Every figure is a row's steady
    attempts (``basis``)."""
    labels = [v["label"] if isinstance(v, dict) else v[0] for v in variants]
    classified = any(isinstance(r.get(STEADY), dict) for r in rows)
    goal: dict[str, Any] = {"pause_within_ms_of_longest_tool": goal_ms, "at_n": goal_n,
                            "growth_from_n": GROWTH_FROM_N, "growth_to_n": GROWTH_TO_N, "growth_max": GROWTH_MAX,
                            "large": {"at_n": LARGE_N, "pause_within_ms_of_longest_tool": LARGE_EXCESS_MS,
                                      "growth_from_n": LARGE_GROWTH_FROM_N, "growth_to_n": LARGE_N,
                                      "growth_max": LARGE_GROWTH_MAX},
                            "basis": ("steady attempts (Gym had received every rollout the step dispatched)"
                                      if classified else "all kept attempts (stored before attempts were classified)"),
                            "by_variant": {}}
    for v in labels:
        g: dict[str, Any] = {storage: _excess_goal(rows, v, goal_n, goal_ms, storage) for storage in ("disk", "tmpfs")}
        idle = [r for r in rows if r["variant"] == v and r["storage"] == "disk"
                and (basis(r).get("pause_s") or {}).get("n")]
        fit = growth([r["n"] for r in idle], [basis(r)["pause_s"]["median"] for r in idle])
        slope = fit.get("loglog_slope")
        g["pause_loglog_slope"] = slope
        g["every_step_within_linear"] = fit.get("no_worse_than_linear")
        g["linear_met"] = None if slope is None else (slope <= 1.05 and fit.get("no_worse_than_linear") is not False)
        g["growth"] = _growth_goal(rows, v, GROWTH_FROM_N, GROWTH_TO_N, GROWTH_MAX)
        g["large"] = {"disk": _excess_goal(rows, v, LARGE_N, LARGE_EXCESS_MS, "disk"),
                      "growth": _growth_goal(rows, v, LARGE_GROWTH_FROM_N, LARGE_N, LARGE_GROWTH_MAX)}
        goal["by_variant"][v] = g
    modes = commit_modes(variants)
    staged = next((v for v in labels if modes.get(v) == "staged"), None)
    blocking = next((v for v in labels if modes.get(v) == "blocking"), None)
    sb: dict[str, Any] = {"at_n": RATIO_AT_N, "max_ratio": STAGED_OVER_BLOCKING_MAX, "staged": staged,
                          "blocking": blocking, "ratio": None, "met": None}
    if staged is None or blocking is None:
        sb["note"] = f"needs variants with {COMMIT_MODE}staged and {COMMIT_MODE}blocking"
    else:
        ps, pb = _idle_pause(rows, staged, RATIO_AT_N), _idle_pause(rows, blocking, RATIO_AT_N)
        sb.update(staged_pause_ms=None if ps is None else ps * 1e3, blocking_pause_ms=None if pb is None else pb * 1e3)
        if ps is None or not pb:
            sb["note"] = f"N={RATIO_AT_N} (idle, disk) not measured for {staged!r} and {blocking!r}"
        else:
            sb.update(ratio=ps / pb, met=ps / pb <= STAGED_OVER_BLOCKING_MAX)
    goal["staged_over_blocking"] = sb
    first = goal["by_variant"].get(labels[0], {}) if labels else {}
    goal["pause_met"] = first.get("disk", {}).get("met")
    goal["linear_met"] = first.get("linear_met")
    goal["growth_met"] = first.get("growth", {}).get("met")
    goal["large_pause_met"] = first.get("large", {}).get("disk", {}).get("met")
    goal["large_growth_met"] = first.get("large", {}).get("growth", {}).get("met")
    goal["linear_basis"] = ("idle pause on disk: log-log slope over all N at most 1 (+0.05) and every step at "
                            "most its N ratio (+10%)")
    return goal


def rederive(res: dict[str, Any]) -> dict[str, Any]:
    """Per-row figures (all, steady, burst), memory figures and the verdicts again from the stored
    attempts, with today's goals."""
    for row in res["rows"]:
        _row(row, tuple(k for k in res["config"].get("kinds", ("idle", "tool")) if row.get(k)))
    res["goal"] = goal_of(res["rows"], res["config"]["variants"])
    return res


def _persist(row: dict[str, Any]) -> str:
    """Persist after resume: only staged commits have one (blocking records 0)."""
    p = row.get("persist_s")
    return "—" if not p or not p.get("n") or not p.get("max") else fmt(p, 1e3)


def _counts_cell(row: dict[str, Any], kind: str) -> str:
    """``steady / burst / failed`` attempts of one run (``—``: not run or not counted)."""
    c = (row.get("attempt_counts") or {}).get(kind)
    if not c:
        return "—"
    return f"{c['kept_steady']} / {c['kept_burst']} / {c['failed']}"


def table(res: dict[str, Any]) -> str:
    tool_s = res["config"]["tool_s"]
    several = len(res["config"]["variants"]) > 1
    classified = any(isinstance(r.get(STEADY), dict) for r in res["rows"])
    goals = "steady: goals" if classified else "all kept: goals"
    head = (["variant"] if several else []) + [
        "N", "replicas", "storage", "in flight", "idle attempts steady / burst / failed", f"pause ms ({goals})",
        "pause ms, burst", "pause ms, all kept", "prepare ms", "commit ms", "publish ms", "resume ms",
        "persist after resume ms", "MB per snapshot", "KB/rollout", "tool attempts steady / burst / failed",
        f"pause ms, {tool_s:g}s tools in flight", "tool time left at prepare ms", f"excess over tool ms ({goals})",
        "excess over tool ms, all kept"]
    body = []
    for r in res["rows"]:
        b, burst = basis(r), r.get(BURST) or {}
        body.append(([r["variant"]] if several else []) + [
            r["n"], r.get("replicas", "—"), r["storage"], fmt(r.get("in_flight")), _counts_cell(r, "idle"),
            fmt(b.get("pause_s"), 1e3), fmt(burst.get("pause_s"), 1e3), fmt(r.get("pause_s"), 1e3),
            fmt(b.get("prepare_s"), 1e3), fmt(b.get("commit_s"), 1e3), fmt(b.get("publish_s"), 1e3),
            fmt(b.get("resume_s"), 1e3), _persist(b), fmt(b.get("bytes"), 1e-6, 2),
            fmt(b.get("bytes_per_rollout"), 1e-3, 1), _counts_cell(r, "tool"), fmt(b.get("tool_pause_s"), 1e3),
            fmt(b.get("tool_left_s"), 1e3), fmt(b.get("excess_s"), 1e3), fmt(r.get("excess_s"), 1e3)])
    per_replica = res["config"].get("per_replica")
    settings = ", ".join(f"`{x}`" for x in res["config"].get("run_settings", RUN_SETTINGS))
    out = [md_table(head, body), "",
           ("**Goals are evaluated on steady attempts**; so are the phase, bytes and tool columns. " if classified
            else "**Goals are evaluated on all kept attempts** (stored before attempts were classified). ")
           + "An attempt is *burst* while Gym had not yet received every rollout the step dispatched: its cut "
           "found `not_admitted > 0`, it failed `gym_unavailable`, or a later attempt of the same step still "
           "found `not_admitted > 0`; every other attempt is *steady*. Kept = committed with at least "
           f"{res['config'].get('fill', 0.95):.0%} of N in flight; failed attempts are counted apart (they held "
           "rollouts too: their pauses are in the attempts table). Replicas: one Gym replica per "
           + (f"{per_replica:,} rollouts" if per_replica else "`per_replica` rollouts")
           + f" (`ceil(N / per_replica)`). Every run sets {settings}, "
           "so a burst of failed attempts does not stop it."]
    grow = []
    for key, fits in res["fits"].items():
        for f, label in (("pause_s", "pause"), ("commit_s", "commit"), ("publish_s", "publish"), ("bytes", "bytes")):
            g = fits.get(f, {})
            if "loglog_slope" not in g:
                continue
            steps = ", ".join(f"{s['from']}→{s['to']}: x{s['per_8x']:.2f}" for s in g["steps"])
            lin = g["linear_fit"]
            unit, scale = ("KB", 1e-3) if f == "bytes" else ("ms", 1e3)
            grow.append([key, label, f"{g['loglog_slope']:.2f}", steps,
                         f"{lin['intercept'] * scale:,.1f} {unit} + {lin['per_rollout'] * scale * 1000:,.1f} "
                         f"{unit} per 1000 rollouts"])
    if grow:
        out += ["", md_table([f"variant/storage ({'steady' if classified else 'all kept'} attempts)", "cost",
                              "log-log slope", "growth per 8x in N, each step", "linear fit"], grow)]
    out += ["", attempts_table(res), "", memory_table(res)]
    return "\n".join(out)


def attempts_table(res: dict[str, Any]) -> str:
    """Every attempt of every run, by what became of it (nothing dropped silently)."""
    body = []
    for r in res["rows"]:
        for kind, c in (r.get("attempt_counts") or {}).items():
            because = c.get("kept_burst_because") or {}
            burst = (r.get(BURST) or {}).get("pause_s" if kind == "idle" else "tool_pause_s")
            kept_burst = f"{c['kept_burst']} ({_reasons(because)})" if because else c["kept_burst"]
            body.append([r["variant"], r["n"], r.get("replicas", "—"), r["storage"], kind, c["attempts"],
                         c["kept_steady"], kept_burst,
                         f"{c['committed_under_fill']} (most in flight {c['max_in_flight']:,})",
                         c["failed"] if not c["failed"] else f"{c['failed']} ({_reasons(c['failed_by_reason'])})",
                         c["failed_burst"], c["superseded"], fmt(c.get("failed_pause_s"), 1e3),
                         fmt(burst, 1e3)])
    if not body:
        return "Attempts by class: not recorded (results stored before attempts were counted)."
    head = ["variant", "N", "replicas", "storage", "run", "attempts", "kept steady", "kept burst (why)",
            "committed under fill", "failed (reason)", "failed in burst", "superseded", "failed attempts' pause ms",
            "kept burst pause ms"]
    return ("Attempts by class, per run. *why*: `not_admitted` (the cut found rollouts Gym never saw), "
            "`before_not_admitted` (a later attempt of the step still did), `gym_unavailable` (a replica could not "
            "answer or be parked in time). For tool runs the burst pause counts attempts with a tool in flight.\n\n"
            + md_table(head, body))


def memory_table(res: dict[str, Any]) -> str:
    """Peak memory of the staged copies, per variant with staged commits, N and participant."""
    body = []
    missing = False
    for r in res["rows"]:
        m = r.get("staged_memory")
        if not m:
            continue
        where = [r["variant"], r["n"], r["storage"]]
        for server, p in m["participants"].items():
            body.append(where + [server, p["attempts"], f"{p['peak_bytes'] / 1e6:,.3f}",
                                 fmt(p["bytes"], 1e-6, 3), fmt(p["bytes_per_rollout"], 1e-3, 1)])
        if m["attempts_with_participants"] < m["attempts"]:
            missing = True
        if m["controller_bytes"]["n"]:
            body.append(where + ["(controller data plane)", m["controller_bytes"]["n"],
                                 f"{m['controller_bytes']['max'] / 1e6:,.3f}", fmt(m["controller_bytes"], 1e-6, 3),
                                 "—"])
        body.append(where + ["**all** (`captured_bytes`)", m["total_bytes"]["n"],
                             "—" if m["total_peak_bytes"] is None else f"{m['total_peak_bytes'] / 1e6:,.3f}",
                             fmt(m["total_bytes"], 1e-6, 3), fmt(m["total_bytes_per_rollout"], 1e-3, 1)])
    if not body:
        return ("Staged copies in memory: no measured snapshot was recorded as a `staged` commit (`commit_mode` in "
                "`snapshots.jsonl`; records written before that field existed have none).")
    head = ["variant", "N", "storage", "participant", "staged commits", "peak MB", "MB per commit",
            "KB per rollout in flight"]
    note = ("Staged copies held in memory between the cut and the write after resume, over the measured "
            "snapshots (idle and tool runs). A participant's MB are the largest copy one replica of it held "
            "(`snapshots.jsonl`: `captured_bytes_by_server`, replicas aggregated by max), its KB per rollout are "
            "its copies on every replica over the rollouts in flight; **all** is `captured_bytes` (every "
            "participant plus the controller's data plane).")
    if missing:
        note += (" Some staged commits recorded no `captured_bytes_by_server` (a controller that does not report "
                 "it): only their total is shown.")
    return note + "\n\n" + md_table(head, body)
