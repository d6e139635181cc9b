"""What the in-run recovery notices (docs/design.md §5.12): one ``Loss`` type for every supervised part. What it
writes is ``nemo_rl.utils.recovery_record.RecoveryRecord`` (re-exported here), the one schema of a
``recoveries.jsonl`` row, read back by the inspector and the end-of-run table.

``Loss.noticed`` is the controller's ``time.monotonic()``, the clock of every ``seconds_*`` field of the row;
``Loss.at`` is the wall clock at the loss, for people and plots only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nemo_rl.utils.recovery_record import NoticedBy, RecoveryRecord

__all__ = ["Loss", "NoticedBy", "RecoveryRecord"]


@dataclass(frozen=True)
class Loss:
    """One part lost, as first noticed. ``incarnation`` is what was lost (a replica's actor handle, a worker's
    start count): a report about an incarnation already replaced is stale and dropped."""

    part: str  # the supervised part: "<shard>/replica-<i>" or "generation"
    component: str  # what of it was lost: a Gym server's name, "replica" (its actor), "generation"
    cause: str  # a short phrase: "died (exit -9, SIGKILL)", "stopped for 4 s", "its Ray actor died (...)"
    noticed_by: NoticedBy
    incarnation: Any = None
    log: str | None = None  # the lost process's log file
    log_tail: str = ""
    noticed: float = field(default_factory=time.monotonic)
    at: float = field(default_factory=time.time)
