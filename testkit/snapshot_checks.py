"""The snapshot's ownership check and counts on a ledger as it stands, for tests.

The product checks after resume, on the copies its pause took (``planner.check_ownership(held=...)``,
``count_snapshot(owned=..., refused_waiting=...)``); a test with no pause in between takes those copies
from the ledger right now, here, so the product carries no mode that only tests use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import (
    FirstCounts,
    SnapshotCounts,
    SnapshotPlan,
    check_ownership,
    count_snapshot,
    gym_checkpoint_keys,
    held_sets,
)
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger


def check_ownership_now(ledger: RolloutRecoveryLedger, plan: SnapshotPlan,
                        exported: Mapping[str, Iterable[str]],
                        not_started: Mapping[str, Iterable[str]] | None = None) -> dict[str, set[str]]:
    """``check_ownership`` on what ``ledger`` holds now (as if the pause were this instant)."""
    return check_ownership(plan, exported, not_started, held=gym_checkpoint_keys(ledger, plan.topology))


def count_snapshot_now(ledger: RolloutRecoveryLedger, plan: SnapshotPlan, exported: Mapping[str, Iterable[str]],
                       owned: Mapping[str, set[str]] | None = None, first: FirstCounts | None = None,
                       not_started: Mapping[str, Iterable[str]] | None = None) -> SnapshotCounts:
    """``count_snapshot`` on what ``ledger`` holds now (``owned``: from ``check_ownership_now``, else what the
    ledger holds, unchecked)."""
    if owned is None:
        owned = held_sets(gym_checkpoint_keys(ledger, plan.topology))
    return count_snapshot(plan, exported, not_started, first, owned=owned,
                          refused_waiting=len(ledger.refused_waiting()))
