"""The rollout-recovery ledger: prompt group -> siblings -> attempts (docs/design.md §5.3, §5.5).

One module per concern: ``levels`` (how much of a rollout survives a crash),
``schema`` (the saved records and ``LedgerState``, schema 2), ``ledger`` (the
mutable ledger and its transitions) and ``restart`` (the per-level restart
rules). What a snapshot asks of Gym is computed from the ledger by the snapshot
planner (``single_controller_utils/rollout_snapshot/planner.py``). Every public name is
re-exported here, so importers use ``nemo_rl.experience.rollout_recovery``.
"""

from nemo_rl.experience.rollout_recovery.ledger import (
    DEFAULT_MAX_ATTEMPTS_PER_SIBLING,
    DispatchRequest,
    LedgerJsonParts,
    RolloutRecoveryLedger,
)
from nemo_rl.experience.rollout_recovery.levels import RecoveryTargetLevel
from nemo_rl.experience.rollout_recovery.restart import RestartSummary, RestoredEpisode
from nemo_rl.experience.rollout_recovery.schema import (
    LIVE_STATUSES,
    ROLLOUT_RECOVERY_SCHEMA_VERSION,
    LedgerError,
    LedgerState,
    PositionRange,
    PromptGroupRecoveryRecord,
    PromptGroupStatus,
    RolloutAttemptRecord,
    RolloutAttemptStatus,
    RolloutRetriesExhausted,
    RolloutSiblingRecord,
    base_rollout_id,
    position_in,
    range_problem,
    with_position,
)

__all__ = [
    "DEFAULT_MAX_ATTEMPTS_PER_SIBLING",
    "LIVE_STATUSES",
    "ROLLOUT_RECOVERY_SCHEMA_VERSION",
    "DispatchRequest",
    "LedgerError",
    "LedgerState",
    "PositionRange",
    "PromptGroupRecoveryRecord",
    "PromptGroupStatus",
    "RecoveryTargetLevel",
    "RestartSummary",
    "RestoredEpisode",
    "RolloutAttemptRecord",
    "RolloutAttemptStatus",
    "LedgerJsonParts",
    "RolloutRecoveryLedger",
    "RolloutRetriesExhausted",
    "RolloutSiblingRecord",
    "base_rollout_id",
    "position_in",
    "range_problem",
    "with_position",
]
