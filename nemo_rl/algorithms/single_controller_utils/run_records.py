"""Run records a user (or a test) reads: ``snapshots.jsonl``, ``restore.json``, ``metrics.jsonl``,
``recoveries.jsonl``.

Each row, once on disk, also goes to the metric backends (``logger.*_enabled``) under upstream's
series names (``nemo_rl.utils.loggers.names``): one place, so the views never disagree with the files."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from nemo_rl.utils.loggers import MetricLoggers
from nemo_rl.utils.loggers.names import SnapshotSeries, restore_metrics, step_metrics
from nemo_rl.utils.atomic_write import write_json_atomic
from nemo_rl.utils.jsonl_rows import read_rows
from nemo_rl.utils.write_errors import naming_write


class RunRecords:
    def __init__(self, log_dir: str | Path, metrics_file: str = "metrics.jsonl",
                 loggers: MetricLoggers | None = None):
        self.log_dir = Path(log_dir)
        self.metrics_file = metrics_file  # ``logger.metrics_file``
        self.opened = time.monotonic()  # the restore's timing runs from here (the controller's start)
        with naming_write(self.log_dir):
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = loggers if loggers is not None else MetricLoggers()
        self._snapshots = SnapshotSeries(self._earlier_attempts() if self.loggers else ())
        self.loggers.before_close(self._flush_snapshots)

    def _append(self, name: str, record: dict[str, Any]) -> None:
        """One line, fsynced. A failed write (``RunWriteError`` naming the file) is cut back off, so
        the file never keeps a torn line that the next append would glue onto."""
        path = self.log_dir / name
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with naming_write(path):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                end = os.lseek(fd, 0, os.SEEK_END)
                try:
                    written = 0
                    while written < len(line):
                        written += os.write(fd, line[written:])
                    os.fsync(fd)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, end)
                    raise
            finally:
                os.close(fd)

    def snapshot_attempt(
        self,
        *,
        checkpoint_id: str,
        committed: bool,
        reason: str,
        saved: int,
        unsaved: int,
        pause_s: float,
        **extra: Any,
    ) -> None:
        self._append(
            "snapshots.jsonl",
            dict(checkpoint_id=checkpoint_id, committed=committed, reason=reason, saved=saved, unsaved=unsaved,
                 pause_s=round(pause_s, 4), **extra),
        )
        if self.loggers:
            row = dict(extra, committed=committed, reason=reason, saved=saved, unsaved=unsaved, pause_s=pause_s)
            for step, metrics in self._snapshots.add(row):
                self.loggers.log_metrics(metrics, step)

    def _earlier_attempts(self) -> list[dict[str, Any]]:
        """This log_dir's earlier attempts (a resumed run counts on from them); a line a kill tore is skipped."""
        return read_rows(self.log_dir / "snapshots.jsonl")

    def _flush_snapshots(self) -> None:
        for step, metrics in self._snapshots.flush():
            self.loggers.log_metrics(metrics, step)

    def recovery(self, row: dict[str, Any]) -> None:
        """One in-run recovery (docs/design.md §5.12), a line of ``recoveries.jsonl``."""
        self._append("recoveries.jsonl", row)

    def metrics(self, record: dict[str, Any]) -> None:
        self._append(self.metrics_file, record)
        if self.loggers:
            self.loggers.log_metrics(step_metrics(record), int(record.get("step") or 0))

    def restore(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.log_dir / "restore.json", record)
        if self.loggers:
            seconds = round(time.monotonic() - self.opened, 4)
            self.loggers.log_metrics(restore_metrics(record, seconds), int(record.get("trainer_step") or 0))

    def read(self, name: str) -> list[dict[str, Any]]:
        return read_rows(self.log_dir / name)
