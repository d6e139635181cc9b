"""Reward for a workplace row: do the final tables equal ``expected_state``?

Only the mutable tables (events, emails, tasks) are compared, so read-only
calls cost nothing. Strings compare case-insensitively and trimmed; rows are
matched by id, so the same actions in the same order are required.
"""

from __future__ import annotations

from typing import Any

from .world import MutableTables, OfficeWorld, WorldStateError, validate_model

_ID_KEYS = {"events": "event_id", "emails": "email_id", "tasks": "task_id"}


def _normalise(value: Any) -> Any:
    if isinstance(value, str):
        return value.strip().lower()
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    return value


def _canonical(tables: dict) -> dict:
    return {
        table: sorted(_normalise(tables[table]), key=lambda r: r[key])
        for table, key in _ID_KEYS.items()
    }


def expected_tables(row: Any) -> dict:
    """The row's ``expected_state``, validated like a real table set."""
    if not isinstance(row, dict) or "expected_state" not in row:
        raise WorldStateError("row has no 'expected_state'")
    return validate_model(MutableTables, row["expected_state"], "expected_state").model_dump(mode="json")


def verify(world: OfficeWorld, row: Any) -> float:
    """1.0 if every mutable table matches the row's expected state, else 0.0."""
    expected = expected_tables(row)
    return 1.0 if _canonical(world.mutable_tables()) == _canonical(expected) else 0.0


__all__ = ["verify", "expected_tables"]
