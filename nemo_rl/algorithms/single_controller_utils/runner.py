"""What ``examples/run_grpo.py`` does once the config is loaded, in order:
Ray -> Gym spin-up and the restart-only check -> policy and generation ->
the controller loop -> plots and a summary. Everything started is stopped."""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from pathlib import Path
from typing import Any

import ray

from nemo_rl.algorithms.single_controller_utils.components import (
    SCRIPTED_TEST_BACKEND,
    ScriptedTestGeneration,
    build_real,
    reserve_policy_url,
)
from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.algorithms.single_controller_utils.setup import _spinup_gym, init_ray
from nemo_rl.data.dataloader import load_jsonl


def _warn_to_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    import sys

    print(f"{category.__name__}: {message}", file=sys.stderr, flush=True)


def run(config: MasterConfig, *, launched_at: float | None = None, skip_restart_only_check: bool = False) -> int:
    launched_at = launched_at or time.monotonic()
    warnings.showwarning = _warn_to_stderr
    log_dir = Path(config.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "config.yaml").write_text(config.to_yaml())
    rows = load_jsonl(config.data.train_data_path)
    scripted = config.policy.model_name == SCRIPTED_TEST_BACKEND

    init_ray(config)
    generation = None
    shard_set = None
    try:
        if scripted:
            generation = ScriptedTestGeneration(rows, delay_s=float(__import__("os").environ.get("NEMO_RL_SCRIPTED_DELAY_S", "0")))
            policy_url, port = generation.base_url, 0
        else:
            policy_url, port = reserve_policy_url(config)
        shard_set = _spinup_gym(
            config, policy_base_url=policy_url, log_dir=log_dir, skip_restart_only_check=skip_restart_only_check
        )
        print(f"Gym ready in {time.monotonic() - launched_at:.1f}s: "
              f"{sum(len(h) for h in shard_set.handles.values())} replica(s)", flush=True)
        if scripted:
            from nemo_rl.algorithms.recording_trainer import RecordingTrainer

            trainer = RecordingTrainer(log_dir)
        else:
            trainer, generation = build_real(config, rows, port)
        summary = asyncio.run(_run_controller(config, shard_set, trainer, generation, rows))
    finally:
        if shard_set is not None:
            shard_set.shutdown()
        if generation is not None:
            generation.stop()
        ray.shutdown()
    _report(config, summary)
    return 0


async def _run_controller(config, shard_set, trainer, generation, rows) -> dict[str, Any]:
    from nemo_rl.algorithms.single_controller import SingleController
    from nemo_rl.utils.progress import StepProgress

    with StepProgress(total=config.grpo.max_num_steps, enabled=config.logger.progress_bar) as progress:
        controller = SingleController(config, shard_set, trainer, generation, rows, on_progress=progress.update)
        summary = await controller.run()
    return summary


def _report(config: MasterConfig, summary: dict[str, Any]) -> None:
    from nemo_rl.utils.plots import plot_run, summary_table

    log_dir = Path(config.logger.log_dir)
    metrics = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (log_dir / "metrics.jsonl").exists() else []
    if config.logger.plot and metrics:
        path = plot_run(metrics, log_dir / "reward_curve.png")
        print(f"Reward curve: {path}")
    print(summary_table(metrics, log_dir), flush=True)
