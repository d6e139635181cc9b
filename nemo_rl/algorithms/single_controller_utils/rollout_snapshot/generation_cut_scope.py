"""Which rollouts' model calls a snapshot's generation cut takes: those at prefix level.

The level is per rollout (its group's ``restore_level``: the target, or an agent's or task
source's override), so a prefix target can hold rollouts at ``turn`` whose calls must never be
cut (docs/design.md §5.10). Read from the ledger with the dispatch gate closed, so no rollout is
dispatched between this read and the prepare it goes into.
"""

from __future__ import annotations

from nemo_rl.experience.rollout_recovery import PromptGroupStatus, RecoveryTargetLevel, RolloutRecoveryLedger


def prefix_rollouts(ledger: RolloutRecoveryLedger) -> dict[str, list[str]] | None:
    """Per Gym instance, the rollout ids of the prefix-level rollouts it holds now; None when every
    generating group is at prefix level (the cut may take every call in flight: nothing is sent, so
    the common case adds no list to the pause)."""
    generating, prefix = PromptGroupStatus.GENERATING, RecoveryTargetLevel.PREFIX
    if all(g.restore_level is prefix for g in ledger.groups.values() if g.status is generating):
        return None
    out: dict[str, list[str]] = {}
    for group, index, attempt in ledger.turn_level_live():
        if group.restore_level is prefix and attempt.gym_instance_id is not None:
            out.setdefault(attempt.gym_instance_id, []).append(attempt.base_rollout_id(group.group_id, index))
    return out
