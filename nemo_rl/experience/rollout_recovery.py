"""The rollout-recovery ledger: prompt group -> siblings -> attempts.

The ledger is the RL side's single record of which rollout attempts exist,
where they run and which are sealed. It is pure bookkeeping (no Ray, no HTTP),
so a snapshot of it plus the data plane is a consistent cut, and a restart can
decide per prompt group whether a rollout continues from its last turn, starts
over from its prompt, or the whole group is redone (DESIGN §4.3, §4.5).
"""

from __future__ import annotations

import bisect
import math
import re
import uuid
from enum import Enum
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gym_patches.checkpoint.identity import EpisodeId, capture_key

# 2: trained groups are recorded as merged ranges of dataloader positions
# (``trained_positions``, ``trained_count``), not as a list of ids that grows with the run.
ROLLOUT_RECOVERY_SCHEMA_VERSION = 2
DEFAULT_MAX_ATTEMPTS_PER_SIBLING = 3

# Group ids become part of Gym rollout ids, so they must be wire-safe.
_GROUP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_UUID_HEX = re.compile(r"^[0-9a-f]{32}$")


class RecoveryTargetLevel(str, Enum):
    """How much of a rollout survives a crash, finest first."""

    PREFIX = "prefix"  # Gym state plus tokens already decoded in the active call
    TURN = "turn"  # Gym state; the active model call is issued again
    SIBLING = "sibling"  # sealed siblings kept, unfinished ones rerun from the prompt
    PROMPT_GROUP = "prompt_group"  # the whole group is rerun

    @property
    def rank(self) -> int:
        return _LEVEL_RANK[self]

    @property
    def requires_gym_checkpoint(self) -> bool:
        """Whether restoring at this level needs Gym to save live sessions."""
        return self in (RecoveryTargetLevel.PREFIX, RecoveryTargetLevel.TURN)

    def is_coarser_or_equal(self, other: "RecoveryTargetLevel") -> bool:
        return self.rank >= other.rank


_LEVEL_RANK = {
    RecoveryTargetLevel.PREFIX: 0,
    RecoveryTargetLevel.TURN: 1,
    RecoveryTargetLevel.SIBLING: 2,
    RecoveryTargetLevel.PROMPT_GROUP: 3,
}


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


_LIVE = (RolloutAttemptStatus.RESERVED, RolloutAttemptStatus.DISPATCHED)
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


class DispatchRequest(NamedTuple):
    """An attempt to send to Gym; ``gym_instance_id`` is set when it must go back
    to the replica that saved it."""

    group_id: str
    generation_index: int
    rollout_id: str
    gym_instance_id: str | None


class RestartSummary(BaseModel):
    """What ``prepare_for_restart`` did (capture keys and group ids)."""

    model_config = ConfigDict(extra="forbid")

    restored_turn: list[str] = Field(default_factory=list)  # new capture keys (attempt+1)
    restarted_from_prompt: list[str] = Field(default_factory=list)  # fresh attempts' ids
    kept_siblings: list[str] = Field(default_factory=list)  # sealed ids kept as they are
    redone_groups: list[str] = Field(default_factory=list)  # prompt_group groups rerun
    # sealed samples that no longer belong to the group: drop them from the data plane
    discarded_rollout_ids: list[str] = Field(default_factory=list)


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


