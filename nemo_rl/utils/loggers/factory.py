"""``open_loggers``: the backends ``logger.*_enabled`` asks for, started in order; if one cannot start,
the ones already started are closed and its ``LoggerStartError`` (naming the key) is raised."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_rl.utils.loggers.base import MetricLogger
from nemo_rl.utils.loggers.fanout import MetricLoggers

if TYPE_CHECKING:
    from nemo_rl.algorithms.single_controller_utils.config import LoggerConfig


def tensorboard_dir(cfg: "LoggerConfig") -> Path:
    """``logger.tensorboard.log_dir``, relative to ``logger.log_dir`` unless absolute."""
    return Path(cfg.log_dir) / cfg.tensorboard.log_dir


def open_loggers(cfg: "LoggerConfig", run_config: dict[str, Any] | None = None) -> MetricLoggers:
    """``run_config`` (the whole run config, JSON-safe) becomes the W&B run's config."""
    backends: list[MetricLogger] = []
    try:
        if cfg.tensorboard_enabled:
            from nemo_rl.utils.loggers.tensorboard_logger import TensorBoardLogger

            backends.append(TensorBoardLogger(tensorboard_dir(cfg)))
        if cfg.wandb_enabled:
            from nemo_rl.utils.loggers.wandb_logger import WandbLogger

            backends.append(WandbLogger(cfg.log_dir, cfg.wandb.project, cfg.wandb.name, run_config))
        if cfg.mlflow_enabled:
            from nemo_rl.utils.loggers.mlflow_logger import MlflowLogger

            backends.append(MlflowLogger(cfg.log_dir, cfg.mlflow.experiment_name, cfg.mlflow.run_name,
                                         cfg.mlflow.tracking_uri))
    except BaseException:
        MetricLoggers(backends).close()
        raise
    return MetricLoggers(backends)
