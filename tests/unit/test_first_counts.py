"""Distinct rollouts in ``snapshots.jsonl`` (``new_saved`` / ``new_unsaved``): the planner's
``FirstCounts`` driven through the real ledger, ``plan_snapshot``, ``check_ownership``, ``count_snapshot`` and
``SnapshotOutcome``, as the stager runs them (docs/design.md §5.4)."""

from __future__ import annotations

import pytest

from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.outcome import SnapshotOutcome
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import (
    FirstCounts,
    GymOwnershipError,
    check_ownership,
    count_snapshot,
    gym_checkpoint_keys,
    plan_snapshot,
)
from testkit.snapshot_checks import check_ownership_now, count_snapshot_now
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger

IID = "nemo_gym/replica-0"


class Run:
    """A ledger on one Gym instance and the start's ``FirstCounts``; ``snapshot`` takes one cut."""

    def __init__(self, ledger: RolloutRecoveryLedger | None = None):
        self.ledger = ledger or RolloutRecoveryLedger()
        self.first = FirstCounts()
        self.groups = 0

    def dispatch_group(self, agent: str = "saver", n: int = 2) -> list[str]:
        i = self.groups
        self.groups += 1
        group = self.ledger.reserve_group(f"s1p{i}", f"p{i}", i, None, agent, "turn", n, 1, position=i)
        keys = [s.current_attempt.rollout_id(group.group_id, s.generation_index) for s in group.siblings]
        for key in keys:
            self.ledger.mark_dispatched(key, IID)
        return keys

    def snapshot(self, fails: BaseException | None = None) -> dict:
        """One attempt: restart-only agent ``plain``'s rollouts are unsaved, the rest exported."""
        plan = plan_snapshot(self.ledger, [IID], {}, unsavable_agents={IID: {"plain"}})
        exported = {IID: set(plan.scope[IID])}
        owned = check_ownership_now(self.ledger, plan, exported)
        outcome = SnapshotOutcome("rollout-test", "staged", 1)
        outcome.count(count_snapshot_now(self.ledger, plan, exported, owned=owned, first=self.first))
        if fails is None:
            outcome.committed, outcome.reason = True, "committed"
        else:
            outcome.failed(fails)
        return outcome.row()


def test_a_rollout_saved_in_every_snapshot_counts_once():
    run = Run()
    run.dispatch_group()
    run.dispatch_group()
    rows = [run.snapshot() for _ in range(3)]
    assert [r["saved"] for r in rows] == [4, 4, 4]  # the per-snapshot count, as before
    assert [r["new_saved"] for r in rows] == [4, 0, 0]  # each rollout counted by its first snapshot only


def test_new_rollouts_count_and_finished_ones_are_forgotten():
    run = Run()
    first = run.dispatch_group()
    run.snapshot()
    run.ledger.mark_sealed(first[0], 1.0)  # finished: no longer held by Gym
    run.dispatch_group()
    row = run.snapshot()
    assert (row["saved"], row["new_saved"]) == (3, 2)
    # the set keeps only what is still in flight, not every rollout of the run
    assert first[0] not in run.first.saved and len(run.first.saved) == 3


def test_unsaved_rollouts_on_restart_only_servers_count_once_apart_from_saved_ones():
    run = Run()
    run.dispatch_group(agent="plain", n=3)
    run.dispatch_group()
    rows = [run.snapshot(), run.snapshot()]
    assert [(r["saved"], r["unsaved"]) for r in rows] == [(2, 3), (2, 3)]
    assert [(r["new_saved"], r["new_unsaved"]) for r in rows] == [(2, 3), (0, 0)]


def test_a_snapshot_that_does_not_commit_leaves_its_rollouts_to_the_next_that_does():
    run = Run()
    run.dispatch_group()
    failed = run.snapshot(fails=OSError(28, "No space left on device"))
    assert failed["committed"] is False and failed["saved"] == 2
    assert (failed["new_saved"], failed["new_unsaved"]) == (0, 0)
    assert run.snapshot()["new_saved"] == 2  # nothing committed held them before


def test_rollouts_restored_at_their_turn_were_counted_by_the_start_that_saved_them():
    earlier = Run()
    keys = earlier.dispatch_group()
    assert earlier.snapshot()["new_saved"] == 2
    # The relaunch: a fresh FirstCounts; Gym restored both at attempt 1, and a new group starts.
    ledger = RolloutRecoveryLedger.from_state_dict(earlier.ledger.state_dict())
    ledger.bring_back({(IID, key, 1) for key in keys})
    run = Run(ledger)
    run.groups = earlier.groups
    for key in keys:
        run.ledger.mark_dispatched(f"{key}-a1", IID)
    run.dispatch_group()
    row = run.snapshot()
    assert (row["saved"], row["new_saved"]) == (4, 2)  # only the new group's rollouts are new


def test_checks_after_resume_use_what_the_pause_held_not_the_ledger_as_it_moved_on():
    """The snapshotter checks ownership and counts after resume, on copies its pause took
    (``held=``, ``refused_waiting=``): a rollout Gym failed to save that finished right after resume
    is still caught, which a check on the moved-on ledger would miss, and the counts are the pause's."""
    run = Run()
    keys = run.dispatch_group(n=3)
    plan = plan_snapshot(run.ledger, [IID], {})
    lost = keys[0]
    exported = {IID: set(plan.scope[IID]) - {lost}}  # Gym did not export it and did not call it unsaved: a bug
    held = gym_checkpoint_keys(run.ledger, plan.topology)  # the pause's copy
    refused = len(run.ledger.refused_waiting())
    run.ledger.mark_sealed(lost, 1.0)  # after resume the rollout finishes
    check_ownership_now(run.ledger, plan, exported)  # the ledger as it stands no longer expects it: missed
    with pytest.raises(GymOwnershipError, match=lost):
        check_ownership(plan, exported, held=held)
    exported[IID].add(lost)
    owned = check_ownership(plan, exported, held=held)
    counts = count_snapshot(plan, exported, owned=owned, refused_waiting=refused)
    assert (counts.saved, counts.unsaved, counts.not_admitted) == (3, 0, 0)
    with pytest.raises(TypeError, match="held"):
        check_ownership(plan, exported)  # type: ignore[call-arg]: the product has no ledger-as-it-stands mode
    with pytest.raises(TypeError, match="refused_waiting"):
        count_snapshot(plan, exported, owned=owned)  # type: ignore[call-arg]
