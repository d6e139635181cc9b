"""Run records a user (or a test) reads: ``snapshots.jsonl``, ``restore.json``, ``metrics.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nemo_rl.utils.snapshot_store import write_json_atomic


class RunRecords:
    def __init__(self, log_dir: str | Path, metrics_file: str = "metrics.jsonl"):
        self.log_dir = Path(log_dir)
        self.metrics_file = metrics_file  # ``logger.metrics_file``
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open(self.log_dir / name, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

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
