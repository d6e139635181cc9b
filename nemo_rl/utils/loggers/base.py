"""The one interface every metrics backend implements, and the error a backend raises when it cannot start."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class LoggerStartError(ValueError):
    """A backend that is enabled but cannot start; the message names the config key (``logger.<x>``)."""


@runtime_checkable
class MetricLogger(Protocol):
    """A sink for numeric series on the trainer-step axis. ``log_metrics`` may raise; the fan-out
    (``MetricLoggers``) turns a failure into one warning, so a backend needs no error handling of its own."""

    name: str  # the config section it comes from (``tensorboard``, ``wandb``, ``mlflow``), for messages

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...
