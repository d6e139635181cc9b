"""Model-based test of the ledger and the snapshot bookkeeping over 1 to 4 Gym instances.

Hypothesis drives random sequences of dispatch, seal, fail, refuse (Gym closed),
snapshot, train (with a trainer checkpoint), crash and restore. The code under
test is the real ``RolloutRecoveryLedger``, ``DataPlaneStore`` and the very
functions the snapshotter runs (``plan_snapshot``, ``check_ownership``, ``count_snapshot``).
Gym is a small model (named as such: ``GymModel``) that holds episodes per
instance, exports what it is asked to on instances whose servers save, reports
every live run unsaved on restart-only instances, and after a crash restores
saved episodes at ``attempt + 1`` on the same instance.

Invariants after every step: each prompt group is trained at most once and
every consumed prompt is accounted for (trained, generating or complete, never
lost or duplicated); the data plane holds exactly the sealed samples of
untrained groups; every instance's inventory is consistent with what Gym holds;
a snapshot's counts add up to its inventory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import (
    gym_checkpoint_inventory,
    gym_checkpoint_keys,
    plan_snapshot,
)
from testkit.snapshot_checks import check_ownership_now, count_snapshot_now
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import (
    PromptGroupStatus,
    RecoveryTargetLevel,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
)
from nemo_rl.experience.sample import RolloutSample
from tests.unit.test_rollout_recovery import merged_ranges



# turn twice: turn-level rollouts are the ones a snapshot saves
LEVELS = [RecoveryTargetLevel.TURN, RecoveryTargetLevel.TURN, RecoveryTargetLevel.SIBLING,
          RecoveryTargetLevel.PROMPT_GROUP]
MAX_GROUPS_LIVE = 5


@dataclass
class GymModel:
    """A stand-in for the Gym deployments: which episodes each instance holds (not the thing under test)."""

    saving: dict[str, bool]  # instance -> whether its servers save sessions
    live: dict[str, set[str]] = field(default_factory=dict)  # capture keys running there
    restored: dict[str, set[str]] = field(default_factory=dict)  # restored, waiting for their /run

    def __post_init__(self) -> None:
        for iid in self.saving:
            self.live.setdefault(iid, set())
            self.restored.setdefault(iid, set())

    def holds(self, iid: str) -> set[str]:
        return self.live[iid] | self.restored[iid]

    def unsaved(self) -> dict[str, set[str]]:
        return {iid: (set(self.live[iid]) if not ok else set()) for iid, ok in self.saving.items()}


@dataclass
class Durable:
    """What a trainer checkpoint or a rollout snapshot keeps."""

    ledger: dict
    samples: list[RolloutSample]
    position: int
    trained: list[str]
    gym_records: dict[str, list[str]] = field(default_factory=dict)  # instance -> exported capture keys


class SnapshotBookkeeping(RuleBasedStateMachine):
    @initialize(
        instances=st.integers(min_value=1, max_value=4),
        restart_only=st.lists(st.sampled_from([False, False, True]), min_size=4, max_size=4),
        generations=st.integers(min_value=1, max_value=3),
    )
    def setup(self, instances: int, restart_only: list[bool], generations: int) -> None:
        shards = ["saving", "mixed"]
        self.iids = [f"{shards[i % 2]}/replica-{i // 2}" for i in range(instances)]
        self.gym = GymModel({iid: not restart_only[i] for i, iid in enumerate(self.iids)})
        self.generations = generations
        self.ledger = RolloutRecoveryLedger(max_attempts_per_sibling=1000)
        self.data_plane = DataPlaneStore()
        self.position = 0  # prompts consumed (the dataloader)
        self.trained: list[str] = []  # the trainer's lineage
        self.positions: dict[str, int] = {}  # group -> the dataloader position it took (never rolled back)
        self.checkpoint = Durable(self.ledger.state_dict(), [], 0, [])
        self.snapshot: Durable | None = None

    # -- helpers ----------------------------------------------------------------
    def _attempts(self, status: RolloutAttemptStatus):
        for group in self.ledger.groups.values():
            if group.status is not PromptGroupStatus.GENERATING:
                continue
            for sibling in group.siblings:
                attempt = sibling.current_attempt
                if attempt.status is status:
                    yield group, sibling.generation_index, attempt

    def _running(self) -> list[tuple[str, str, int, str]]:
        """(capture key, group, generation, instance) of dispatched attempts Gym holds."""
        out = []
        for group, g, attempt in self._attempts(RolloutAttemptStatus.DISPATCHED):
            key = attempt.rollout_id(group.group_id, g)
            if key in self.gym.live[attempt.gym_instance_id]:
                out.append((key, group.group_id, g, attempt.gym_instance_id))
        return sorted(out)

    # -- rules --------------------------------------------------------------------
    @rule(levels=st.lists(st.sampled_from(LEVELS), min_size=1, max_size=3))
    def reserve(self, levels: list[RecoveryTargetLevel]) -> None:
        for level in levels:
            if sum(g.status is not PromptGroupStatus.TRAINED for g in self.ledger.groups.values()) >= MAX_GROUPS_LIVE:
                return
            gid = f"p{self.position}"
            self.ledger.reserve_group(gid, gid, self.position, None, None, level, self.generations, 0,
                                      position=self.position)
            self.positions[gid] = self.position
            self.position += 1

    @rule(data=st.data(), count=st.integers(min_value=1, max_value=6))
    def dispatch(self, data, count: int) -> None:
        """Send up to ``count`` reserved attempts (a restored one goes back to its replica)."""
        for _ in range(count):
            reserved = self.ledger.reserved_attempts()
            if not reserved:
                return
            req = data.draw(st.sampled_from(reserved))
            iid = req.gym_instance_id or data.draw(st.sampled_from(self.iids))
            self.ledger.mark_dispatched(req.rollout_id, iid)
            self.gym.restored[iid].discard(req.rollout_id)
            self.gym.live[iid].add(req.rollout_id)

    @rule(data=st.data(), reward=st.sampled_from([0.0, 0.5, 1.0]))
    def seal(self, data, reward: float) -> None:
        running = self._running()
        if not running:
            return
        key, gid, g, iid = data.draw(st.sampled_from(running))
        self.gym.live[iid].discard(key)
        self.data_plane.put(RolloutSample(rollout_id=key, group_id=gid, generation_index=g, reward=reward))
        self.ledger.mark_sealed(key, reward)

    @rule(data=st.data())
    def fail(self, data) -> None:
        running = self._running()
        if not running:
            return
        key, _, _, iid = data.draw(st.sampled_from(running))
        self.gym.live[iid].discard(key)
        self.ledger.mark_failed(key)

    @rule(data=st.data())
    def refuse(self, data) -> None:
        """Gym refused a /run while closed: the ledger puts the attempt back for dispatch."""
        running = self._running()
        if not running:
            return
        key, _, _, iid = data.draw(st.sampled_from(running))
        self.gym.live[iid].discard(key)
        if EpisodeId.from_capture_key(key).attempt > 0:
            self.gym.restored[iid].add(key)  # a refused /run leaves the restored session where it waits
        self.ledger.mark_refused(key, max_refusals=1000)

    @precondition(lambda self: any(g.status is PromptGroupStatus.GENERATING for g in self.ledger.groups.values()))
    @rule()
    def take_snapshot(self) -> None:
        """What the snapshot pump does when some group is generating (prepare, commit, cut, publish)."""
        plan = plan_snapshot(self.ledger, self.iids, self.gym.unsaved())
        exported = {
            iid: {k for k in plan.scope[iid] if k in self.gym.holds(iid)}
            if self.gym.saving[iid] else set()
            for iid in self.iids
        }
        check_ownership_now(self.ledger, plan, exported)
        counts = count_snapshot_now(self.ledger, plan, exported)
        inventory = gym_checkpoint_inventory(self.ledger, self.iids)
        assert counts.saved + counts.unsaved == sum(len(v) for v in inventory.values())
        assert counts.not_admitted == len(self.ledger.refused_waiting())
        assert counts.saved == sum(len(v) for v in exported.values())
        event(f"snapshot over {sum(1 for v in inventory.values() if v)} instance(s) with rollouts")
        self.snapshot = Durable(
            self.ledger.state_dict(), [copy.deepcopy(s) for s in self.data_plane], self.position,
            list(self.trained), {iid: sorted(keys) for iid, keys in exported.items()},
        )

    @precondition(lambda self: any(g.status is PromptGroupStatus.COMPLETE for g in self.ledger.groups.values()))
    @rule()
    def train_and_checkpoint(self) -> None:
        for group in self.ledger.complete_groups():
            samples = self.data_plane.pop_group(group.group_id)
            assert len(samples) == group.expected_generations
            self.ledger.mark_group_trained(group.group_id)
            self.trained.append(group.group_id)
        self.checkpoint = Durable(self.ledger.state_dict(), [copy.deepcopy(s) for s in self.data_plane],
                                  self.position, list(self.trained))
        self.snapshot = None  # snapshots hang under the newest trainer step
        # as the controller does once the step is durable: trained groups leave the ledger
        trained_here = [g.group_id for g in self.ledger.groups.values() if g.status is PromptGroupStatus.TRAINED]
        self.ledger.compact_trained(trained_here)

    @precondition(lambda self: self.snapshot is not None or len(self.ledger.groups) > len(self.trained))
    @rule()
    def crash_and_restore(self) -> None:
        """SIGKILL, then the same command: newest snapshot (else trainer checkpoint), Gym restored, ledger rules."""
        base = self.snapshot or self.checkpoint
        self.ledger = RolloutRecoveryLedger.from_state_dict(copy.deepcopy(base.ledger))
        self.ledger.max_attempts_per_sibling = 1000
        self.data_plane = DataPlaneStore()
        for sample in base.samples:
            self.data_plane.put(copy.deepcopy(sample))
        self.position, self.trained = base.position, list(base.trained)
        self.gym = GymModel(dict(self.gym.saving))  # fresh Gym processes
        restored: set[tuple[str, str, int]] = set()
        for iid, keys in base.gym_records.items():
            for key in keys:
                episode = EpisodeId.from_capture_key(key)
                nxt = EpisodeId(rollout_id=episode.rollout_id, attempt=episode.attempt + 1)
                self.gym.restored[iid].add(nxt.capture_key)
                restored.add((iid, nxt.rollout_id, nxt.attempt))  # Gym's attempt numbers, as it reports them
        summary = self.ledger.bring_back(restored)
        self.data_plane.discard(summary.discarded_rollout_ids)
        assert len(summary.restored_turn) == len(restored)
        event("restore continued turn-level rollouts" if restored else "restore without turn-level saves")

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def each_group_trained_at_most_once_and_no_prompt_lost(self) -> None:
        if not hasattr(self, "ledger"):
            return
        assert len(self.trained) == len(set(self.trained))
        trained_positions = sorted(self.positions[g] for g in self.trained)
        assert self.ledger.trained_positions == merged_ranges(trained_positions)
        assert self.ledger.trained_count == len(self.trained)
        live = {g for g, rec in self.ledger.groups.items() if rec.status is not PromptGroupStatus.TRAINED}
        assert not live & set(self.trained)  # a group is live or trained, never both
        assert live | set(self.trained) == {f"p{i}" for i in range(self.position)}  # every consumed prompt

    @invariant()
    def trained_record_bounded_by_the_work_in_flight(self) -> None:
        """Groups train out of order here, yet every gap between ranges holds a live group:
        the ranges grow with what is in flight, not with the run."""
        if not hasattr(self, "ledger"):
            return
        live = [g.position for g in self.ledger.groups.values() if g.status is not PromptGroupStatus.TRAINED]
        assert len(self.ledger.trained_positions) <= len(live) + 1
        ranges = self.ledger.trained_positions
        for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
            assert any(hi <= p < lo for p in live), f"gap [{hi}, {lo}) holds no live group"
        event(f"{len(ranges)} trained range(s)")

    @invariant()
    def no_sample_lost_or_duplicated(self) -> None:
        if not hasattr(self, "ledger"):
            return
        assert self.data_plane.rollout_ids() == self.ledger.sealed_rollout_ids()
        for group in self.ledger.groups.values():
            if group.status is not PromptGroupStatus.TRAINED:
                self.data_plane.group_samples(group.group_id)  # raises on two samples for one sibling

    @invariant()
    def inventories_consistent(self) -> None:
        if not hasattr(self, "ledger"):
            return
        inventory = gym_checkpoint_inventory(self.ledger, self.iids)
        owned = gym_checkpoint_keys(self.ledger, self.iids)
        seen: set[str] = set()
        for iid, episodes in inventory.items():
            keys = {e.capture_key for e in episodes}
            assert not keys & seen, "a rollout on two instances"
            seen |= keys
            assert keys == set(owned[iid]) and len(keys) == len(episodes)
            # every turn-level rollout the ledger places here is held by Gym here
            assert keys <= self.gym.holds(iid)
        for iid in self.iids:
            for key in self.gym.restored[iid]:
                assert key in {e.capture_key for e in inventory[iid]} or not any(
                    key == a.rollout_id(g.group_id, s.generation_index)
                    for g in self.ledger.groups.values() for s in g.siblings for a in s.attempts
                )


TestSnapshotBookkeeping = SnapshotBookkeeping.TestCase
TestSnapshotBookkeeping.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
