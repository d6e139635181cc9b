"""Measurement 1: snapshot cost versus rollouts in flight (Gym level).

N ``simple_agent`` sessions on Workplace are parked mid-episode: each has done
turn 1 (model call + tool) and waits on its turn-2 reply, which the scripted
backend holds. The population stays frozen while the benchmark takes
controller-like snapshots of it (prepare -> commit -> publish -> resume), so
every repeat measures the control plane on exactly N live sessions.

Two kinds of snapshot per repeat:
- ``idle``: no tool call in flight; the pause is pure control-plane cost.
- ``tool``: a probe rollout (its own agent, model and Workplace, so it is never
  starved by the held population) is inside a slow tool call (``tool_s``) when
  prepare starts; the snapshot must wait for it. ``excess`` = pause minus the
  least that tool call could still have had to run (it started after the last
  status poll that did not see it), i.e. an upper bound on the pause the tool
  did not hide.

Sizing: an agent process talks to the model through aiohttp's default
connector (100 connections) and every parked session holds one, so the
deployment gets one ``simple_agent`` per ``per_agent`` (64) sessions. The
model server's own backend connector is also capped at 100; sessions beyond
that wait for a connection inside the model server, which for a snapshot is
the same state (waiting on the model at their last boundary). So that the
held turn-2 calls cannot starve turn-1 calls of those 100 connections, the
population's turn-1 tools are slowed down (``stage_s``) until every session
has its turn-1 reply; they are never called again afterwards.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    co,
    Control,
    Log,
    fmt,
    fresh_dir,
    growth,
    load_rows,
    make_log,
    md_table,
    model_server,
    agent_server,
    running,
    summary,
    take_snapshot,
    tools_of,
    unique_user_rows,
    user_of,
    workplace_server,
    EpisodeId,
)

NAME = "snapshot_cost"
TITLE = "1. Snapshot cost versus rollouts in flight"
MODEL, WORKPLACE = "policy_model", "workplace"
PROBE_MODEL, PROBE_WORKPLACE, PROBE_AGENT = "probe_model", "probe_workplace", "probe_agent"
PROBE_TOOLS = ("tasks_search", "tasks_update")  # turn 2 calls tasks_update, made slow on the probe's Workplace
SLOW_TOOL = "tasks_update"


def _agents(n: int, per_agent: int) -> list[str]:
    return [f"agent_{i:02d}" for i in range(max(1, math.ceil(n / per_agent)))]


def tmpfs_root() -> Path | None:
    """A RAM-backed directory (fsync is free there), to separate disk cost from the rest."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return None


def measure(*, sizes: list[int], repeats: int, workdir: Path, tool_s: float = 0.5, per_agent: int = 64,
            goal_n: int = 512, goal_ms: float = 100.0, with_tmpfs: bool = True, log: Log | None = None
            ) -> dict[str, Any]:
    log = log or make_log("snapshot-cost")
    all_rows = load_rows("workplace_train.jsonl")
    uniq = unique_user_rows(all_rows)
    probe_row = next(r for r in uniq if tools_of(r) == PROBE_TOOLS)
    population = [r for r in all_rows if user_of(r) != user_of(probe_row)]
    shm = tmpfs_root() if with_tmpfs else None
    per_n: list[dict[str, Any]] = []
    for n in sizes:
        agents = _agents(n, per_agent)
        # only needed once held calls could take all 100 model->backend connections
        stage_s = 0.0 if n <= 64 else max(2.0, n / 150)
        first_tools = {tools_of(r)[0] for r in population}
        log(f"N={n}: starting {len(agents)} simple_agent(s) + model + Workplace + probe servers")

        def servers(_url: str, agents: list[str] = agents, stage_s: float = stage_s) -> dict[str, Any]:
            out: dict[str, Any] = {MODEL: model_server(),
                                   WORKPLACE: workplace_server({t: stage_s for t in first_tools} if stage_s else None),
                                   PROBE_MODEL: model_server(),
                                   PROBE_WORKPLACE: workplace_server({SLOW_TOOL: tool_s}),
                                   PROBE_AGENT: agent_server("simple_agent", PROBE_MODEL, PROBE_WORKPLACE)}
            for a in agents:
                out[a] = agent_server("simple_agent", MODEL, WORKPLACE)
            return out

        anchors = {"disk": fresh_dir(workdir / f"ckpt-n{n}")}
        shm_dir = None
        if shm is not None:
            shm_dir = Path(tempfile.mkdtemp(prefix=f"bench-recovery-n{n}-", dir=shm))
            anchors["tmpfs"] = shm_dir
        started = time.monotonic()
        try:
            with running(all_rows, servers, workdir / f"logs-n{n}") as (backend, dep):
                log(f"N={n}: deployment up in {time.monotonic() - started:.1f}s")
                result = asyncio.run(_measure_n(n, agents, population, probe_row, backend, dep, repeats, tool_s,
                                                anchors, log))
        finally:
            if shm_dir is not None:
                shutil.rmtree(shm_dir, ignore_errors=True)
        per_n.append(result)
    return _finish(per_n, sizes, repeats, tool_s, per_agent, goal_n, goal_ms)


