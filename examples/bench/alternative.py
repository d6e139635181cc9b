"""Measurement 4: the rejected alternative against best effort.

Rejected alternative (docs/design.md §1): prepare with policy ``block``; if a
restart-only server blocks, resume, retire every blocker, and prepare again.
With a restart-only agent every running rollout is a blocker, so every
snapshot cancels every rollout in flight. It is not the product, so it exists
only here, as a baseline: a closed loop of rollouts on ``plain``
(plain_loop_agent, restart-only) on Workplace, driven over HTTP, whose
snapshots use the product's pieces: the coordination library
(``prepare``/``resume``/``retire``/``commit``), ``GymCheckpointIndex`` for
``gym_checkpoint.json`` and ``snapshot_store`` to seal and publish, in the
controller's layout (``<anchor>/rollout_snapshots/snapshot_<seq>/``). Its
reference is the same loop without snapshots.

Best effort is the product: real GRPO runs (``run_grpo.py``, scripted backend,
recording trainer) on a Gym config where the rows' agent is the same
restart-only ``plain_loop_agent`` on Workplace, with
``allow_restart_only_gym_servers=true``, snapshots every ``interval`` seconds
(the same interval as the baseline's) versus none. The interval is
``interval_fraction`` x the median rollout duration measured in the baseline's
no-snapshot window, so it is shorter than a rollout.

The two harnesses differ (the controller runs synchronous steps behind Ray),
so their absolute rates are not comparable; each is compared with its own
no-snapshot reference: the share of throughput that snapshots leave.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    co,
    ClosedLoop,
    Control,
    EpisodeId,
    Log,
    SharedGym,
    controller_run,
    fmt,
    fresh_dir,
    generation_rate,
    make_log,
    md_table,
    shared_gym,
    summary,
)
from gym_patches.checkpoint.calls import CommitCall, PrepareCall, ResumeCall, RetireCall
from gym_patches.checkpoint.storage import FileSystemWriter
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot import GymCheckpointIndex
from nemo_rl.utils.snapshot_store import commit_snapshot, prepare_snapshot_paths

WRITER = FileSystemWriter()  # the baseline writes its snapshots as plain files, as the product does by default

NAME = "alternative"
TITLE = "4. Rejected alternative (resume, retire blockers, prepare again) versus best effort"
MODES = ("none", "alternative")  # the Gym-level baseline loop
CONTROLLER_MODES = ("controller_none", "best_effort")  # the product
CONFIG = "examples/configs/grpo_workplace_turn.yaml"
BASELINE_INSTANCE = "baseline/replica-0"


def measure(*, window_s: float, repeats: int, workdir: Path, concurrency: int = 16, delay_s: float = 0.4,
            interval_fraction: float = 0.6, first_prepare_s: float = 0.25, warmup_s: float = 2.5,
            controller_steps: int = 6, controller_prompts: int = 4, env: SharedGym | None = None,
            log: Log | None = None) -> dict[str, Any]:
    log = log or make_log("alternative")
    with shared_gym(env, workdir) as gym:
        gym.set_delay(delay_s)
        raw = asyncio.run(_measure(gym, window_s, repeats, concurrency, interval_fraction, first_prepare_s,
                                   warmup_s, fresh_dir(workdir / "ckpt-alternative"), log))
    windows = raw["windows"]
    windows.update(_controller(workdir, raw["interval_s"], repeats, delay_s, controller_steps, controller_prompts,
                               concurrency, log))
    rows = []
    for mode in (*MODES, *CONTROLLER_MODES):
        ws = windows[mode]
        rows.append({
            "mode": mode,
            "harness": "controller" if mode in CONTROLLER_MODES else "baseline loop",
            "rollouts_per_min": summary(w["per_min"] for w in ws),
            "retired_per_min": summary(w["retired_per_min"] for w in ws),
            "retired_total": summary(w["retired_total"] for w in ws),
            "snapshots": summary(w["snapshots"] for w in ws),
            "committed": summary(w["committed"] for w in ws),
            "pause_s": summary(p for w in ws for p in w["pauses"]),
            "raw": ws,
        })
    by = {r["mode"]: r for r in rows}
    kept_best = _rel(by["best_effort"], by["controller_none"])
    kept_alt = _rel(by["alternative"], by["none"])
    ratio = None
    if kept_best is not None and kept_alt is not None:
        ratio = kept_best / kept_alt if kept_alt else float("inf")
    return {"name": NAME, "title": TITLE, "rows": rows,
            "comparison": {"best_effort_over_alternative": ratio,
                           "basis": "share of the own no-snapshot throughput kept, best effort / alternative",
                           "best_effort_vs_none": kept_best, "alternative_vs_none": kept_alt},
            "goal": {"alternative_starves": (kept_alt or 0) < 0.2},
            "config": {"window_s": window_s, "repeats": repeats, "concurrency": concurrency,
                       "backend_delay_s": delay_s, "interval_s": raw["interval_s"],
                       "rollout_s_median": raw["rollout_s"], "first_prepare_deadline_s": first_prepare_s,
                       "controller_steps": controller_steps,
                       "controller_rollouts_per_step": controller_prompts * max(1, concurrency // controller_prompts),
                       "setup": "plain_loop_agent (restart-only) on Workplace, scripted backend"}}


def _rel(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    x, y = a["rollouts_per_min"]["median"], b["rollouts_per_min"]["median"]
    return None if not y or x is None else x / y


def restart_only_gym_config(path: Path) -> Path:
    """The Workplace Gym config with the rows' agent (``workplace_simple_agent``) as a restart-only plain loop."""
    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/gym_configs/workplace.yaml").read_text())
    agent = base["workplace_simple_agent"]["responses_api_agents"]["simple_agent"]
    base["workplace_simple_agent"] = {"responses_api_agents": {"plain_loop_agent": agent}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(base))
    return path


