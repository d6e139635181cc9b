"""Run records a user (or a test) reads: ``snapshots.jsonl``, ``restore.json``, ``metrics.jsonl``."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from nemo_rl.utils.snapshot_store import write_json_atomic
from nemo_rl.utils.write_errors import naming_write


class RunRecords:
    def __init__(self, log_dir: str | Path, metrics_file: str = "metrics.jsonl"):
        self.log_dir = Path(log_dir)
        self.metrics_file = metrics_file  # ``logger.metrics_file``
        with naming_write(self.log_dir):
            self.log_dir.mkdir(parents=True, exist_ok=True)

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

    def metrics(self, record: dict[str, Any]) -> None:
        self._append(self.metrics_file, record)

    def restore(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.log_dir / "restore.json", record)

    def read(self, name: str) -> list[dict[str, Any]]:
        path = self.log_dir / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
