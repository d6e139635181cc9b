"""Measurement 4: the rejected alternative against best effort.

Rejected alternative (DESIGN §1), implemented here only: prepare with policy
``block``; if a restart-only server blocks, resume, retire every blocker, and
prepare again. With a restart-only agent every running rollout is a blocker,
so every snapshot cancels every rollout in flight.

Setup: ``plain`` (plain_loop_agent, restart-only) on Workplace under a closed
loop of rollouts. A snapshot is taken every ``interval`` seconds, where the
interval is ``interval_fraction`` x the median rollout duration measured in the
no-snapshot window (so it is shorter than a rollout). Modes, side by side in
each repeat: none, best effort, the alternative. Metric: rollouts completed per
minute.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import (
    co,
    ClosedLoop,
    Control,
    EpisodeId,
    Log,
    SharedGym,
    commit_snapshot,
    dir_bytes,
    fmt,
    fresh_dir,
    make_log,
    md_table,
    prepare_snapshot_paths,
    shared_gym,
    summary,
    take_snapshot,
    write_json_atomic,
)

NAME = "alternative"
TITLE = "4. Rejected alternative (resume, retire blockers, prepare again) versus best effort"
MODES = ("none", "best_effort", "alternative")


def measure(*, window_s: float, repeats: int, workdir: Path, concurrency: int = 16, delay_s: float = 0.4,
            interval_fraction: float = 0.6, first_prepare_s: float = 0.25, warmup_s: float = 2.5,
            env: SharedGym | None = None, log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("alternative")
    with shared_gym(env, workdir) as gym:
        gym.set_delay(delay_s)
        raw = asyncio.run(_measure(gym, window_s, repeats, concurrency, interval_fraction, first_prepare_s,
                                   warmup_s, fresh_dir(workdir / "ckpt-alternative"), log))
    rows = []
    for mode in MODES:
        windows = raw["windows"][mode]
        rows.append({
            "mode": mode,
            "rollouts_per_min": summary(w["per_min"] for w in windows),
            "retired_per_min": summary(w["retired_per_min"] for w in windows),
            "retired_total": summary(w["retired_total"] for w in windows),
            "snapshots": summary(w["snapshots"] for w in windows),
            "committed": summary(w["committed"] for w in windows),
            "pause_s": summary(p for w in windows for p in w["pauses"]),
            "raw": windows,
        })
    by = {r["mode"]: r for r in rows}
    ratio = None
    if by["alternative"]["rollouts_per_min"]["median"] is not None:
        alt = by["alternative"]["rollouts_per_min"]["median"]
        best = by["best_effort"]["rollouts_per_min"]["median"]
        ratio = (best / alt) if alt else float("inf")
    per_repeat = [
        (b["per_min"] / a["per_min"]) if a["per_min"] else None
        for b, a in zip(raw["windows"]["best_effort"], raw["windows"]["alternative"])
    ]
    return {"name": NAME, "title": TITLE, "rows": rows,
            "comparison": {"best_effort_over_alternative": ratio, "per_repeat": per_repeat,
                           "best_effort_vs_none": _rel(by["best_effort"], by["none"]),
                           "alternative_vs_none": _rel(by["alternative"], by["none"])},
            "goal": {"alternative_starves": (by["alternative"]["rollouts_per_min"]["median"] or 0)
                     < 0.2 * (by["best_effort"]["rollouts_per_min"]["median"] or 0)},
            "config": {"window_s": window_s, "repeats": repeats, "concurrency": concurrency,
                       "backend_delay_s": delay_s, "interval_s": raw["interval_s"],
                       "rollout_s_median": raw["rollout_s"], "first_prepare_deadline_s": first_prepare_s,
                       "setup": "plain_loop_agent (restart-only) on Workplace, scripted backend"}}


def _rel(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    x, y = a["rollouts_per_min"]["median"], b["rollouts_per_min"]["median"]
    return None if not y or x is None else x / y


async def _measure(gym: SharedGym, window_s, repeats, concurrency, fraction, first_prepare_s, warmup_s, anchor,
                   log) -> dict[str, Any]:
    plan = [(SharedGym.PLAIN, row) for row in gym.rows]
    windows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    interval = rollout_s = None
    assert gym.dep is not None
    async with Control.open(gym.dep) as ctl:
        parts = ctl.without([SharedGym.SIMPLE])
        for r in range(repeats):
            for mode in MODES:
                load = ClosedLoop(ctl, plan, concurrency, prefix=f"alt-{mode}-{r}", stagger_s=0.6 * warmup_s)
                load.start()
                stop = asyncio.Event()
                stats: dict[str, Any] = {"snapshots": 0, "committed": 0, "pauses": []}
                snapper = None
                try:
                    await asyncio.sleep(warmup_s)
                    t0 = time.monotonic()
                    if mode != "none":
                        assert interval is not None
                        snapper = asyncio.create_task(_snapshots(mode, ctl, parts, load, interval, first_prepare_s,
                                                                 anchor, stats, stop, f"{mode}-{r}"))
                    await asyncio.sleep(window_s)
                    t1 = time.monotonic()
                    stop.set()
                    if snapper is not None:
                        await snapper
                finally:
                    stop.set()
                    if snapper is not None and not snapper.done():
                        snapper.cancel()
                        await asyncio.gather(snapper, return_exceptions=True)
                    await load.stop()
                done = load.completed_between(t0, t1)
                retired = [f for f in load.failed_between(t0, t1) if f.code == "stale_attempt"]
                retired_total = sum(1 for f in load.finished if f.code == "stale_attempt")
                if mode == "none" and interval is None:
                    rollout_s = statistics.median(f.ended - f.started for f in done)
                    interval = round(max(0.2, fraction * rollout_s), 2)
                    log(f"median rollout {rollout_s:.2f}s -> snapshot interval {interval:.2f}s")
                w = {"per_min": len(done) / (t1 - t0) * 60, "retired_per_min": len(retired) / (t1 - t0) * 60,
                     "completed": len(done), "seconds": t1 - t0, "retired_total": retired_total, **stats}
                windows[mode].append(w)
                log(f"repeat {r + 1}/{repeats} {mode}: {w['per_min']:.0f} rollouts/min, "
                    f"{w['snapshots']} snapshots ({w['committed']} committed), {len(retired)} rollouts retired")
    return {"windows": windows, "interval_s": interval, "rollout_s": rollout_s}


async def _snapshots(mode, ctl, parts, load, interval, first_prepare_s, anchor, stats, stop, tag) -> None:
    k = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except asyncio.TimeoutError:
            pass
        k += 1
        load.dispatch_open.clear()
        try:
            if mode == "best_effort":
                snap = await take_snapshot(parts, checkpoint_id=f"be-{tag}-{k}", policy="best_effort", deadline_s=30,
                                           scope=load.scope(), anchor=anchor)
                committed, pause = snap.committed, snap.pause_s
            else:
                committed, pause = await _retire_and_retry(parts, load, f"alt-{tag}-{k}", first_prepare_s, anchor)
        finally:
            load.dispatch_open.set()
        stats["snapshots"] += 1
        stats["committed"] += int(committed)
        stats["pauses"].append(pause)


async def _retire_and_retry(parts: co.Participants, load: ClosedLoop, cid: str, first_prepare_s: float,
                            anchor: Path, max_rounds: int = 3) -> tuple[bool, float]:
    """The rejected alternative: prepare (block); not ready -> resume, retire every
    blocker, prepare again (up to ``max_rounds`` times); commit and publish if prepared."""
    t0 = time.perf_counter()
    current = f"{cid}-r0"
    committed = False
    try:
        prep = await co.prepare(parts, current, time.time() + first_prepare_s, "block")
        rounds = 0
        while not prep.prepared and rounds < max_rounds:
            rounds += 1
            await co.resume(parts, current, time.time() + 30)
            blockers = {k for keys in prep.blockers.values() for k in keys}
            for name, reply in prep.replies.items():  # reports cap their blocker lists
                if reply.report.blocker_count > len(reply.report.blockers):
                    blockers |= set(load.keys_on(name))
            current = f"{cid}-r{rounds}"
            if blockers:
                await co.retire(parts, current, time.time() + 30,
                                [EpisodeId.from_capture_key(k) for k in sorted(blockers)], best_effort=True)
            prep = await co.prepare(parts, current, time.time() + first_prepare_s, "block")
        if prep.prepared:
            tmp, final = prepare_snapshot_paths(anchor)
            commits = await co.commit(parts, current, time.time() + 30, str(tmp), prep.continued(load.scope()))
            write_json_atomic(tmp / "gym_checkpoint.json",
                              {"checkpoint_id": current,
                               "exported_by_server": {n: list(c.episode_ids) for n, c in commits.items()}})
            commit_snapshot(tmp, final, 2, metadata={"checkpoint_id": current})
            dir_bytes(final)
            committed = True
    finally:
        await co.resume(parts, current, time.time() + 30)
    return committed, time.perf_counter() - t0


def table(res: dict[str, Any]) -> str:
    head = ["snapshots", "rollouts completed / min", "rollouts retired / min", "snapshots per window",
            "committed per window", "pause per snapshot ms"]
    label = {"none": "none (reference)", "best_effort": "best effort",
             "alternative": "alternative: resume, retire blockers, prepare again"}
    body = [[label[r["mode"]], fmt(r["rollouts_per_min"]), fmt(r["retired_per_min"]), fmt(r["snapshots"]),
             fmt(r["committed"]), fmt(r["pause_s"], 1e3) if r["mode"] != "none" else "—"] for r in res["rows"]]
    ratio = res["comparison"]["best_effort_over_alternative"]
    shown = "∞ (the alternative completed none)" if ratio == float("inf") else (f"{ratio:.1f}x" if ratio else "—")
    return md_table(head, body) + f"\n\nBest effort / alternative, rollouts per minute: **{shown}**."
