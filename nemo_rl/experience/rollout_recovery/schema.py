"""The ledger's saved-state schema: the pydantic records, ``LedgerState`` and position ranges.

Apart from the transitions because this is what a snapshot persists and a
restore validates (``schema_version`` 2): every field, check and error message
here is the on-disk contract, and changes to how the ledger moves between
states must not touch it.
"""

from __future__ import annotations

import bisect
import math
import re
import uuid
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gym_patches.checkpoint.identity import EpisodeId, capture_key
from nemo_rl.experience.rollout_recovery.levels import RecoveryTargetLevel

# 2: trained groups are recorded as merged ranges of dataloader positions
# (``trained_positions``, ``trained_count``), not as a list of ids that grows with the run.
ROLLOUT_RECOVERY_SCHEMA_VERSION = 2

# Group ids become part of Gym rollout ids, so they must be wire-safe.
_GROUP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_UUID_HEX = re.compile(r"^[0-9a-f]{32}$")


class RolloutAttemptStatus(str, Enum):
    RESERVED = "reserved"  # waiting to be sent to Gym
    DISPATCHED = "dispatched"  # running on a Gym instance
    SEALED = "sealed"  # finished; its sample is in the data plane
    FAILED = "failed"  # the rollout errored; a new attempt follows
    ABANDONED = "abandoned"  # superseded by a restart


class PromptGroupStatus(str, Enum):
    GENERATING = "generating"
    COMPLETE = "complete"  # every sibling sealed, not trained yet
    TRAINED = "trained"


# An attempt in one of these may still run (the ledger's transitions and the restart rules ask).
LIVE_STATUSES = (RolloutAttemptStatus.RESERVED, RolloutAttemptStatus.DISPATCHED)
_FINISHED_EARLIER = (RolloutAttemptStatus.FAILED, RolloutAttemptStatus.ABANDONED)


class LedgerError(ValueError):
    """A ledger call that does not fit the recorded state (names the rollout or group)."""


class RolloutRetriesExhausted(LedgerError):
    """A sibling failed ``max_attempts_per_sibling`` times."""

    def __init__(self, rollout_id: str, failures: int):
        super().__init__(
            f"rollout {rollout_id} failed {failures} time(s); "
            "max_attempts_per_sibling reached, not retrying"
        )
        self.rollout_id = rollout_id
        self.failures = failures


def _new_uuid() -> str:
    return uuid.uuid4().hex


def base_rollout_id(group_id: str, generation_index: int, attempt_uuid: str) -> str:
    """The Gym ``rollout_id`` of one attempt (stable across Gym restores)."""
    return f"{group_id}_g{generation_index}_a{attempt_uuid}"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RolloutAttemptRecord(_Record):
    """One try at one sibling; Gym restores keep the uuid and bump ``gym_attempt``."""

    attempt_uuid: str = Field(default_factory=_new_uuid)
    status: RolloutAttemptStatus = RolloutAttemptStatus.RESERVED
    reward: float | None = None
    gym_instance_id: str | None = None
    gym_attempt: int = Field(default=0, ge=0)
    refusals: int = Field(default=0, ge=0)  # times Gym refused its /run while closed (back to reserved)

    @field_validator("attempt_uuid")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not _UUID_HEX.match(value):
            raise ValueError(f"attempt_uuid {value!r} must be 32 lowercase hex digits")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "RolloutAttemptRecord":
        if self.gym_attempt > 0 and self.gym_instance_id is None:
            raise ValueError("gym_attempt > 0 needs a gym_instance_id (the replica that saved it)")
        if self.status is RolloutAttemptStatus.SEALED and self.reward is None:
            raise ValueError("a sealed attempt needs a reward")
        if self.status is RolloutAttemptStatus.DISPATCHED and self.gym_instance_id is None:
            raise ValueError("a dispatched attempt needs a gym_instance_id")
        return self

    def base_rollout_id(self, group_id: str, generation_index: int) -> str:
        return base_rollout_id(group_id, generation_index, self.attempt_uuid)

    def rollout_id(self, group_id: str, generation_index: int) -> str:
        """The capture key: what Gym, the model gate and the data plane call it."""
        return capture_key(self.base_rollout_id(group_id, generation_index), self.gym_attempt)

    def episode(self, group_id: str, generation_index: int) -> EpisodeId:
        return EpisodeId(
            rollout_id=self.base_rollout_id(group_id, generation_index), attempt=self.gym_attempt
        )


