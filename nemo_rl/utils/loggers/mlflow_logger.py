"""MLflow: one run per launch through ``MlflowClient`` (no process-global active run). The default
store is SQLite in ``logger.log_dir/mlruns``: MLflow 3 refuses its plain-file store unless told
``MLFLOW_ALLOW_FILE_STORE=true``, so a ``file:`` uri works only with that set."""

from __future__ import annotations

import time
from pathlib import Path

from nemo_rl.utils.loggers.base import LoggerStartError

STORE_DIR = "mlruns"  # under logger.log_dir: the database and the artifacts


def default_tracking_uri(log_dir: str | Path) -> str:
    return f"sqlite:///{(Path(log_dir) / STORE_DIR / 'mlflow.db').resolve()}"


class MlflowLogger:
    name = "mlflow"

    def __init__(self, log_dir: str | Path, experiment_name: str, run_name: str | None, tracking_uri: str | None):
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise LoggerStartError(
                f"logger.mlflow_enabled=true but mlflow is not installed: pip install '.[mlflow]' ({exc})"
            ) from None
        self._metric = Metric
        store = Path(log_dir) / STORE_DIR
        uri = tracking_uri or default_tracking_uri(log_dir)
        try:
            if tracking_uri is None:
                store.mkdir(parents=True, exist_ok=True)
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(experiment_name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:  # a local store keeps its artifacts next to the database, not in the working directory
                artifacts = (store / "artifacts").resolve().as_uri() if tracking_uri is None else None
                experiment_id = self.client.create_experiment(experiment_name, artifact_location=artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        except Exception as exc:  # noqa: BLE001 - MlflowException, SQLAlchemy, OSError, requests ...
            raise LoggerStartError(
                f"logger.mlflow.tracking_uri: MLflow cannot open tracking store {uri!r}: {type(exc).__name__}: {exc}"
            ) from None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now_ms, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
