"""Upstream's ``in_order`` sampler: which prompt groups may be reserved, and which may generate, now.

A group is reserved for a target step and trains there. With
``max_lookahead_versions = L`` a group for step T may generate once the served
weights are version ``T - 1 - L`` or newer: step T trains from version T - 1, so
no rollout it trains on is more than L versions old (``max_weight_version_lag``
<= L), also right after a restore, because restored groups pass the same gate.
L = 0 is the synchronous controller: step T + 1's groups start after step T's
refit. Two limits bound the work ahead: groups generating at once
(``max_inflight_prompts``) and sealed rollouts not yet trained
(``max_buffered_rollouts``). Pure reads of the ledger: the controller acts on
the answers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.experience.rollout_recovery import (
    PromptGroupRecoveryRecord,
    PromptGroupStatus,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
)


@dataclass(frozen=True)
class InOrderAdmission:
    lookahead: int
    groups_per_step: int
    max_num_steps: int
    max_inflight_prompts: int
    max_buffered_rollouts: int | None

    @classmethod
    def from_config(cls, config: MasterConfig) -> "InOrderAdmission":
        a, grpo = config.async_rl, config.grpo
        return cls(
            lookahead=a.lookahead,
            groups_per_step=grpo.num_prompts_per_step,
            max_num_steps=grpo.max_num_steps,
            max_inflight_prompts=a.max_inflight_prompts or (a.lookahead + 1) * grpo.num_prompts_per_step,
            max_buffered_rollouts=a.max_buffered_rollouts,
        )

    def newest_target(self, served_step: int) -> int:
        """The last step whose groups may generate while the weights of ``served_step`` are served."""
        return min(served_step + 1 + self.lookahead, self.max_num_steps)

    def may_generate(self, group: PromptGroupRecoveryRecord, served_step: int) -> bool:
        return group.target_step <= self.newest_target(served_step)

    def reservations(self, ledger: RolloutRecoveryLedger, served_step: int, consumed: Collection[str]) -> list[int]:
        """Target steps of the groups to reserve now, oldest first (``consumed``: groups the trainer
        has taken whose step is not durable yet; they stay in the ledger but hold no buffer)."""
        per_target: Counter[int] = Counter()
        inflight = buffered = 0
        sealed = RolloutAttemptStatus.SEALED
        for group in ledger.groups.values():
            per_target[group.target_step] += 1
            if group.status is PromptGroupStatus.GENERATING:
                inflight += 1
                buffered += sum(s.attempts[-1].status is sealed for s in group.siblings)
            elif group.status is PromptGroupStatus.COMPLETE and group.group_id not in consumed:
                buffered += group.expected_generations
        out: list[int] = []
        for target in range(served_step + 1, self.newest_target(served_step) + 1):
            for _ in range(self.groups_per_step - per_target[target]):
                if inflight >= self.max_inflight_prompts:
                    return out
                if self.max_buffered_rollouts is not None and buffered >= self.max_buffered_rollouts:
                    return out
                out.append(target)
                inflight += 1
        return out