class RolloutSiblingRecord(_Record):
    """One generation slot of a group; only the last attempt is live."""

    generation_index: int = Field(ge=0)
    attempts: list[RolloutAttemptRecord] = Field(min_length=1)

    @property
    def current_attempt(self) -> RolloutAttemptRecord:
        return self.attempts[-1]

    @model_validator(mode="after")
    def _only_last_is_live(self) -> "RolloutSiblingRecord":
        for i, attempt in enumerate(self.attempts[:-1]):
            if attempt.status not in _FINISHED_EARLIER:
                raise ValueError(
                    f"attempts[{i}] has status {attempt.status.value!r}; only the last "
                    "attempt may be reserved, dispatched or sealed"
                )
        return self

    def failure_count(self) -> int:
        return sum(a.status is RolloutAttemptStatus.FAILED for a in self.attempts)


class PromptGroupRecoveryRecord(_Record):
    """One prompt and its ``expected_generations`` siblings."""

    group_id: str
    prompt_id: str
    prompt_index: int = Field(ge=0)
    task_source: str | None = None
    agent_name: str | None = None
    restore_level: RecoveryTargetLevel
    expected_generations: int = Field(ge=1)
    target_step: int = Field(ge=0)
    # The dataloader position it was reserved at: unique over the run, so a trained group is
    # remembered by it (as part of a range) once its record is compacted away.
    position: int = Field(ge=0)
    siblings: list[RolloutSiblingRecord]
    status: PromptGroupStatus = PromptGroupStatus.GENERATING
    # The weight version serving when its first rollout was dispatched (upstream's name): the oldest
    # weights that generated any of it, so ``target_step - 1 - start_weight_version`` bounds its lag.
    start_weight_version: int | None = Field(default=None, ge=0)

    @field_validator("group_id")
    @classmethod
    def _group_id(cls, value: str) -> str:
        if not _GROUP_ID.match(value):
            raise ValueError(f"group_id {value!r} must match {_GROUP_ID.pattern}")
        return value

    @model_validator(mode="after")
    def _shape(self) -> "PromptGroupRecoveryRecord":
        if len(self.siblings) != self.expected_generations:
            raise ValueError(
                f"group {self.group_id}: {len(self.siblings)} siblings, "
                f"expected_generations={self.expected_generations}"
            )
        for i, sibling in enumerate(self.siblings):
            if sibling.generation_index != i:
                raise ValueError(
                    f"group {self.group_id}: siblings[{i}] has generation_index "
                    f"{sibling.generation_index}"
                )
        sealed = self.all_sealed()
        if sealed and self.status is PromptGroupStatus.GENERATING:
            raise ValueError(f"group {self.group_id}: every sibling sealed but status generating")
        if not sealed and self.status is not PromptGroupStatus.GENERATING:
            raise ValueError(
                f"group {self.group_id}: status {self.status.value} but not every sibling is sealed"
            )
        return self

    def all_sealed(self) -> bool:
        return all(
            s.current_attempt.status is RolloutAttemptStatus.SEALED for s in self.siblings
        )

    def rollout_id(self, generation_index: int) -> str:
        """Capture key of the sibling's current attempt."""
        return self.siblings[generation_index].current_attempt.rollout_id(
            self.group_id, generation_index
        )


PositionRange = tuple[int, int]  # half-open [lo, hi) of dataloader positions


def position_in(ranges: list[PositionRange], position: int) -> bool:
    """Whether ``position`` lies in one of the sorted, disjoint ``ranges``."""
    i = bisect.bisect_right(ranges, (position, math.inf))
    return i > 0 and position < ranges[i - 1][1]


def with_position(ranges: list[PositionRange], position: int) -> list[PositionRange]:
    """``ranges`` plus ``position`` (not in them: the caller checks), merged with its neighbours; a new list."""
    i = bisect.bisect_right(ranges, (position, math.inf))
    lo, hi = position, position + 1
    left = i > 0 and ranges[i - 1][1] == position
    right = i < len(ranges) and ranges[i][0] == hi
    if left:
        lo = ranges[i - 1][0]
    if right:
        hi = ranges[i][1]
    return [*ranges[: i - 1 if left else i], (lo, hi), *ranges[i + 1 if right else i:]]


