"""Measurement 2: the stall. K controller-like snapshot attempts on a deployment
with a restart-only agent under load, with policy ``block`` versus ``best_effort``.

Load: a closed loop of rollouts, half on ``plain`` (plain_loop_agent, restart-only)
and half on ``simple`` (simple_agent, saves sessions), both on Workplace. Each
attempt closes dispatch, prepares with a deadline of ``deadline_s``, commits the
continued rollouts and publishes if prepared, and always resumes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ClosedLoop,
    Control,
    Log,
    SharedGym,
    fmt,
    fresh_dir,
    make_log,
    md_table,
    shared_gym,
    summary,
    take_snapshot,
)

NAME = "stall"
TITLE = "2. The stall: snapshot attempts with a restart-only agent, block versus best effort"
POLICIES = ("block", "best_effort")


def measure(*, attempts: int, deadline_s: float, workdir: Path, concurrency: int = 8, delay_s: float = 0.3,
            gap_s: float = 0.5, env: SharedGym | None = None, log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("stall")
    with shared_gym(env, workdir) as gym:
        gym.set_delay(delay_s)
        runs = asyncio.run(_measure(gym, attempts, deadline_s, concurrency, gap_s, fresh_dir(workdir / "ckpt-stall"),
                                    log))
    rows = []
    for policy in POLICIES:
        att = runs[policy]["attempts"]
        rows.append({
            "policy": policy,
            "attempts": len(att),
            "committed": sum(1 for a in att if a["committed"]),
            "time_per_attempt_s": summary(a["pause_s"] for a in att),
            "saved": summary(a["saved"] for a in att),
            "unsaved": summary(a["unsaved"] for a in att),
            "blocking_servers": sorted({s for a in att for s in a["blockers"]}),
            "rollouts_completed": runs[policy]["completed"],
            "raw": att,
        })
    by = {r["policy"]: r for r in rows}
    goal = {
        "block_commits_none": by["block"]["committed"] == 0,
        "best_effort_commits_all": by["best_effort"]["committed"] == by["best_effort"]["attempts"],
    }
    return {"name": NAME, "title": TITLE, "rows": rows, "goal": goal,
            "config": {"attempts": attempts, "prepare_deadline_s": deadline_s, "concurrency": concurrency,
                       "backend_delay_s": delay_s, "gap_s": gap_s,
                       "setup": "plain_loop_agent (restart-only) + simple_agent on Workplace, scripted backend"}}


async def _measure(gym: SharedGym, attempts, deadline_s, concurrency, gap_s, anchor, log) -> dict[str, Any]:
    plan = [(SharedGym.PLAIN if i % 2 == 0 else SharedGym.SIMPLE, row) for i, row in enumerate(gym.rows)]
    out: dict[str, Any] = {}
    assert gym.dep is not None
    async with Control.open(gym.dep) as ctl:
        for policy in POLICIES:
            load = ClosedLoop(ctl, plan, concurrency, prefix=f"stall-{policy}")
            load.start()
            try:
                await asyncio.sleep(max(1.0, gap_s))  # rollouts in flight on both agents
                t0 = time.monotonic()
                results = []
                for k in range(attempts):
                    load.dispatch_open.clear()
                    try:
                        snap = await take_snapshot(ctl.parts, checkpoint_id=f"stall-{policy}-{k}", policy=policy,
                                                   deadline_s=deadline_s, scope=load.scope(), anchor=anchor)
                    finally:
                        load.dispatch_open.set()
                    results.append(snap.as_dict())
                    state = "committed" if snap.committed else f"not prepared (blockers: {sorted(snap.blockers)})"
                    log(f"{policy} attempt {k + 1}/{attempts}: {state} in {snap.pause_s:.2f}s, "
                        f"saved {snap.saved}, unsaved {snap.unsaved}")
                    await asyncio.sleep(gap_s)
                completed = len(load.completed_between(t0, time.monotonic()))
            finally:
                await load.stop()
            out[policy] = {"attempts": results, "completed": completed}
    return out


def table(res: dict[str, Any]) -> str:
    head = ["policy", "committed / attempts", "seconds per attempt", "rollouts saved per attempt",
            "rollouts unsaved per attempt", "blocking servers"]
    body = [[r["policy"], f"{r['committed']} / {r['attempts']}", fmt(r["time_per_attempt_s"], 1, 2),
             fmt(r["saved"]), fmt(r["unsaved"]), ", ".join(r["blocking_servers"]) or "—"] for r in res["rows"]]
    return md_table(head, body)
