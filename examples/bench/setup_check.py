"""Measurement 6: seconds from launch to the setup error of the mixed config as shipped.

Runs ``python examples/run_grpo.py --config examples/configs/grpo_mixed_turn.yaml``
(turn recovery, ``allow_restart_only_gym_servers`` left at false) as a real
process, through the harness's test entry (``python -m testkit.run_grpo``: the
same main, no test variable set, so no hook acts). ``bench/instrument/sitecustomize.py`` records when the process
started, ``ray.init``, ``_spinup_gym`` (driver) and ``GymDeployment.start``
(inside the Gym actor), so one run splits into: Python start + imports +
config, Ray start, Gym actor + server start, participant discovery and the
check, and the shutdown before the process exits with the error.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.common import INSTRUMENT, Log, fmt, fresh_dir, make_log, md_table, summary
from testkit.run_harness import run_env, run_once

NAME = "setup_check"
TITLE = "6. Setup check: launch to the error, mixed config as shipped"
CONFIG = "examples/configs/grpo_mixed_turn.yaml"
EXPECTED = ("agent 'workplace_restart_only_agent'", "resources server 'python_sandbox'",
            "rollout_recovery.allow_restart_only_gym_servers=true")
PARTS = (
    ("python_imports_config_s", "Python start, imports, config"),
    ("ray_init_s", "ray.init (Ray start)"),
    ("before_gym_s", "after Ray, before Gym spin-up"),
    ("gym_start_s", "Gym actor + GymDeployment.start"),
    ("gym_deployment_start_s", "…of which GymDeployment.start (server processes up)"),
    ("discover_and_check_s", "participant discovery + restart-only check"),
    ("to_error_s", "launch → error raised"),
    ("shutdown_s", "shutdown (Gym, Ray) before exit"),
    ("total_s", "launch → process exit with the error"),
)


def measure(*, repeats: int, workdir: Path, log: Log | None = None, timeout_s: float = 180) -> dict[str, Any]:
    log = log or make_log("setup-check")
    runs = []
    for r in range(repeats):
        run_dir = fresh_dir(Path(workdir).resolve() / f"setup-check-{r}")
        runs.append(_one(run_dir, timeout_s))
        log(f"repeat {r + 1}/{repeats}: error after {runs[-1]['to_error_s']:.1f}s (exit {runs[-1]['total_s']:.1f}s): "
            f"Ray {runs[-1]['ray_init_s']:.1f}s, Gym {runs[-1]['gym_start_s']:.1f}s")
    rows = [{"part": key, "label": label, "seconds": summary(r[key] for r in runs)} for key, label in PARTS]
    return {"name": NAME, "title": TITLE, "rows": rows, "runs": runs,
            "goal": {"error_names_every_restart_only_server": all(r["error_ok"] for r in runs),
                     "no_rollout_ran": all(r["no_rollout"] for r in runs)},
            "config": {"repeats": repeats, "command": f"python examples/run_grpo.py --config {CONFIG}"}}


def _one(run_dir: Path, timeout_s: float) -> dict[str, Any]:
    timing = run_dir / "timing.jsonl"
    env = run_env(pythonpath=[INSTRUMENT], extra={"BENCH_TIMING_FILE": str(timing)})
    args = ["--config", CONFIG, f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            "logger.progress_bar=false"]
    spawned = time.time()
    run = run_once(args, env=env, stdout_path=run_dir / "stdout.txt", stderr_path=run_dir / "stderr.txt",
                   timeout_s=timeout_s)
    exited = spawned + run.wall_s
    stragglers = run.leftover
    if run.killed_by == "timeout":
        raise RuntimeError(f"the setup check run did not exit within {timeout_s:g}s")
    stderr = (run_dir / "stderr.txt").read_text(errors="replace")
    events: dict[str, dict[str, Any]] = {}
    for line in timing.read_text().splitlines() if timing.exists() else []:
        e = json.loads(line)
        events.setdefault(e["event"], e)
    missing = [e for e in ("ray_init", "spinup_gym", "gym_deployment_start") if e not in events]
    if run.returncode == 0 or missing:
        raise RuntimeError(f"setup check run: rc {run.returncode}, missing timing events {missing}; "
                           f"stderr tail: {stderr[-1500:]}")
    ray_init, spinup, gym = events["ray_init"], events["spinup_gym"], events["gym_deployment_start"]
    metrics = run_dir / "logs" / "metrics.jsonl"
    return {
        "rc": run.returncode,
        "python_imports_config_s": ray_init["start"] - spawned,
        "ray_init_s": ray_init["end"] - ray_init["start"],
        "before_gym_s": spinup["start"] - ray_init["end"],
        "gym_start_s": gym["end"] - spinup["start"],
        "gym_deployment_start_s": gym["end"] - gym["start"],
        "discover_and_check_s": spinup["end"] - gym["end"],
        "to_error_s": spinup["end"] - spawned,
        "shutdown_s": exited - spinup["end"],
        "total_s": exited - spawned,
        "error_ok": all(s in stderr for s in EXPECTED) and not spinup["ok"],
        "stragglers": stragglers,
        "no_rollout": not metrics.exists() or not metrics.read_text().strip(),
        "error_line": next((line for line in stderr.splitlines() if line.startswith("error:")), "")[:400],
    }


def table(res: dict[str, Any]) -> str:
    body = [[r["label"], fmt(r["seconds"], 1, 2)] for r in res["rows"]]
    return md_table(["phase", "seconds"], body)
