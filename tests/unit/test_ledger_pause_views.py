"""The ledger's pause views (``turn_level_held``, ``state_json``) are kept up to date per changed group
(docs/design.md §5.4); after any sequence of transitions, read at any moments, they must equal what a
full pass over the ledger computes. A seeded random walk over every transition, restarts and loads
included."""

from __future__ import annotations

import json
import random

import pytest

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.experience.rollout_recovery.schema import (
    LedgerError,
    LedgerState,
    RolloutAttemptStatus,
    RolloutRetriesExhausted,
)

INSTANCES = ("nemo_gym/replica-0", "nemo_gym/replica-1", "other/replica-0")
LEVELS = ("turn", "prefix", "sibling", "prompt_group")


def full_held(ledger: RolloutRecoveryLedger) -> dict[str, dict[str, str | None]]:
    out: dict[str, dict[str, str | None]] = {}
    for group, g, attempt in ledger.turn_level_live():
        out.setdefault(attempt.gym_instance_id, {})[attempt.rollout_id(group.group_id, g)] = group.agent_name
    return out


def full_json(ledger: RolloutRecoveryLedger) -> bytes:
    state = LedgerState.model_construct(max_attempts_per_sibling=ledger.max_attempts_per_sibling,
                                        groups=list(ledger.groups.values()),
                                        trained_positions=list(ledger.trained_positions),
                                        trained_count=ledger.trained_count)
    return state.__pydantic_serializer__.to_json(state)


def full_refused(ledger: RolloutRecoveryLedger) -> list[str]:
    return sorted(
        group.rollout_id(sibling.generation_index)
        for group in ledger.groups.values()
        if group.status.value == "generating" and group.restore_level.requires_gym_checkpoint
        for sibling in group.siblings
        if sibling.current_attempt.status is RolloutAttemptStatus.RESERVED
        and sibling.current_attempt.refusals > 0 and sibling.current_attempt.gym_attempt == 0
    )


def held_dicts(ledger: RolloutRecoveryLedger) -> dict[str, dict[str, str | None]]:
    return {iid: dict(keys) for iid, keys in ledger.turn_level_held().items() if keys}


def check(ledger: RolloutRecoveryLedger, taken: list | None = None) -> None:
    """The views equal a full pass; ``taken`` keeps each read's maps with what they held then."""
    held = ledger.turn_level_held()
    assert held_dicts(ledger) == full_held(ledger)
    if taken is not None:
        taken.append({iid: (keys, dict(keys)) for iid, keys in held.items()})
    assert sorted(ledger.refused_waiting()) == full_refused(ledger)
    assert ledger.state_json() == full_json(ledger)


def live(ledger: RolloutRecoveryLedger, status: RolloutAttemptStatus) -> list[tuple[str, str]]:
    """(capture key, instance) of current attempts in that status, in generating groups."""
    out = []
    for group in ledger.groups.values():
        if group.status.value != "generating":
            continue
        for sibling in group.siblings:
            attempt = sibling.current_attempt
            if attempt.status is status:
                out.append((attempt.rollout_id(group.group_id, sibling.generation_index), attempt.gym_instance_id))
    return out


def step(ledger: RolloutRecoveryLedger, rng: random.Random, counter: list[int]) -> RolloutRecoveryLedger:
    op = rng.choice(["reserve", "dispatch", "dispatch", "seal", "seal", "fail", "refuse", "train", "compact",
                     "restart", "load", "adopt"])
    if op == "reserve":
        i = counter[0]
        counter[0] += 1
        ledger.reserve_group(f"s1p{i}", f"p{i}", i, "workplace", rng.choice(["agent_a", "agent_b", None]),
                             rng.choice(LEVELS), rng.randint(1, 4), 1, position=i)
    elif op == "dispatch":
        for key, iid in live(ledger, RolloutAttemptStatus.RESERVED)[: rng.randint(1, 5)]:
            ledger.mark_dispatched(key, iid or rng.choice(INSTANCES), weight_version=0)
    elif op == "seal":
        for key, _ in live(ledger, RolloutAttemptStatus.DISPATCHED)[: rng.randint(1, 6)]:
            ledger.mark_sealed(key, rng.random())
    elif op == "fail":
        for key, _ in live(ledger, RolloutAttemptStatus.DISPATCHED)[:1]:
            try:
                ledger.mark_failed(key)
            except RolloutRetriesExhausted:
                pass
    elif op == "refuse":
        for key, _ in live(ledger, RolloutAttemptStatus.DISPATCHED)[:2]:
            try:
                ledger.mark_refused(key, 5)
            except LedgerError:
                pass
    elif op == "train":
        for group in ledger.complete_groups()[:2]:
            ledger.mark_group_trained(group.group_id)
    elif op == "compact":
        trained = [g.group_id for g in ledger.groups.values() if g.status.value == "trained"]
        ledger.compact_trained(trained[:3])
    elif op == "restart":
        held = full_held(ledger)
        restored = set()
        for iid, keys in held.items():
            for key in list(keys)[::2]:  # Gym restored every other one, at the next attempt
                episode = EpisodeId.from_capture_key(key)
                restored.add((iid, episode.rollout_id, episode.attempt + 1))
        ledger.bring_back(restored)
    elif op == "load":
        ledger = RolloutRecoveryLedger.from_state_dict(json.loads(ledger.state_json()))
    elif op == "adopt":
        positions = [g.position for g in ledger.groups.values()]
        if positions:
            p = rng.choice(positions)
            ledger.adopt_trained([(p, p + 1)])
    return ledger