def range_problem(ranges: list[PositionRange]) -> str | None:
    """Why ``ranges`` is not in merged form (sorted, non-empty, neither overlapping nor touching), or None."""
    for i, (lo, hi) in enumerate(ranges):
        if lo < 0 or hi <= lo:
            return f"trained_positions[{i}] = [{lo}, {hi}) is empty or negative"
        if i == 0:
            continue
        plo, phi = ranges[i - 1]
        if lo < plo:
            return f"trained_positions[{i}] = [{lo}, {hi}) is not sorted (it comes after [{plo}, {phi}))"
        if lo < phi:
            return f"trained_positions[{i}] = [{lo}, {hi}) overlaps [{plo}, {phi}) (a position trained twice?)"
        if lo == phi:
            return f"trained_positions[{i}] = [{lo}, {hi}) touches [{plo}, {phi}): ranges must be merged"
    return None


class LedgerState(BaseModel):
    """The persisted form of the ledger (``state_dict``).

    Trained groups are kept as ``trained_positions`` (merged ``[lo, hi)``
    ranges of their dataloader positions) and ``trained_count``: in order they
    are one range, out of order a few more, so the state stays as large as
    the work in flight however long the run is.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[2] = ROLLOUT_RECOVERY_SCHEMA_VERSION
    max_attempts_per_sibling: int = Field(ge=1)
    groups: list[PromptGroupRecoveryRecord]
    trained_positions: list[tuple[int, int]]
    trained_count: int = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _known_schema(cls, data: Any) -> Any:
        """An older ledger is refused with what to do, not with a list of missing fields."""
        if not isinstance(data, dict):
            return data
        version = data.get("schema_version", ROLLOUT_RECOVERY_SCHEMA_VERSION)
        if version == ROLLOUT_RECOVERY_SCHEMA_VERSION:
            return data
        if version == 1 or "trained_group_ids" in data:
            raise ValueError(
                f"ledger schema_version {version!r} (a list of trained_group_ids) was written by an older "
                f"version of this code, which reads schema_version {ROLLOUT_RECOVERY_SCHEMA_VERSION} (trained "
                "dataloader positions as ranges); it cannot resume that checkpoint: use a new checkpoint_dir"
            )
        raise ValueError(
            f"ledger schema_version {version!r} is unknown; this code reads {ROLLOUT_RECOVERY_SCHEMA_VERSION}"
        )

    @model_validator(mode="after")
    def _consistent(self) -> "LedgerState":
        seen: set[str] = set()
        uuids: set[str] = set()
        positions: dict[int, str] = {}
        for group in self.groups:
            if group.group_id in seen:
                raise ValueError(f"duplicate group_id {group.group_id}")
            seen.add(group.group_id)
            if group.position in positions:
                raise ValueError(
                    f"groups {positions[group.position]} and {group.group_id} share dataloader position "
                    f"{group.position}"
                )
            positions[group.position] = group.group_id
            for sibling in group.siblings:
                for attempt in sibling.attempts:
                    if attempt.attempt_uuid in uuids:
                        raise ValueError(
                            f"group {group.group_id}: attempt_uuid {attempt.attempt_uuid} reused"
                        )
                    uuids.add(attempt.attempt_uuid)
        problem = range_problem(self.trained_positions)
        if problem:
            raise ValueError(problem)
        counted = sum(hi - lo for lo, hi in self.trained_positions)
        if counted != self.trained_count:
            raise ValueError(f"trained_count is {self.trained_count} but trained_positions hold {counted} positions")
        for group in self.groups:  # trained groups may be compacted away, never left out of the ranges
            trained = position_in(self.trained_positions, group.position)
            if group.status is PromptGroupStatus.TRAINED and not trained:
                raise ValueError(
                    f"group {group.group_id} is trained but its position {group.position} is not in trained_positions"
                )
            if group.status is not PromptGroupStatus.TRAINED and trained:
                raise ValueError(
                    f"group {group.group_id} is {group.status.value} but its position {group.position} is in "
                    "trained_positions (trained already)"
                )
        return self

