"""The ledger's side of an in-run recovery (docs/design.md §5.12): ``live_on`` and ``bring_back(..., lost=...)``.

Only the lost replica's live attempts change: a restored one continues at the next attempt, pinned where Gym
installed it; the rest restart from their prompt as new attempts, no failure counted; a stray restored
episode is refused before anything changes."""

from __future__ import annotations

import pytest

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.experience.rollout_recovery import RolloutAttemptStatus, RolloutRecoveryLedger

A, B = "s/replica-0", "s/replica-1"


def _ledger(level: str = "turn") -> tuple[RolloutRecoveryLedger, list[str]]:
    """Two groups of two siblings: g0 of each group on replica A, g1 on B, all dispatched."""
    ledger = RolloutRecoveryLedger(max_attempts_per_sibling=2)
    for i in range(2):
        ledger.reserve_group(f"s1p{i}", f"p{i}", i, None, "agent", level, 2, 1, position=i)
    keys = []
    for req in ledger.reserved_attempts():
        ledger.mark_dispatched(req.rollout_id, A if req.generation_index == 0 else B)
        keys.append(req.rollout_id)
    return ledger, keys


def _restored(key: str, on: str) -> tuple[str, str, int]:
    e = EpisodeId.from_capture_key(key)
    return on, e.rollout_id, e.attempt + 1


def test_live_on_lists_the_replicas_dispatched_and_restored_attempts():
    ledger, keys = _ledger()
    on_b = ledger.live_on(B)
    assert sorted(on_b) == sorted(k for k in keys if "_g1_" in k)
    ledger.mark_sealed(on_b[0], 1.0)
    assert ledger.live_on(B) == on_b[1:]  # sealed: no longer Gym's to hold


def test_restored_attempts_continue_pinned_and_the_rest_restart_from_the_prompt_without_a_failure():
    ledger, _ = _ledger()
    lost = ledger.live_on(B)
    summary = ledger.bring_back({_restored(lost[0], B)}, lost=lost)
    continued = EpisodeId(rollout_id=EpisodeId.from_capture_key(lost[0]).rollout_id, attempt=1).capture_key
    assert summary.restored_turn == [continued]
    assert len(summary.restarted_from_prompt) == 1
    assert ledger.attempt_status(continued) is RolloutAttemptStatus.RESERVED
    reserved = {r.rollout_id: r for r in ledger.reserved_attempts()}
    assert reserved[continued].gym_instance_id == B  # it must return where Gym installed it
    fresh = summary.restarted_from_prompt[0]
    assert reserved[fresh].gym_instance_id is None  # a new attempt goes wherever there is room
    assert ledger.live_on(A) and all(ledger.attempt_status(k) is RolloutAttemptStatus.DISPATCHED
                                     for k in ledger.live_on(A))  # the other replica is not touched
    for group in ledger.groups.values():
        for sibling in group.siblings:
            assert sibling.failure_count() == 0  # a recovery, not a failure


def test_moved_attempts_are_pinned_to_the_survivor():
    ledger, _ = _ledger()
    lost = ledger.live_on(B)
    base = EpisodeId.from_capture_key(lost[0]).rollout_id
    summary = ledger.bring_back({_restored(lost[0], B)}, relocated={base: A}, lost=lost)
    reserved = {r.rollout_id: r for r in ledger.reserved_attempts()}
    assert reserved[summary.restored_turn[0]].gym_instance_id == A


@pytest.mark.parametrize("level", ["sibling", "prompt_group"])
def test_coarser_levels_restart_the_lost_siblings_only(level):
    ledger, _ = _ledger(level)
    lost = ledger.live_on(B)
    summary = ledger.bring_back(set(), lost=lost)
    assert len(summary.restarted_from_prompt) == len(lost) and not summary.redone_groups
    assert all(ledger.attempt_status(k) is RolloutAttemptStatus.DISPATCHED for k in ledger.live_on(A))


def test_a_stray_restored_episode_is_refused_before_anything_changes():
    ledger, _ = _ledger()
    lost = ledger.live_on(B)
    before = ledger.state_json()
    other = ledger.live_on(A)[0]  # not on the lost replica
    with pytest.raises(ValueError, match="no recovered rollout consumes"):
        ledger.bring_back({_restored(other, A)}, lost=lost)
    assert ledger.state_json() == before


def test_a_replica_given_up_sits_snapshots_out_until_its_rollouts_have_moved():
    """Between the give-up (its slot emptied) and the move of its rollouts (``bring_back``), the ledger still
    holds rollouts there: a snapshot planned then leaves it out as being recovered instead of failing on a
    replica outside the topology (seen once under load: the run stopped with a LedgerError)."""
    from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import plan_snapshot
    from nemo_rl.environments.nemo_gym import GymCheckpointInstance, NemoGymShardSet

    ledger, _ = _ledger()
    instances = {i.instance_id: i for i in (GymCheckpointInstance("s", 0), GymCheckpointInstance("s", 1))}
    # Stand-ins for the replicas' actors (never called here); B's slot is already empty, so dropping it
    # stops no actor.
    shard_set = NemoGymShardSet(handles={"s": [object(), None]}, instances=instances, agent_shards={"agent": "s"})
    coordinator = GymCheckpointCoordinator(shard_set, prepare_timeout_s=5.0,
                                           restart_only_policy="block", recovers_lost=True)
    shard_set.recovering.add(B)
    coordinator.abandon(B, "lost")
    shard_set.drop(B)  # the give-up
    coordinator.forget_instance(B)
    left_out = coordinator._sit_out_recovering({})
    assert list(left_out) == [B] and "being recovered" in left_out[B]
    plan = plan_snapshot(ledger, coordinator.instance_ids, {}, left_out)  # no LedgerError
    assert plan.instance_ids == (A,) and plan.left_out == (B,)

    lost = ledger.live_on(B)
    ledger.bring_back(set(), lost=lost)  # the move: its rollouts restart from the prompt (none were saved)
    shard_set.recovering.discard(B)  # as the recovery's ``resume`` does, with no await between
    assert coordinator._sit_out_recovering({}) == {} and ledger.live_on(B) == []
    assert plan_snapshot(ledger, coordinator.instance_ids, {}).instance_ids == (A,)
