"""Optional metric backends (TensorBoard, W&B, MLflow) behind one small interface.

``metrics.jsonl`` / ``snapshots.jsonl`` / ``restore.json`` stay the run's always-on record; these
are views of the same rows under upstream NeMo-RL's series names (``names.py``), each installed
by its own extra (``pip install '.[tensorboard]'``, ``'.[wandb]'``, ``'.[mlflow]'``).
"""

from nemo_rl.utils.loggers.base import LoggerStartError, MetricLogger
from nemo_rl.utils.loggers.factory import open_loggers, tensorboard_dir
from nemo_rl.utils.loggers.fanout import MetricLoggers

__all__ = ["LoggerStartError", "MetricLogger", "MetricLoggers", "open_loggers", "tensorboard_dir"]
