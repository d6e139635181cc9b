"""Weights & Biases: one run per launch, its files under ``logger.log_dir/wandb``. ``WANDB_MODE=offline``
(wandb's own switch) keeps everything on disk; ``wandb sync`` uploads it later."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_rl.utils.loggers.base import LoggerStartError

STEP_METRIC = "nemo_rl/step"  # the x axis of every series (wandb's own _step counts log calls, not steps)


class WandbLogger:
    name = "wandb"

    def __init__(self, log_dir: str | Path, project: str, run_name: str | None, config: dict[str, Any] | None = None):
        try:
            import wandb
        except ImportError as exc:
            raise LoggerStartError(
                f"logger.wandb_enabled=true but wandb is not installed: pip install '.[wandb]' ({exc})"
            ) from None
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        try:
            # console="off": the run's stdout/stderr stay as they are (no wrapped streams around the progress bar)
            self.run = wandb.init(project=project, name=run_name, dir=str(log_dir), config=config,
                                  settings=wandb.Settings(console="off"), reinit="create_new")
        except Exception as exc:  # noqa: BLE001 - wandb raises its own types (no login, bad mode, ...)
            raise LoggerStartError(
                f"logger.wandb: wandb.init(project={project!r}, name={run_name!r}) failed: {type(exc).__name__}: {exc}"
                " (set WANDB_MODE=offline to log without a W&B server)"
            ) from None
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({STEP_METRIC: step, **metrics})

    def close(self) -> None:
        self.run.finish()
