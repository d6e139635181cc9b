"""Measurement 6: seconds from launch to the setup error of the mixed config as shipped.

Runs ``python examples/run_grpo.py --config examples/configs/grpo_mixed_turn.yaml``
(turn recovery, ``allow_restart_only_gym_servers`` left at false) as a real
process. ``bench/instrument/sitecustomize.py`` records when the process
started, ``ray.init``, ``_spinup_gym`` (driver) and ``GymDeployment.start``
(inside the Gym actor), so one run splits into: Python start + imports +
config, Ray start, Gym actor + server start, participant discovery and the
check, and the shutdown before the process exits with the error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import MARKER_ENV, REPO, Log, fmt, fresh_dir, kill_group, make_log, md_table, reap_marked, summary

NAME = "setup_check"
TITLE = "6. Setup check: launch to the error, mixed config as shipped"
CONFIG = "examples/configs/grpo_mixed_turn.yaml"
INSTRUMENT = Path(__file__).resolve().parent / "instrument"
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
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE=env.get("RAY_AUTH_MODE", "disabled"), BENCH_TIMING_FILE=str(timing),
               PYTHONPATH=os.pathsep.join(p for p in (str(INSTRUMENT), str(REPO), env.get("PYTHONPATH", "")) if p))
    args = [sys.executable, str(REPO / "examples" / "run_grpo.py"), "--config", CONFIG,
            f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
            "logger.progress_bar=false"]
    marker = uuid.uuid4().hex
    env[MARKER_ENV] = marker
    try:
        spawned = time.time()
        with open(run_dir / "stdout.txt", "wb") as out, open(run_dir / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise RuntimeError(f"the setup check run did not exit within {timeout_s:g}s") from None
        exited = time.time()
    finally:
        stragglers = reap_marked(marker)
    stderr = (run_dir / "stderr.txt").read_text(errors="replace")
    events: dict[str, dict[str, Any]] = {}
    for line in timing.read_text().splitlines() if timing.exists() else []:
        e = json.loads(line)
        events.setdefault(e["event"], e)
    missing = [e for e in ("ray_init", "spinup_gym", "gym_deployment_start") if e not in events]
    if proc.returncode == 0 or missing:
        raise RuntimeError(f"setup check run: rc {proc.returncode}, missing timing events {missing}; "
                           f"stderr tail: {stderr[-1500:]}")
    ray_init, spinup, gym = events["ray_init"], events["spinup_gym"], events["gym_deployment_start"]
    metrics = run_dir / "logs" / "metrics.jsonl"
    return {
        "rc": proc.returncode,
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
