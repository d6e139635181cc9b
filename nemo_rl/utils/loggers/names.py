"""Upstream NeMo-RL's series names for what the run records hold, so dashboards built for upstream read
these runs too. Pure functions of the records; ``SnapshotSeries`` keeps the cumulative outcome counts.

- ``metrics.jsonl`` row -> ``train/<key>``; ``val_<x>`` -> ``validation/<x>``, ``validation_s`` ->
  ``validation/seconds``; the in-run recovery's ``supervisor/*`` and ``gen_fleet/*`` as they are; at the
  row's ``step``. Only numbers (lists, strings, None are left out).
- ``snapshots.jsonl`` rows -> ``timing/rollout_checkpoint/*``, ``rollout/checkpoint/*`` and
  ``rollout/checkpoint_outcome/*``, ONE row per trainer step (the attempt's ``step``): a step has
  several attempts, and one value per step and series keeps every backend's chart a line (TensorBoard
  would also drop earlier points of a step written out of order). The row carries the step's last
  attempt, the worst pause of the step and how many attempts it had; the outcome counts are
  cumulative over the run, as of that last attempt.
- ``restore.json`` -> ``rollout/recovery/*`` and ``timing/rollout_recovery/*`` at the restored step.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

SNAPSHOT_OUTCOMES = ("completed", "skipped", "failed")
# In-run recovery fields of a metrics row, named as upstream's series already (docs/design.md §5.12).
UPSTREAM_PREFIXES = ("supervisor/", "gen_fleet/")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def step_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A ``metrics.jsonl`` row's numbers under ``train/`` and ``validation/`` (``step`` is the axis)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        number = _number(value)
        if key == "step" or number is None:
            continue
        if key == "validation_s":
            out["validation/seconds"] = number
        elif key.startswith(UPSTREAM_PREFIXES):
            out[key] = number  # already named as upstream's supervisor and generation-fleet series
        elif key.startswith("val_"):
            out[f"validation/{key.removeprefix('val_')}"] = number
        else:
            out[f"train/{key}"] = number
    return out


def snapshot_outcome(row: dict[str, Any]) -> str:
    """completed (published), skipped (superseded: training moved on first; not a failure) or failed."""
    if row.get("committed"):
        return "completed"
    return "skipped" if row.get("reason") == "superseded" else "failed"


class SnapshotSeries:
    """Folds ``snapshots.jsonl`` rows into one metrics row per trainer step.

    A step's row is handed out once the first attempt of a later step arrives, or by ``flush``
    at the end of the run (attempts come one at a time, so their steps never go back)."""

    def __init__(self, earlier_rows: Iterable[dict[str, Any]] = ()):
        self.counts: dict[str, float] = {f"rollout/checkpoint_outcome/{o}": 0.0 for o in SNAPSHOT_OUTCOMES}
        for row in earlier_rows:  # a resumed run keeps counting from what its log_dir already holds
            self._count(row)
        self._step: int | None = None
        self._row: dict[str, float] = {}

    def _count(self, row: dict[str, Any]) -> None:
        for key in (f"rollout/checkpoint_outcome/{snapshot_outcome(row)}",
                    *((f"rollout/checkpoint_outcome/reason_{row['reason']}",)
                      if row.get("reason") and not row.get("committed") else ())):
            self.counts[key] = self.counts.get(key, 0.0) + 1.0

    def add(self, row: dict[str, Any]) -> list[tuple[int, dict[str, float]]]:
        """Take one attempt; return the rows that are complete now (the previous step's, if any)."""
        step = int(row.get("step") or 0)
        done = self.flush() if self._step is not None and step != self._step else []
        self._count(row)
        pause = float(row.get("pause_s") or 0.0)
        persist = float(row.get("persist_s") or 0.0)
        worst = max(pause, self._row.get("timing/rollout_checkpoint/max_exclusive_hold_seconds", 0.0))
        attempts = self._row.get("rollout/checkpoint/attempts", 0.0) + 1.0
        self._step = step
        self._row = {
            "timing/rollout_checkpoint/total_save_seconds": pause + persist,
            "timing/rollout_checkpoint/exclusive_hold_seconds": pause,
            "timing/rollout_checkpoint/persist_seconds": persist,
            "timing/rollout_checkpoint/max_exclusive_hold_seconds": worst,
            "rollout/checkpoint/attempts": attempts,
            "rollout/checkpoint/saved_rollouts": float(row.get("saved") or 0),
            "rollout/checkpoint/unsaved_rollouts": float(row.get("unsaved") or 0),
            "rollout/checkpoint/not_admitted_rollouts": float(row.get("not_admitted") or 0),
            "rollout/checkpoint/captured_bytes": float(row.get("captured_bytes") or 0),
            **({"rollout/checkpoint/cuts": float(row.get("cuts") or 0),
                "rollout/checkpoint/cut_tokens": float(row.get("cut_tokens") or 0),
                "rollout/checkpoint/cut_failed": float(row.get("cut_failed") or 0)} if "cuts" in row else {}),
            **self.counts,
        }
        return done

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        if self._step is None:
            return []
        done = [(self._step, self._row)]
        self._step, self._row = None, {}
        return done


def restore_metrics(record: dict[str, Any], seconds: float | None = None) -> dict[str, float]:
    """``restore.json``'s counts under ``rollout/recovery/``; its ``*_s`` timings (and ``seconds``, the
    time from the controller's start to the restore record) under ``timing/rollout_recovery/``."""
    out: dict[str, float] = {}
    for key in ("restored_turn", "restored_prefix", "prefix_tokens", "restarted_from_prompt", "kept_siblings",
                "redone_groups"):
        number = _number(record.get(key))
        if number is not None:
            out[f"rollout/recovery/{key}"] = number
    out["rollout/recovery/from_snapshot"] = float(record.get("snapshot") is not None)
    out["rollout/recovery/skipped_snapshots"] = float(len(record.get("skipped_snapshots") or ()))
    for key, value in record.items():
        number = _number(value)
        if key.endswith("_s") and number is not None:
            out[f"timing/rollout_recovery/{key.removesuffix('_s')}_seconds"] = number
    if seconds is not None:
        out["timing/rollout_recovery/total_seconds"] = seconds
    return out