async def _measure_n(n, agents, population, probe_row, backend, dep, repeats, tool_s, anchors, log
                     ) -> dict[str, Any]:
    users = sorted({user_of(population[i % len(population)]) for i in range(n)})
    for u in users:  # every population session waits on its turn-2 reply
        await asyncio.to_thread(backend.hold, u, 1)
    out: dict[str, Any] = {"n": n, "agents": len(agents), "cycles": {}}
    async with Control.open(dep) as ctl:
        keys = [f"pop-{i:05d}" for i in range(n)]
        runs = [asyncio.create_task(ctl.run(agents[i % len(agents)], population[i % len(population)], k))
                for i, k in enumerate(keys)]
        try:
            await _until(lambda: _turn0_done(backend, n), f"{n} turn-1 replies", 180)
            await _until(lambda: _parked(ctl, agents, n), f"{n} sessions to wait on their turn-2 reply", 180)
            log(f"N={n}: {n} sessions parked mid-episode (turn 1 done, turn-2 reply held)")
            population_scope = [EpisodeId.from_capture_key(k) for k in keys]
            no_probe = ctl.without([PROBE_MODEL, PROBE_WORKPLACE, PROBE_AGENT])
            for r in range(repeats):
                line = []
                for storage, anchor in anchors.items():
                    snap = await take_snapshot(no_probe, checkpoint_id=f"idle-{storage}-{n}-{r}", policy="block",
                                               deadline_s=60, scope=population_scope, anchor=anchor)
                    _check(snap, n, "idle")
                    out["cycles"].setdefault(f"idle_{storage}", []).append(snap.as_dict())
                    probe = await _probe_in_tool(ctl, probe_row, f"probe-{storage}-{n}-{r}")
                    snap = await take_snapshot(ctl.parts, checkpoint_id=f"tool-{storage}-{n}-{r}", policy="block",
                                               deadline_s=60, anchor=anchor,
                                               scope=population_scope + [EpisodeId.from_capture_key(probe["key"])])
                    _check(snap, n + 1, "tool")
                    # the call started after ``before_s``: at least this much of it was left at prepare
                    remaining_min = max(0.0, tool_s - (snap.prepare_started - probe["before_s"]))
                    row = snap.as_dict()
                    row.update(tool_remaining_min_s=remaining_min, excess_s=snap.pause_s - remaining_min)
                    status, body = await asyncio.wait_for(probe["task"], 30)
                    if status != 200:
                        raise RuntimeError(f"probe rollout failed after the snapshot: {status} {body}")
                    out["cycles"].setdefault(f"tool_{storage}", []).append(row)
                    idle = out["cycles"][f"idle_{storage}"][-1]
                    line.append(f"{storage}: idle pause {idle['pause_s'] * 1e3:.0f} ms, with a {tool_s:g}s tool "
                                f"{row['pause_s'] * 1e3:.0f} ms (excess {row['excess_s'] * 1e3:.0f} ms)")
                log(f"N={n} repeat {r + 1}/{repeats}: " + "; ".join(line)
                    + f"; {out['cycles']['idle_disk'][-1]['bytes'] / 1e6:.2f} MB per snapshot")
            out["commit_by_server"] = await _commit_one_by_one(no_probe, population_scope, anchors["disk"], n)
            if not await _parked(ctl, agents, n):
                raise RuntimeError(f"N={n}: the population did not stay parked through the snapshots")
        finally:
            for t in runs:
                t.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    return out


