"""The restart rules: what each generating group becomes after a crash (docs/design.md §5.5).

Apart from the transitions because they run once per restore, over every
group at once, and decide by restore level (``turn``: continue what Gym
restored; ``sibling``: keep sealed siblings, rerun the rest from the prompt;
``prompt_group``: redo the group). They edit the ledger through the same two
public record edits its transitions use (``replace_current``, ``append_attempt``), typed here by
shape (``RestartTarget``) so this module does not import the ledger that calls it.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from nemo_rl.experience.rollout_recovery.levels import RecoveryTargetLevel
from nemo_rl.experience.rollout_recovery.schema import (
    LIVE_STATUSES,
    PromptGroupRecoveryRecord,
    PromptGroupStatus,
    RolloutAttemptRecord,
    RolloutAttemptStatus,
    RolloutSiblingRecord,
)

RestoredEpisode = tuple[str, str, int]  # (instance_id, base rollout_id, attempt Gym gave it)


class RestartTarget(Protocol):
    """What the restart rules read and edit of a ledger (``RolloutRecoveryLedger``)."""

    groups: dict[str, PromptGroupRecoveryRecord]

    def replace_current(self, group: PromptGroupRecoveryRecord, sibling: RolloutSiblingRecord,
                        attempt: RolloutAttemptRecord) -> None: ...

    def append_attempt(self, group: PromptGroupRecoveryRecord, sibling: RolloutSiblingRecord) -> str: ...


class RestartSummary(BaseModel):
    """What ``RolloutRecoveryLedger.bring_back`` did (capture keys and group ids)."""

    model_config = ConfigDict(extra="forbid")

    restored_turn: list[str] = Field(default_factory=list)  # new capture keys (attempt+1)
    restarted_from_prompt: list[str] = Field(default_factory=list)  # fresh attempts' ids
    kept_siblings: list[str] = Field(default_factory=list)  # sealed ids kept as they are
    redone_groups: list[str] = Field(default_factory=list)  # prompt_group groups rerun
    # sealed samples that no longer belong to the group: drop them from the data plane
    discarded_rollout_ids: list[str] = Field(default_factory=list)


def apply_restart_rules(
    ledger: RestartTarget, restored: set[RestoredEpisode] | None,
    relocated: dict[str, str] | None = None,
) -> RestartSummary:
    """Apply each generating group's restore level to ``ledger``, in place.

    A restored triple names the replica the attempt ran on; ``relocated`` (base rollout id -> replica)
    says where Gym installed it instead, because that replica no longer runs (elastic restore,
    docs/design.md §5.7): the continued attempt is pinned there. A restored triple that no attempt consumes
    raises ValueError naming them all, after ``ledger`` was changed: pass a staged copy
    (``RolloutRecoveryLedger.bring_back`` does, and adopts it only when this returns).
    """
    pending = set(restored or ())
    relocated = relocated or {}
    summary = RestartSummary()
    for group in ledger.groups.values():
        if group.status is not PromptGroupStatus.GENERATING:
            continue
        level = group.restore_level
        if level is RecoveryTargetLevel.PROMPT_GROUP:
            _redo_group(ledger, group, summary)
            continue
        for sibling in group.siblings:
            _restart_sibling(ledger, group, sibling, level, pending, summary, relocated)
    if pending:
        raise ValueError(
            "Gym restored episodes that no ledger attempt consumes "
            "(instance_id, rollout_id, attempt): " + ", ".join(map(str, sorted(pending)))
        )
    return summary


def apply_recovery_rules(
    ledger: RestartTarget, siblings: list[tuple[PromptGroupRecoveryRecord, RolloutSiblingRecord]],
    restored: set[RestoredEpisode], relocated: dict[str, str] | None = None,
) -> RestartSummary:
    """In-run recovery (docs/design.md §5.12): only ``siblings``, whose live attempts ran on a lost replica,
    change; every other rollout keeps running. A sibling Gym restored continues from its snapshot at the
    next attempt; any other restarts from its prompt as a new attempt (not a failure: a recovery). A
    ``prompt_group`` group is not redone: its other siblings run on, as after an infrastructure retry.
    Every restored triple must belong to one of ``siblings``; otherwise ValueError, before any change."""
    expected = set()
    for group, sibling in siblings:
        attempt = sibling.current_attempt
        expected.add((attempt.gym_instance_id, attempt.base_rollout_id(group.group_id, sibling.generation_index),
                      attempt.gym_attempt + 1))
    stray = set(restored) - expected
    if stray:
        raise ValueError("Gym restored episodes that no recovered rollout consumes "
                         "(instance_id, rollout_id, attempt): " + ", ".join(map(str, sorted(stray))))
    pending, summary = set(restored), RestartSummary()
    for group, sibling in siblings:
        level = group.restore_level
        if level is RecoveryTargetLevel.PROMPT_GROUP:
            level = RecoveryTargetLevel.SIBLING
        _restart_sibling(ledger, group, sibling, level, pending, summary, relocated or {})
    return summary


def _restart_sibling(
    ledger: RestartTarget,
    group: PromptGroupRecoveryRecord,
    sibling: RolloutSiblingRecord,
    level: RecoveryTargetLevel,
    pending: set[RestoredEpisode],
    summary: RestartSummary,
    relocated: dict[str, str],
) -> None:
    """Turn and sibling rules for one sibling: kept, dispatched as planned, continued, or rerun."""
    gid, g = group.group_id, sibling.generation_index
    attempt = sibling.current_attempt
    if attempt.status is RolloutAttemptStatus.SEALED:
        summary.kept_siblings.append(attempt.rollout_id(gid, g))
        return
    if attempt.status is RolloutAttemptStatus.RESERVED and attempt.gym_attempt == 0:
        return  # never started: dispatch it as planned
    if level.requires_gym_checkpoint and attempt.status in LIVE_STATUSES:
        triple = (attempt.gym_instance_id, attempt.base_rollout_id(gid, g), attempt.gym_attempt + 1)
        if triple in pending:
            pending.discard(triple)
            restored = attempt.model_copy(
                update={
                    "status": RolloutAttemptStatus.RESERVED,
                    "gym_attempt": triple[2],
                    "gym_instance_id": relocated.get(triple[1], attempt.gym_instance_id),
                }
            )
            ledger.replace_current(group, sibling, restored)
            summary.restored_turn.append(restored.rollout_id(gid, g))
            return
    # Sibling rule: restart from the prompt as a new attempt.
    if attempt.status in LIVE_STATUSES:
        ledger.replace_current(
            group, sibling, attempt.model_copy(update={"status": RolloutAttemptStatus.ABANDONED})
        )
    summary.restarted_from_prompt.append(ledger.append_attempt(group, sibling))


def _redo_group(
    ledger: RestartTarget, group: PromptGroupRecoveryRecord, summary: RestartSummary
) -> None:
    """Prompt-group rule: unless nothing started, every sibling reruns and its sealed sample is discarded."""
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
            ledger.replace_current(
                group,
                sibling,
                attempt.model_copy(
                    update={"status": RolloutAttemptStatus.ABANDONED, "reward": None}
                ),
            )
        summary.restarted_from_prompt.append(ledger.append_attempt(group, sibling))