class RolloutRecoveryLedger:
    """Mutable ledger; every error names the rollout id or group id involved."""

    def __init__(self, max_attempts_per_sibling: int = DEFAULT_MAX_ATTEMPTS_PER_SIBLING):
        if max_attempts_per_sibling < 1:
            raise ValueError("max_attempts_per_sibling must be >= 1")
        self.max_attempts_per_sibling = max_attempts_per_sibling
        self.groups: dict[str, PromptGroupRecoveryRecord] = {}
        # Positions of every group trained this run, as merged [lo, hi) ranges (see LedgerState).
        self.trained_positions: list[PositionRange] = []
        self._by_base: dict[str, tuple[str, int, int]] = {}  # base id -> (group, g, attempt idx)
        self._by_position: dict[int, str] = {}  # dataloader position -> group id in the ledger

    @property
    def trained_count(self) -> int:
        """How many groups this run has trained (compacted ones included)."""
        return sum(hi - lo for lo, hi in self.trained_positions)

    def is_trained_position(self, position: int) -> bool:
        return position_in(self.trained_positions, position)

    # ----- lifecycle -------------------------------------------------------
    def reserve_group(
        self,
        group_id: str,
        prompt_id: str,
        prompt_index: int,
        task_source: str | None,
        agent_name: str | None,
        restore_level: RecoveryTargetLevel | str,
        num_generations: int,
        target_step: int,
        *,
        position: int,
    ) -> PromptGroupRecoveryRecord:
        """Record a new prompt group with one reserved attempt per generation.

        ``position`` is the dataloader position it takes; one already trained
        or held by another group is refused, so no prompt is trained twice.
        """
        if group_id in self.groups:
            raise LedgerError(f"group {group_id} is already in the ledger")
        if self.is_trained_position(position):
            raise LedgerError(f"group {group_id}: dataloader position {position} was already trained")
        if position in self._by_position:
            raise LedgerError(
                f"group {group_id}: dataloader position {position} is held by group {self._by_position[position]}"
            )
        if num_generations < 1:
            raise LedgerError(f"group {group_id}: num_generations must be >= 1")
        group = PromptGroupRecoveryRecord(
            group_id=group_id,
            prompt_id=prompt_id,
            prompt_index=prompt_index,
            task_source=task_source,
            agent_name=agent_name,
            restore_level=RecoveryTargetLevel(restore_level),
            expected_generations=num_generations,
            target_step=target_step,
            position=position,
            siblings=[
                RolloutSiblingRecord(generation_index=g, attempts=[RolloutAttemptRecord()])
                for g in range(num_generations)
            ],
        )
        # Validates the ids against Gym's rollout-id rules before anything is stored.
        for g in range(num_generations):
            group.siblings[g].current_attempt.episode(group_id, g)
        self.groups[group_id] = group
        self._index_group(group)
        return group

    def reserved_attempts(self) -> list[DispatchRequest]:
        """Every current attempt waiting for dispatch, in reservation order."""
        out = []
        for group in self.groups.values():
            if group.status is not PromptGroupStatus.GENERATING:
                continue
            for sibling in group.siblings:
                attempt = sibling.current_attempt
                if attempt.status is RolloutAttemptStatus.RESERVED:
                    out.append(
                        DispatchRequest(
                            group.group_id,
                            sibling.generation_index,
                            attempt.rollout_id(group.group_id, sibling.generation_index),
                            attempt.gym_instance_id,
                        )
                    )
        return out

    def mark_dispatched(self, rollout_id: str, gym_instance_id: str) -> None:
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status is not RolloutAttemptStatus.RESERVED:
            raise LedgerError(
                f"rollout {rollout_id} is {attempt.status.value}, only a reserved attempt "
                "can be dispatched"
            )
        if attempt.gym_attempt > 0 and attempt.gym_instance_id != gym_instance_id:
            raise LedgerError(
                f"rollout {rollout_id} was restored by Gym instance {attempt.gym_instance_id} "
                f"and must return to it, not to {gym_instance_id}"
            )
        self._replace_current(
            group,
            sibling,
            attempt.model_copy(
                update={"status": RolloutAttemptStatus.DISPATCHED, "gym_instance_id": gym_instance_id}
            ),
        )

    def mark_refused(self, rollout_id: str, max_refusals: int) -> int:
        """Gym refused a dispatched attempt (closed for a checkpoint): it is reserved again.

        A fresh attempt forgets its replica (Gym never had it); a restored one
        keeps it (its saved session waits there). Returns the refusal count;
        past ``max_refusals`` it raises, naming the rollout.
        """
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status is not RolloutAttemptStatus.DISPATCHED:
            raise LedgerError(f"cannot mark rollout {rollout_id} refused: it is {attempt.status.value}")
        refusals = attempt.refusals + 1
        if refusals > max_refusals:
            raise LedgerError(
                f"rollout {rollout_id} was refused by Gym {refusals} times (the limit is {max_refusals}); "
                "Gym keeps its admission closed"
            )
        self._replace_current(
            group,
            sibling,
            attempt.model_copy(update={
                "status": RolloutAttemptStatus.RESERVED,
                "refusals": refusals,
                "gym_instance_id": attempt.gym_instance_id if attempt.gym_attempt > 0 else None,
            }),
        )
        return refusals

    def refused_waiting(self) -> list[str]:
        """Turn-level attempts Gym refused that wait for redispatch (never admitted)."""
        return [
            group.rollout_id(sibling.generation_index)
            for group in self.groups.values()
            if group.status is PromptGroupStatus.GENERATING and group.restore_level.requires_gym_checkpoint
            for sibling in group.siblings
            if sibling.current_attempt.status is RolloutAttemptStatus.RESERVED
            and sibling.current_attempt.refusals > 0 and sibling.current_attempt.gym_attempt == 0
        ]

    def mark_sealed(self, rollout_id: str, reward: float) -> PromptGroupRecoveryRecord:
        """Seal a dispatched attempt; the group becomes complete with its last sibling."""
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status is not RolloutAttemptStatus.DISPATCHED:
            raise LedgerError(
                f"cannot seal rollout {rollout_id}: it is {attempt.status.value}, not dispatched"
            )
        self._replace_current(
            group,
            sibling,
            attempt.model_copy(update={"status": RolloutAttemptStatus.SEALED, "reward": float(reward)}),
        )
        if group.all_sealed():
            group.status = PromptGroupStatus.COMPLETE
        return group

    def mark_failed(self, rollout_id: str) -> str:
        """Fail a live attempt and reserve a retry from the prompt; returns its id."""
        group, sibling, attempt = self._current(rollout_id)
        if attempt.status not in _LIVE:
            raise LedgerError(
                f"cannot fail rollout {rollout_id}: it is {attempt.status.value}"
            )
        self._replace_current(
            group, sibling, attempt.model_copy(update={"status": RolloutAttemptStatus.FAILED})
        )
        failures = sibling.failure_count()
        if failures >= self.max_attempts_per_sibling:
            raise RolloutRetriesExhausted(rollout_id, failures)
        return self._append_attempt(group, sibling)

    def complete_groups(self) -> list[PromptGroupRecoveryRecord]:
        """Groups whose siblings are all sealed and which are not trained yet."""
        return [g for g in self.groups.values() if g.status is PromptGroupStatus.COMPLETE]

    def mark_group_trained(self, group_id: str) -> None:
        """Record a complete group as trained; refused if it (or its position) was trained already."""
        group = self._group(group_id)
        if group.status is PromptGroupStatus.TRAINED or self.is_trained_position(group.position):
            raise LedgerError(f"group {group_id} (position {group.position}) was already trained")
        if group.status is not PromptGroupStatus.COMPLETE:
            raise LedgerError(f"group {group_id} is {group.status.value}, not complete")
        group.status = PromptGroupStatus.TRAINED
        self.trained_positions = with_position(self.trained_positions, group.position)

    def compact_trained(self, group_ids) -> list[str]:
        """Drop the records of trained groups (their positions stay in ``trained_positions``).

        Returns the Gym rollout ids of every attempt they had, for Gym to forget.
        Keeps the ledger, and every snapshot of it, as large as the work in flight.
        """
        rollout_ids = []
        for group_id in group_ids:
            group = self._group(group_id)
            if group.status is not PromptGroupStatus.TRAINED:
                raise LedgerError(f"group {group_id} is {group.status.value}; only trained groups are compacted")
            for sibling in group.siblings:
                for attempt in sibling.attempts:
                    base = attempt.base_rollout_id(group_id, sibling.generation_index)
                    rollout_ids.append(base)
                    self._by_base.pop(base, None)
            self._by_position.pop(group.position, None)
            del self.groups[group_id]
        return rollout_ids

    def attempt_status(self, rollout_id: str) -> RolloutAttemptStatus | None:
        """Status of a current attempt in a generating group; None if the id is
        unknown, superseded, or its group is already complete."""
        try:
            _, _, attempt = self._current(rollout_id)
        except LedgerError:
            return None
        return attempt.status

    def sealed_rollout_ids(self) -> set[str]:
        """Capture keys of every sealed current attempt (what the data plane must hold)."""
        return {
            g.rollout_id(s.generation_index)
            for g in self.groups.values()
            if g.status is not PromptGroupStatus.TRAINED
            for s in g.siblings
            if s.current_attempt.status is RolloutAttemptStatus.SEALED
        }

    # ----- Gym checkpoint inventory ----------------------------------------
    def gym_checkpoint_inventory(self, instance_ids) -> dict[str, list[EpisodeId]]:
        """Turn-level rollouts Gym holds per instance (what a snapshot commits).

        Current attempts that are dispatched, or reserved after a Gym restore,
        in groups whose restore level needs Gym saves. An attempt on an
        instance outside ``instance_ids`` means the topology changed: error.
        """
        return {iid: [EpisodeId.from_capture_key(key) for key in agents]
                for iid, agents in self.gym_checkpoint_agents(instance_ids).items()}

    def gym_checkpoint_keys(self, instance_ids) -> dict[str, set[str]]:
        """The capture keys of ``gym_checkpoint_inventory`` (no EpisodeId built: this runs in the cut)."""
        return {iid: set(agents) for iid, agents in self.gym_checkpoint_agents(instance_ids).items()}

    def gym_checkpoint_agents(self, instance_ids) -> dict[str, dict[str, str | None]]:
        """``gym_checkpoint_keys`` with each rollout's agent: capture key -> ``agent_name`` (one pass)."""
        out: dict[str, dict[str, str | None]] = {iid: {} for iid in instance_ids}
        for group, g, attempt in self._turn_level_live():
            agents = out.get(attempt.gym_instance_id)
            if agents is None:
                raise LedgerError(
                    f"rollout {attempt.rollout_id(group.group_id, g)} is held by Gym instance "
                    f"{attempt.gym_instance_id}, which is not in the live topology {sorted(out)}"
                )
            agents[attempt.rollout_id(group.group_id, g)] = group.agent_name
        return out

    def _turn_level_live(self):
        for group in self.groups.values():
            if group.status is not PromptGroupStatus.GENERATING:
                continue
            if not group.restore_level.requires_gym_checkpoint:
                continue
            for sibling in group.siblings:
                attempt = sibling.current_attempt
                if attempt.status is RolloutAttemptStatus.DISPATCHED or (
                    attempt.status is RolloutAttemptStatus.RESERVED and attempt.gym_attempt > 0
                ):
                    yield group, sibling.generation_index, attempt

    # ----- restart ----------------------------------------------------------
    def prepare_for_restart(self, restored: set[tuple[str, str, int]] | None = None) -> RestartSummary:
        """Apply the per-level restart rules to every generating group (DESIGN §4.5).

        ``restored`` holds ``(instance_id, base rollout_id, attempt)`` for each
        episode Gym restored, with the attempt number Gym gave it (the saved
        attempt + 1): attempt numbers are Gym's everywhere, the ledger never
        re-derives them. The ledger is only changed if every restored triple is
        consumed; otherwise ValueError names them.
        """
        pending = set(restored or ())
        summary = RestartSummary()
        new_groups = {gid: g.model_copy(deep=True) for gid, g in self.groups.items()}
        staged = RolloutRecoveryLedger(self.max_attempts_per_sibling)
        staged.groups = new_groups
        staged.trained_positions = list(self.trained_positions)
        staged._reindex()
        for group in new_groups.values():
            if group.status is not PromptGroupStatus.GENERATING:
                continue
            level = group.restore_level
            if level is RecoveryTargetLevel.PROMPT_GROUP:
                staged._redo_group(group, summary)
                continue
            for sibling in group.siblings:
                staged._restart_sibling(group, sibling, level, pending, summary)
        if pending:
            raise ValueError(
                "Gym restored episodes that no ledger attempt consumes "
                "(instance_id, rollout_id, attempt): " + ", ".join(map(str, sorted(pending)))
            )
        self.groups = staged.groups
        self._reindex()
        return summary

    def _restart_sibling(self, group, sibling, level, pending, summary) -> None:
        gid, g = group.group_id, sibling.generation_index
        attempt = sibling.current_attempt
        if attempt.status is RolloutAttemptStatus.SEALED:
            summary.kept_siblings.append(attempt.rollout_id(gid, g))
            return
        if attempt.status is RolloutAttemptStatus.RESERVED and attempt.gym_attempt == 0:
            return  # never started: dispatch it as planned
        if level.requires_gym_checkpoint and attempt.status in _LIVE:
            triple = (attempt.gym_instance_id, attempt.base_rollout_id(gid, g), attempt.gym_attempt + 1)
            if triple in pending:
                pending.discard(triple)
                restored = attempt.model_copy(
                    update={
                        "status": RolloutAttemptStatus.RESERVED,
                        "gym_attempt": triple[2],
                    }
                )
                self._replace_current(group, sibling, restored)
                summary.restored_turn.append(restored.rollout_id(gid, g))
                return
        # Sibling rule: restart from the prompt as a new attempt.
        if attempt.status in _LIVE:
            self._replace_current(
                group, sibling, attempt.model_copy(update={"status": RolloutAttemptStatus.ABANDONED})
            )
        summary.restarted_from_prompt.append(self._append_attempt(group, sibling))

    def _redo_group(self, group, summary) -> None:
        untouched = all(
            s.current_attempt.status is RolloutAttemptStatus.RESERVED
            and s.current_attempt.gym_attempt == 0
            for s in group.siblings
        )
        if untouched:
            return
        summary.redone_groups.append(group.group_id)
        for sibling in group.siblings:
            attempt = sibling.current_attempt
            g = sibling.generation_index
            if attempt.status is RolloutAttemptStatus.SEALED:
                summary.discarded_rollout_ids.append(attempt.rollout_id(group.group_id, g))
            if attempt.status is not RolloutAttemptStatus.FAILED:
                self._replace_current(
                    group,
                    sibling,
                    attempt.model_copy(
                        update={"status": RolloutAttemptStatus.ABANDONED, "reward": None}
                    ),
                )
            summary.restarted_from_prompt.append(self._append_attempt(group, sibling))

    # ----- persistence -----------------------------------------------------
    def _state(self) -> LedgerState:
        return LedgerState(
            max_attempts_per_sibling=self.max_attempts_per_sibling,
            groups=list(self.groups.values()),
            trained_positions=list(self.trained_positions),
            trained_count=self.trained_count,
        )

    def state_dict(self) -> dict:
        """Pure-JSON state (enums as strings)."""
        return self._state().model_dump(mode="json")

    def state_json(self) -> bytes:
        """``state_dict`` as JSON bytes, serialised by pydantic-core in one pass (about twice as fast:
        a snapshot takes it while rollouts are held)."""
        state = self._state()
        return state.__pydantic_serializer__.to_json(state)

    def load_state_dict(self, state: dict) -> None:
        """Replace the ledger with a validated state; unknown fields are rejected."""
        parsed = LedgerState.model_validate(state)
        self.max_attempts_per_sibling = parsed.max_attempts_per_sibling
        self.groups = {g.group_id: g for g in parsed.groups}
        self.trained_positions = [tuple(r) for r in parsed.trained_positions]
        self._reindex()

    @classmethod
    def from_state_dict(cls, state: dict) -> "RolloutRecoveryLedger":
        ledger = cls()
        ledger.load_state_dict(state)
        return ledger

    # ----- internals -------------------------------------------------------
    def _group(self, group_id: str) -> PromptGroupRecoveryRecord:
        try:
            return self.groups[group_id]
        except KeyError:
            raise LedgerError(
                f"unknown group {group_id}: not in the ledger (never reserved, or trained and compacted)"
            ) from None

    def _current(self, rollout_id: str):
        """(group, sibling, attempt) for the capture key of a current attempt."""
        try:
            episode = EpisodeId.from_capture_key(rollout_id)
        except ValueError:
            raise LedgerError(f"malformed rollout id {rollout_id!r}") from None
        where = self._by_base.get(episode.rollout_id)
        if where is None:
            raise LedgerError(f"unknown rollout {rollout_id}")
        group_id, g, idx = where
        group = self.groups[group_id]
        sibling = group.siblings[g]
        attempt = sibling.attempts[idx]
        if idx != len(sibling.attempts) - 1:
            raise LedgerError(
                f"rollout {rollout_id} is not the current attempt of {group_id} g{g} "
                f"(it is {attempt.status.value})"
            )
        if attempt.gym_attempt != episode.attempt:
            raise LedgerError(
                f"rollout {rollout_id} is stale: the current Gym attempt is "
                f"{attempt.rollout_id(group_id, g)}"
            )
        if group.status is not PromptGroupStatus.GENERATING:
            raise LedgerError(f"rollout {rollout_id}: group {group_id} is {group.status.value}")
        return group, sibling, attempt

    def _replace_current(self, group, sibling, attempt: RolloutAttemptRecord) -> None:
        sibling.attempts = [*sibling.attempts[:-1], attempt]

    def _append_attempt(self, group, sibling) -> str:
        attempt = RolloutAttemptRecord()
        sibling.attempts = [*sibling.attempts, attempt]
        g = sibling.generation_index
        self._by_base[attempt.base_rollout_id(group.group_id, g)] = (
            group.group_id,
            g,
            len(sibling.attempts) - 1,
        )
        return attempt.rollout_id(group.group_id, g)

    def _index_group(self, group: PromptGroupRecoveryRecord) -> None:
        self._by_position[group.position] = group.group_id
        for sibling in group.siblings:
            for idx, attempt in enumerate(sibling.attempts):
                base = attempt.base_rollout_id(group.group_id, sibling.generation_index)
                self._by_base[base] = (group.group_id, sibling.generation_index, idx)

    def _reindex(self) -> None:
        self._by_base = {}
        self._by_position = {}
        for group in self.groups.values():
            self._index_group(group)