@pytest.mark.parametrize("seed", range(6))
def test_the_pause_views_equal_a_full_pass_after_any_transitions(seed):
    rng = random.Random(seed)
    ledger = RolloutRecoveryLedger(max_attempts_per_sibling=3)
    counter = [0]
    reads = 0
    refused_seen = [False]
    taken: list = []
    for _ in range(400):
        ledger = step(ledger, rng, counter)
        refused_seen[0] |= bool(full_refused(ledger))
        if rng.random() < 0.3:  # views read now and then: several changes accumulate between reads
            check(ledger, taken)
            reads += 1
    check(ledger)
    assert reads > 50 and counter[0] > 10
    # a snapshot keeps the maps it read as its copy: no later transition changed one of them
    changed_since = 0
    for read in taken:
        for keys, then in read.values():
            assert dict(keys) == then
        changed_since += read != taken[-1]
    assert changed_since > 10
    assert any(full_held(ledger).values()) or ledger.trained_count > 0
    assert refused_seen[0] or seed > 2  # the walk reaches refused attempts (most seeds)


def test_a_view_read_twice_without_changes_is_the_same_and_a_drop_leaves_it():
    ledger = RolloutRecoveryLedger()
    ledger.reserve_group("s1p0", "p0", 0, None, "a", "turn", 2, 1, position=0)
    (r0, _), (r1, _) = [(req.rollout_id, req) for req in ledger.reserved_attempts()]
    ledger.mark_dispatched(r0, INSTANCES[0])
    ledger.mark_dispatched(r1, INSTANCES[1])
    first = ledger.state_json()
    assert held_dicts(ledger) == {INSTANCES[0]: {r0: "a"}, INSTANCES[1]: {r1: "a"}}
    assert ledger.state_json() == first
    ledger.mark_sealed(r0, 1.0)
    assert held_dicts(ledger) == {INSTANCES[1]: {r1: "a"}}
    ledger.adopt_trained([(0, 1)])  # a newer trainer step trained it: the group leaves the ledger
    assert not any(ledger.turn_level_held().values())
    assert json.loads(ledger.state_json())["groups"] == []


def test_a_group_id_that_comes_back_takes_its_new_place_in_the_ledger_json():
    """The JSON view keeps each group's place (the snapshot orders the parts after resume); a group
    trained, compacted and reserved again under its id goes last, after groups reserved meanwhile."""
    ledger = RolloutRecoveryLedger()
    for i in range(3):
        ledger.reserve_group(f"s1p{i}", f"p{i}", i, None, "a", "turn", 1, 1, position=i)
    parts_before = ledger.state_json_parts()
    assert ledger.state_json() == full_json(ledger)
    key = next(r.rollout_id for r in ledger.reserved_attempts() if r.rollout_id.startswith("s1p0_"))
    ledger.mark_dispatched(key, INSTANCES[0])
    ledger.mark_sealed(key, 1.0)
    ledger.mark_group_trained("s1p0")
    ledger.compact_trained(["s1p0"])
    ledger.reserve_group("s1p3", "p3", 3, None, "a", "turn", 1, 1, position=3)
    ledger.reserve_group("s1p0", "p9", 9, None, "a", "turn", 1, 1, position=9)
    ledger.mark_dispatched(next(r.rollout_id for r in ledger.reserved_attempts() if r.rollout_id.startswith("s1p1_")),
                           INSTANCES[1])  # an older group changes too: it keeps its place
    assert list(ledger.groups) == ["s1p1", "s1p2", "s1p3", "s1p0"]
    assert ledger.state_json() == full_json(ledger)
    assert [g["group_id"] for g in json.loads(ledger.state_json())["groups"]] == list(ledger.groups)
    # the parts a snapshot took before are left as they were
    assert [g["group_id"] for g in json.loads(parts_before.encode())["groups"]] == ["s1p0", "s1p1", "s1p2"]


def test_a_snapshot_pause_takes_references_to_the_views_which_later_changes_leave_alone():
    """What a staged pause reads of the ledger (plan, held keys, JSON parts) is the views themselves, not
    copies of them: nothing in it grows with the rollouts in flight (docs/design.md §5.4). A transition
    after the pause makes new views; the ones the pause kept do not change."""
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import (
        gym_checkpoint_keys,
        plan_snapshot,
    )

    ledger = RolloutRecoveryLedger()
    ledger.reserve_group("s1p0", "p0", 0, None, "a", "turn", 4, 1, position=0)
    keys = [r.rollout_id for r in ledger.reserved_attempts()]
    for key in keys:
        ledger.mark_dispatched(key, INSTANCES[0])
    ledger.refresh_pause_views()
    view = ledger.turn_level_held()[INSTANCES[0]]
    parts = ledger.state_json_parts()
    plan = plan_snapshot(ledger, [INSTANCES[0]], {INSTANCES[0]: ()})
    held = gym_checkpoint_keys(ledger, [INSTANCES[0]])
    assert plan.scope[INSTANCES[0]] is view and held[INSTANCES[0]] is view
    assert ledger.state_json_parts().groups is parts.groups
    before = parts.encode()

    ledger.mark_sealed(keys[0], 1.0)  # after resume, the ledger moves on
    ledger.refresh_pause_views()
    assert set(ledger.turn_level_held()[INSTANCES[0]]) == set(keys[1:])
    assert set(view) == set(keys) and set(plan.scope_keys[INSTANCES[0]]) == set(keys)
    assert parts.encode() == before != ledger.state_json()
    # a Gym-reported unsaved key leaves the ledger's view as it is: the scope is a new map without it
    plan = plan_snapshot(ledger, [INSTANCES[0]], {INSTANCES[0]: [keys[1]]})
    assert set(plan.scope[INSTANCES[0]]) == set(keys[2:]) and keys[1] in ledger.turn_level_held()[INSTANCES[0]]