async def _commit_one_by_one(parts, scope, anchor: Path, n: int) -> dict[str, Any]:
    """Diagnostic: prepare once, then let each participant commit alone, one after the
    other, to see where commit time goes without the servers competing for the CPU."""
    cid = f"diag-{n}"
    deadline = time.time() + 120
    target = anchor / f".diag-{n}"
    per_server: dict[str, float] = {}
    try:
        prep = await co.prepare(parts, cid, deadline, "block")
        if not prep.prepared:
            raise RuntimeError(f"diagnostic prepare for N={n} did not prepare: {prep.blockers}")
        for p in parts:
            t = time.perf_counter()
            await co.commit(co.Participants([p], parts.control), cid, deadline, str(target), scope)
            per_server[p.name] = time.perf_counter() - t
    finally:
        await co.resume(parts, cid, time.time() + 60)
        shutil.rmtree(target, ignore_errors=True)
    kinds: dict[str, list[float]] = {}
    for p in parts:
        kinds.setdefault(p.kind, []).append(per_server[p.name])
    return {"per_server_s": per_server,
            "by_kind": {k: {"servers": len(v), "sum_s": sum(v), "max_s": max(v)} for k, v in kinds.items()}}


def _check(snap, expected_saved: int, kind: str) -> None:
    if not snap.committed:
        raise RuntimeError(f"{kind} snapshot {snap.checkpoint_id} did not commit: blockers {snap.blockers}")
    if snap.saved != expected_saved:
        raise RuntimeError(f"{kind} snapshot {snap.checkpoint_id} saved {snap.saved} sessions, expected {expected_saved}")


async def _until(check, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.1)


async def _turn0_done(backend, n: int) -> bool:
    state = await asyncio.to_thread(backend.state)
    return sum(1 for c in state["calls"] if c["turn"] == 0) >= n


async def _parked(ctl: Control, agents: list[str], n: int) -> bool:
    reports = await asyncio.gather(*(ctl.status(a) for a in agents))
    waiting = sum(r["report"]["counts"].get("awaiting_model", 0) for r in reports)
    sessions = sum(r["report"]["counts"].get("sessions", 0) for r in reports)
    model = (await ctl.status(MODEL))["report"]["counts"]
    return waiting == n and sessions == n and model.get("inflight", 0) == n


async def _probe_in_tool(ctl: Control, row: dict[str, Any], key: str) -> dict[str, Any]:
    """Start the probe; return once its slow tool call is running, with the send time
    of the last status poll that still saw no call (the call started after it)."""
    last_before = time.monotonic()
    task = asyncio.create_task(ctl.run(PROBE_AGENT, row, key))
    deadline = time.monotonic() + 30
    while True:
        before = time.monotonic()
        counts = (await ctl.status(PROBE_WORKPLACE))["report"]["counts"]
        if counts.get("inflight", 0) >= 1:
            return {"task": task, "key": key, "before_s": last_before}
        last_before = before
        if task.done() or time.monotonic() > deadline:
            raise RuntimeError(f"probe {key} never reached its slow tool ({task.done() and task.result()})")
        await asyncio.sleep(0.002)


# -- results -----------------------------------------------------------------------------------
FIELDS = ("pause_s", "prepare_s", "commit_s", "publish_s", "resume_s", "bytes")


def _finish(per_n, sizes, repeats, tool_s, per_agent, goal_n, goal_ms) -> dict[str, Any]:
    storages = [k[len("idle_"):] for k in per_n[0]["cycles"] if k.startswith("idle_")] if per_n else []
    rows = []
    for r in per_n:
        for storage in storages:
            idle, tool = r["cycles"][f"idle_{storage}"], r["cycles"][f"tool_{storage}"]
            row: dict[str, Any] = {"n": r["n"], "agents": r["agents"], "storage": storage,
                                   "raw": {"idle": idle, "tool": tool}}
            for f in FIELDS:
                row[f] = summary(s[f] for s in idle)
            row["tool_pause_s"] = summary(s["pause_s"] for s in tool)
            row["tool_remaining_min_s"] = summary(s["tool_remaining_min_s"] for s in tool)
            row["excess_s"] = summary(s["excess_s"] for s in tool)
            row["bytes_per_rollout"] = summary(s["bytes"] / r["n"] for s in idle)
            if storage == "disk" and "commit_by_server" in r:
                row["commit_by_server"] = r["commit_by_server"]
            rows.append(row)
    fits: dict[str, Any] = {}
    for storage in storages:
        mine = [r for r in rows if r["storage"] == storage]
        ns = [r["n"] for r in mine]
        fits[storage] = {f: growth(ns, [r[f]["median"] for r in mine]) for f in (*FIELDS, "excess_s")}
    goal = goal_of(rows, fits, storages, goal_n, goal_ms)
    return {"name": NAME, "title": TITLE, "rows": rows, "fits": fits, "goal": goal,
            "config": {"sizes": sizes, "repeats": repeats, "tool_s": tool_s, "sessions_per_agent": per_agent,
                       "storages": storages, "backend": "scripted (control plane isolated)"}}


