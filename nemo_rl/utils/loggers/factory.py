"""``open_loggers``: the backends ``logger.*_enabled`` asks for, started in order; if one cannot start,
the ones already started are closed and its ``LoggerStartError`` (naming the key) is raised."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from nemo_rl.utils.loggers.base import MetricLogger
from nemo_rl.utils.loggers.fanout import MetricLoggers


class _TensorBoardSettings(Protocol):
    log_dir: str


class _WandbSettings(Protocol):
    project: str
    name: str | None


class _MlflowSettings(Protocol):
    experiment_name: str
    run_name: str | None
    tracking_uri: str | None


class LoggerSettings(Protocol):
    """What this module reads of the run config's ``logger`` section (``LoggerConfig``), by shape: the
    utilities import nothing from ``nemo_rl.algorithms``."""

    log_dir: str
    tensorboard_enabled: bool
    wandb_enabled: bool
    mlflow_enabled: bool

    @property
    def tensorboard(self) -> _TensorBoardSettings: ...

    @property
    def wandb(self) -> _WandbSettings: ...

    @property
    def mlflow(self) -> _MlflowSettings: ...


def tensorboard_dir(cfg: LoggerSettings) -> Path:
    """``logger.tensorboard.log_dir``, relative to ``logger.log_dir`` unless absolute."""
    return Path(cfg.log_dir) / cfg.tensorboard.log_dir


def open_loggers(cfg: LoggerSettings, run_config: dict[str, Any] | None = None) -> MetricLoggers:
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
