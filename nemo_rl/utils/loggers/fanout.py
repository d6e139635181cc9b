"""``MetricLoggers``: what the run records call; hands each row to every enabled backend.

The run's own records (``metrics.jsonl``, ``snapshots.jsonl``, ``restore.json``) are written before
anything reaches here, so a backend that breaks mid-run costs that backend, never a step: it is
warned about once and left out for the rest of the run (a remote one that hangs or retries would
otherwise stall the controller at every row).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable

from nemo_rl.utils.loggers.base import MetricLogger

log = logging.getLogger(__name__)


class MetricLoggers:
    def __init__(self, backends: Iterable[MetricLogger] = ()):
        self.backends: list[MetricLogger] = list(backends)
        self.failed: dict[str, str] = {}  # backend name -> the error that took it out
        self._before_close: list[Callable[[], None]] = []

    def before_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` first thing in ``close``: a writer that holds back a row (the last
        step's snapshot row) hands it over while the backends still take it."""
        self._before_close.append(callback)

    def __bool__(self) -> bool:
        return bool(self.backends)

    def __enter__(self) -> "MetricLoggers":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(v)}  # bool is an int: 0/1
        if not clean or not self.backends:
            return
        for backend in list(self.backends):
            try:
                backend.log_metrics(clean, step)
            except Exception as exc:  # noqa: BLE001 - any failure of a view must not stop training
                self._drop(backend, f"writing step {step} failed", exc)

    def close(self) -> None:
        callbacks, self._before_close = self._before_close, []
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001
                log.warning("logger: the last rows could not be handed over at close (%s: %s)", type(exc).__name__, exc)
        backends, self.backends = self.backends, []
        for backend in backends:
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001
                self._drop(backend, "closing failed", exc, closing=True)

    def _drop(self, backend: MetricLogger, what: str, exc: Exception, closing: bool = False) -> None:
        if backend in self.backends:
            self.backends.remove(backend)
        self.failed[backend.name] = f"{type(exc).__name__}: {exc}"
        tail = "" if closing else "; it gets no more metrics in this run"
        log.warning("logger.%s: %s (%s: %s)%s; metrics.jsonl keeps every step",
                    backend.name, what, type(exc).__name__, exc, tail)
        if not closing:
            try:
                backend.close()
            except Exception:  # noqa: BLE001 - already reported above
                pass