def goal_of(rows, fits, storages, goal_n: int, goal_ms: float) -> dict[str, Any]:
    """The issue's two goals. Pause: the median excess over the tool call at ``goal_n`` is at
    most ``goal_ms`` (the worst repeat is reported too). Growth: the idle pause's log-log
    slope over all N is at most 1 (+0.05) and no single step grew faster than N (+10%)."""
    goal: dict[str, Any] = {"pause_within_ms_of_longest_tool": goal_ms, "at_n": goal_n}
    for storage in storages:
        goal_row = next((r for r in rows if r["n"] == goal_n and r["storage"] == storage), None)
        if goal_row is None:
            goal[storage] = {"met": None, "note": f"N={goal_n} not measured in this mode"}
            continue
        median = goal_row["excess_s"]["median"] * 1e3
        goal[storage] = {"excess_ms_median": median, "excess_ms_max": goal_row["excess_s"]["max"] * 1e3,
                         "met": median <= goal_ms}
    goal["pause_met"] = goal.get("disk", {}).get("met")
    slopes = {s: fits[s]["pause_s"].get("loglog_slope") for s in storages}
    steps = {s: fits[s]["pause_s"].get("no_worse_than_linear") for s in storages}
    goal["pause_loglog_slope"] = slopes
    goal["every_step_within_linear"] = steps
    measured = [v for v in slopes.values() if v is not None]
    goal["linear_met"] = (all(v <= 1.05 for v in measured) and all(v is not False for v in steps.values())) \
        if measured else None
    goal["linear_basis"] = ("idle pause: log-log slope over all N at most 1 (+0.05) and every step at most "
                            "its N ratio (+10%)")
    return goal


def table(res: dict[str, Any]) -> str:
    tool_s = res["config"]["tool_s"]
    head = ["N", "agents", "storage", "pause ms", "prepare ms", "commit ms", "publish ms", "resume ms",
            "MB written", "KB/rollout", f"pause ms, {tool_s:g}s tool in flight", "excess over tool ms"]
    body = []
    for r in res["rows"]:
        body.append([r["n"], r["agents"], r["storage"], fmt(r["pause_s"], 1e3), fmt(r["prepare_s"], 1e3),
                     fmt(r["commit_s"], 1e3), fmt(r["publish_s"], 1e3), fmt(r["resume_s"], 1e3),
                     fmt(r["bytes"], 1e-6, 2), fmt(r["bytes_per_rollout"], 1e-3, 1),
                     fmt(r["tool_pause_s"], 1e3), fmt(r["excess_s"], 1e3)])
    out = [md_table(head, body), ""]
    grow = [["storage", "cost", "log-log slope", "growth per 8x in N, each step", "linear fit"]]
    for storage, fits in res["fits"].items():
        for f, label in (("pause_s", "pause"), ("prepare_s", "prepare"), ("commit_s", "commit"),
                         ("publish_s", "publish"), ("bytes", "bytes"), ("excess_s", "excess over tool")):
            g = fits.get(f, {})
            if "loglog_slope" not in g or (f == "bytes" and storage != "disk"):
                continue
            steps = ", ".join(f"{s['from']}→{s['to']}: x{s['per_8x']:.2f}" for s in g["steps"])
            lin = g["linear_fit"]
            unit, scale = ("KB", 1e-3) if f == "bytes" else ("ms", 1e3)
            grow.append([storage, label, f"{g['loglog_slope']:.2f}", steps,
                         f"{lin['intercept'] * scale:,.1f} {unit} + "
                         f"{lin['per_rollout'] * scale * 1000:,.1f} {unit} per 1000 rollouts"])
    if len(grow) > 1:
        out.append(md_table(grow[0], grow[1:]))
    diag = [r for r in res["rows"] if r.get("commit_by_server")]
    if diag:
        kinds = ("model", "agent", "resources")
        head = ["N"] + [f"{k} commit ms (servers: sum / slowest)" for k in kinds]
        body = []
        for r in diag:
            by = r["commit_by_server"]["by_kind"]
            body.append([r["n"]] + [f"{by[k]['sum_s'] * 1e3:,.0f} / {by[k]['max_s'] * 1e3:,.0f} ({by[k]['servers']})"
                                    if k in by else "—" for k in kinds])
        out += ["", "Where commit time goes: each participant committing alone, one after the other "
                "(disk; one run per N):", "", md_table(head, body)]
    return "\n".join(out)
