"""Measurement 2: the stall. K snapshot attempts of the controller on the mixed
setup (a restart-only agent and a restart-only resources server among servers
that save), with prepare policy ``block`` versus ``best_effort``.

Both are real GRPO runs of ``examples/configs/grpo_mixed_turn.yaml`` (scripted
backend, recording trainer), killed after ``attempts`` snapshot attempts:

- ``best_effort``: ``rollout_recovery.allow_restart_only_gym_servers=true``.
- ``block``: the setting left at false, which the setup check refuses since the
  fix; the benchmark sets the test-only ``NEMO_RL_TEST_ONLY_SKIP_RESTART_ONLY_CHECK=1``
  to get past it (the test entry's hooks, ``testkit/run_grpo.py``, log the refused
  setup and go on), i.e. the controller as it behaved before the fix.

``rollout_recovery.gym_prepare_timeout_s`` is ``deadline_s`` and
``max_consecutive_failures`` is raised so the block run keeps trying. Per
attempt: ``committed``, ``pause_s``, ``saved``, ``unsaved`` and the blocking
servers as the controller recorded them in ``snapshots.jsonl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import (
    DEFAULT_VARIANTS,
    Log,
    Variant,
    controller_run,
    fmt,
    make_log,
    md_table,
    summary,
)
from testkit.run_grpo import SKIP_RESTART_ONLY_ENV

NAME = "stall"
TITLE = "2. The stall: snapshot attempts with restart-only servers, block versus best effort"
CONFIG = "examples/configs/grpo_mixed_turn.yaml"
POLICIES = ("block", "best_effort")


def measure(*, attempts: int, deadline_s: float, workdir: Path, delay_s: float = 0.3, gap_s: float = 0.5,
            prompts: int = 8, generations: int = 2, variants: list[Variant] | None = None,
            log: Log | None = None, timeout_s: float = 240.0) -> dict[str, Any]:
    log = log or make_log("stall")
    variants = variants or DEFAULT_VARIANTS
    rows = []
    for label, extra in variants:
        for policy in POLICIES:
            overrides = [
                "grpo.max_num_steps=50", f"grpo.num_prompts_per_step={prompts}",
                f"grpo.num_generations_per_prompt={generations}",
                f"rollout_checkpointing.snapshot_attempt_interval_s={gap_s}",
                "rollout_checkpointing.max_consecutive_failures=1000",
                f"rollout_recovery.gym_prepare_timeout_s={deadline_s}",
                f"rollout_recovery.allow_restart_only_gym_servers={'true' if policy == 'best_effort' else 'false'}",
                *extra,
            ]
            env = {SKIP_RESTART_ONLY_ENV: "1"} if policy == "block" else {}
            log(f"{label}/{policy}: run until {attempts} snapshot attempts")
            run = controller_run(Path(workdir) / f"stall-{label}-{policy}", config=CONFIG, overrides=overrides,
                                 delay_s=delay_s, timeout_s=timeout_s, extra_env=env,
                                 kill_when=lambda dirs, _e: len(dirs.records("snapshots.jsonl")) >= attempts)
            att = run.snapshots[:attempts]
            if len(att) < attempts:
                raise RuntimeError(f"stall/{policy}: {len(att)} of {attempts} attempts before the run ended "
                                   f"({run.outcome.killed_by or run.outcome.returncode}); see {run.dirs.root}/run.out")
            rows.append({
                "variant": label, "policy": policy, "attempts": len(att),
                "committed": sum(1 for a in att if a.get("committed")),
                "time_per_attempt_s": summary(a["pause_s"] for a in att),
                "saved": summary(a.get("saved", 0) for a in att),
                "unsaved": summary(a.get("unsaved", 0) for a in att),
                "blocking_servers": sorted({s for a in att for s in a.get("blocking_servers") or []}),
                "reasons": sorted({a.get("reason", "") for a in att}),
                "command": run.command, "stragglers": run.outcome.leftover, "raw": att,
            })
            r = rows[-1]
            log(f"  {r['committed']}/{r['attempts']} committed, {fmt(r['time_per_attempt_s'], 1, 2)} s per attempt, "
                f"blocking: {', '.join(r['blocking_servers']) or '—'}")
    by = {r["policy"]: r for r in rows if r["variant"] == variants[0][0]}
    goal = {
        "block_commits_none": by["block"]["committed"] == 0,
        "best_effort_commits_all": by["best_effort"]["committed"] == by["best_effort"]["attempts"],
    }
    return {"name": NAME, "title": TITLE, "rows": rows, "goal": goal,
            "config": {"attempts": attempts, "prepare_deadline_s": deadline_s, "backend_delay_s": delay_s,
                       "snapshot_interval_s": gap_s, "prompts": prompts, "generations": generations,
                       "variants": [{"label": v[0], "overrides": v[1]} for v in variants],
                       "setup": f"{CONFIG}, scripted backend, recording trainer"}}


def table(res: dict[str, Any]) -> str:
    several = len(res["config"]["variants"]) > 1
    head = (["variant"] if several else []) + [
        "policy", "committed / attempts", "seconds per attempt", "rollouts saved per attempt",
        "rollouts unsaved per attempt", "blocking servers"]
    body = [([r["variant"]] if several else []) + [
        r["policy"], f"{r['committed']} / {r['attempts']}", fmt(r["time_per_attempt_s"], 1, 2), fmt(r["saved"]),
        fmt(r["unsaved"]), ", ".join(r["blocking_servers"]) or "—"] for r in res["rows"]]
    return md_table(head, body)