def _controller(workdir: Path, interval_s: float, repeats: int, delay_s: float, steps: int, prompts: int,
                concurrency: int, log: Log) -> dict[str, list[dict[str, Any]]]:
    """Best effort through the product: GRPO runs on the restart-only agent, snapshots every ``interval_s`` or none."""
    gym_config = restart_only_gym_config(Path(workdir) / "restart-only-workplace.yaml")
    gens = max(1, concurrency // prompts)
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in CONTROLLER_MODES}
    for r in range(repeats):
        for mode in CONTROLLER_MODES:
            interval = interval_s if mode == "best_effort" else "null"
            run = controller_run(
                Path(workdir) / f"alt-controller-{mode}-{r}", config=CONFIG, delay_s=delay_s, overrides=[
                    f"env.nemo_gym.config_paths=[{gym_config}]", "rollout_recovery.allow_restart_only_gym_servers=true",
                    f"grpo.max_num_steps={steps}", f"grpo.num_prompts_per_step={prompts}",
                    f"grpo.num_generations_per_prompt={gens}",
                    f"rollout_checkpointing.snapshot_attempt_interval_s={interval}"])
            if run.outcome.returncode != 0:
                raise RuntimeError(f"alternative/{mode}: run exited {run.outcome.returncode}; "
                                   f"see {run.dirs.root}/run.out:\n{run.outcome.tail()}")
            rate = generation_rate(run, skip_steps=1)
            snaps = [s for s in run.snapshots if s.get("step", 0) >= 1]
            w = {"per_min": rate["per_min"], "retired_per_min": 0.0, "retired_total": 0,
                 "completed": rate["samples"], "seconds": rate["generation_s"], "snapshots": len(run.snapshots),
                 "committed": sum(1 for s in run.snapshots if s.get("committed")),
                 "unsaved": sum(s.get("unsaved", 0) for s in run.snapshots),
                 "pauses": [s["pause_s"] for s in snaps], "command": run.command}
            out[mode].append(w)
            log(f"repeat {r + 1}/{repeats} {mode} (controller): {w['per_min']:.0f} rollouts/min of generation, "
                f"{w['snapshots']} snapshots ({w['committed']} committed)")
    return out


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
                        snapper = asyncio.create_task(_snapshots(ctl, parts, load, interval, first_prepare_s,
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
                log(f"repeat {r + 1}/{repeats} {mode} (baseline loop): {w['per_min']:.0f} rollouts/min, "
                    f"{w['snapshots']} snapshots ({w['committed']} committed), {len(retired)} rollouts retired")
    return {"windows": windows, "interval_s": interval, "rollout_s": rollout_s}


async def _snapshots(ctl, parts, load, interval, first_prepare_s, anchor, stats, stop, tag) -> None:
    k = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except asyncio.TimeoutError:
            pass
        k += 1
        load.dispatch_open.clear()  # the loop's own dispatch gate: no new rollout during the attempt
        try:
            committed, pause = await _retire_and_retry(parts, load, f"alt-{tag}-{k}", first_prepare_s, anchor)
        finally:
            load.dispatch_open.set()
        stats["snapshots"] += 1
        stats["committed"] += int(committed)
        stats["pauses"].append(pause)


async def _retire_and_retry(parts: co.Participants, load: ClosedLoop, cid: str, first_prepare_s: float,
                            anchor: Path, max_rounds: int = 3) -> tuple[bool, float]:
    """The rejected alternative: prepare (block); not ready -> resume, retire every
    blocker, prepare again (up to ``max_rounds`` times); if prepared, commit and publish
    ``gym_checkpoint.json`` (``GymCheckpointIndex``) with ``snapshot_store``."""
    t0 = time.perf_counter()
    current = f"{cid}-r0"
    committed = False
    try:
        prep = await co.call(parts, PrepareCall(checkpoint_id=current, deadline_ts=time.time() + first_prepare_s,
                                                restart_only_policy="block"))
        rounds = 0
        while not prep.prepared and rounds < max_rounds:
            rounds += 1
            await co.call(parts, ResumeCall(checkpoint_id=current, deadline_ts=time.time() + 30))
            blockers = {k for keys in prep.blockers.values() for k in keys}
            for name, reply in prep.replies.items():  # reports cap their blocker lists
                if reply.report.blocker_count > len(reply.report.blockers):
                    blockers |= set(load.keys_on(name))
            current = f"{cid}-r{rounds}"
            if blockers:
                await co.call(parts, RetireCall(
                    checkpoint_id=current, deadline_ts=time.time() + 30,
                    episode_ids=[EpisodeId.from_capture_key(k) for k in sorted(blockers)], best_effort=True))
            prep = await co.call(parts, PrepareCall(checkpoint_id=current,
                                                    deadline_ts=time.time() + first_prepare_s,
                                                    restart_only_policy="block"))
        if prep.prepared:
            tmp, final = prepare_snapshot_paths(anchor)
            commits = await co.call(parts, CommitCall(checkpoint_id=current, deadline_ts=time.time() + 30,
                                                      checkpoint_dir=str(tmp),
                                                      episode_ids=prep.continued(load.scope())))
            agents = {p.name for p in parts.by_kind("agent")}
            exported = {name: sorted(c.episode_ids) for name, c in commits.items()}
            GymCheckpointIndex(
                checkpoint_id=current, instances={BASELINE_INSTANCE: exported},
                turn_level={BASELINE_INSTANCE: sorted({k for n, keys in exported.items() if n in agents for k in keys})},
                unsaved={BASELINE_INSTANCE: sorted(prep.unsaved_keys())},
            ).write(tmp, WRITER)
            commit_snapshot(tmp, final, 2, metadata={"checkpoint_id": current}, writer=WRITER)
            committed = True
    finally:
        await co.call(parts, ResumeCall(checkpoint_id=current, deadline_ts=time.time() + 30))
    return committed, time.perf_counter() - t0


def table(res: dict[str, Any]) -> str:
    head = ["harness", "snapshots", "rollouts completed / min", "rollouts retired / min", "snapshots per window/run",
            "committed per window/run", "pause per snapshot ms"]
    label = {"none": "none (reference)", "alternative": "alternative: resume, retire blockers, prepare again",
             "controller_none": "none (reference)", "best_effort": "best effort (the product)"}
    body = [[r["harness"], label[r["mode"]], fmt(r["rollouts_per_min"]), fmt(r["retired_per_min"]),
             fmt(r["snapshots"]), fmt(r["committed"]),
             fmt(r["pause_s"], 1e3) if r["mode"] not in ("none", "controller_none") else "—"] for r in res["rows"]]
    c = res["comparison"]
    kept = (f"Share of the own no-snapshot throughput kept: best effort "
            f"{(c['best_effort_vs_none'] or 0) * 100:.0f}%, alternative {(c['alternative_vs_none'] or 0) * 100:.0f}%.")
    ratio = c["best_effort_over_alternative"]
    shown = "∞ (the alternative completed none)" if ratio == float("inf") else (f"{ratio:.1f}x" if ratio else "—")
    return md_table(head, body) + f"\n\n{kept} Best effort / alternative: **{shown}**."
