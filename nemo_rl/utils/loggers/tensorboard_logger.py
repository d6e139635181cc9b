"""TensorBoard event files, written by torch's ``SummaryWriter`` (the ``tensorboard`` extra supplies the
protos it writes and the reader that reads them back)."""

from __future__ import annotations

from pathlib import Path

from nemo_rl.utils.loggers.base import LoggerStartError


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise LoggerStartError(
                f"logger.tensorboard_enabled=true but tensorboard is not installed: pip install '.[tensorboard]' ({exc})"
            ) from None
        self.log_dir = Path(log_dir)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # flush_secs is long: log_metrics flushes each row itself, so a row is on disk when it returns
            self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=3600)
        except OSError as exc:
            raise LoggerStartError(f"logger.tensorboard.log_dir={str(self.log_dir)!r}: cannot write there ({exc})") from None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        # The writer's thread reports a failed write at the next flush: raise it here, for this row.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
