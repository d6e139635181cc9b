"""Recovery levels: how much of a rollout survives a crash.

Apart from the ledger because the config, the Gym setup checks and the ledger
all read them, and none of those needs the ledger to do so.
"""

from __future__ import annotations

from enum import Enum


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
