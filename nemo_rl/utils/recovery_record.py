"""The schema of a ``recoveries.jsonl`` row (docs/design.md §5.12): written by the in-run recovery
(``single_controller_utils/recovery``), read back by the inspector and the end-of-run table. It lives here,
below both, because ``nemo_rl/utils`` may not import ``nemo_rl/algorithms``.

Each duration is read off one clock, the controller's ``time.monotonic()``; ``time`` is the wall clock at the
loss, for people and plots only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_rl.utils.jsonl_rows import read_rows

NoticedBy = Literal["watch", "rollout", "snapshot"]


class RecoveryRecord(BaseModel):
    """One row of ``recoveries.jsonl``: one recovery of one part. Rows of every part share the schema; a
    field a part has nothing to say about keeps its default. Older rows (fewer fields) read as well."""

    model_config = ConfigDict(extra="ignore")

    time: float  # wall clock of the loss
    instance: str  # the part: "<shard>/replica-<i>", or "generation"
    part: str  # what was lost: a Gym server's name, "replica" (the actor), or "generation"
    cause: str
    # restarted (a server was lost), replaced (the actor or worker was), moved (given up, its rollouts dealt over
    # the shard's others) or given_up (nowhere to move them: the run stops, naming it)
    action: Literal["restarted", "replaced", "moved", "given_up"] = "restarted"
    noticed_by: NoticedBy | None = None
    # where the lost rollouts came back from, and how old that snapshot was when the part was lost
    snapshot: str | None = None
    snapshot_age_s: float | None = None
    # the lost attempts, by capture key (as gym_checkpoint.json names the saved ones)
    continued_turn: list[str] = Field(default_factory=list)
    continued_prefix: list[str] = Field(default_factory=list)
    continued_replay: list[str] = Field(default_factory=list)  # fresh sessions, recorded calls played back (§4.8)
    restarted_from_prompt: list[str] = Field(default_factory=list)
    kept_siblings: int = 0
    # from the loss noticed to the first lost rollout (or model call) sent again; of that, the new part's start
    seconds_to_redispatch: float | None = None
    seconds_to_start: float | None = None
    failed_starts: list[str] = Field(default_factory=list)  # why each new start that did not come up failed
    given_up: str | None = None  # actions "moved" and "given_up": why the part was given up
    # the generation worker's: the lost worker, its log, and the model calls sent again to its successor
    worker: str | None = None
    log: str | None = None
    calls_resent: int = 0
    calls_continued_from_cut: int = 0
    tokens_kept: int = 0

    @classmethod
    def begin(cls, loss: Any) -> "RecoveryRecord":
        """The row as a loss (``recovery.records.Loss``) is noticed; the recovery fills the rest in."""
        return cls(time=loss.at, instance=loss.part, part=loss.component, cause=loss.cause,
                   noticed_by=loss.noticed_by, log=loss.log)

    @property
    def what(self) -> str:
        """What it recovered: ``<replica> <server>``, or ``generation`` for the generation worker."""
        return self.part if self.instance == self.part else f"{self.instance} {self.part}"

    def row(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def read_recoveries(path: str | Path) -> list[RecoveryRecord]:
    """Every row of a ``recoveries.jsonl`` (a line a kill tore, or one that is not a row, is skipped)."""
    rows = []
    for row in read_rows(path):
        with contextlib.suppress(ValidationError):
            rows.append(RecoveryRecord.model_validate(row))
    return rows
