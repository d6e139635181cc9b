"""What the ledger keeps about trained groups: merged ranges of dataloader positions and a count.

A list of trained ids grew with every step and was written into every
snapshot and trainer checkpoint; the ranges stay as large as the work in
flight, and must refuse everything the list refused.
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_rl.experience.rollout_recovery import (
    ROLLOUT_RECOVERY_SCHEMA_VERSION,
    LedgerError,
    LedgerState,
    PromptGroupStatus,
    RolloutRecoveryLedger,
    position_in,
    range_problem,
    with_position,
)

INST = "nemo_gym/replica-0"


def _reserve(ledger, position, group_id=None, n=1):
    return ledger.reserve_group(group_id or f"s1p{position}", "p", position % 7, None, None, "sibling", n, 1,
                                position=position)


def _complete(ledger, group_id):
    for req in ledger.reserved_attempts():
        if req.group_id == group_id:
            ledger.mark_dispatched(req.rollout_id, INST)
            ledger.mark_sealed(req.rollout_id, 1.0)


def _train(ledger, position, group_id=None):
    gid = group_id or f"s1p{position}"
    _reserve(ledger, position, gid)
    _complete(ledger, gid)
    ledger.mark_group_trained(gid)


def test_in_order_training_is_one_range_and_survives_compaction():
    ledger = RolloutRecoveryLedger()
    for p in range(300):
        _train(ledger, p)
        ledger.compact_trained([f"s1p{p}"])
    assert ledger.trained_positions == [(0, 300)] and ledger.trained_count == 300
    assert ledger.groups == {}
    state = ledger.state_dict()
    assert state["trained_positions"] == [[0, 300]] and state["trained_count"] == 300
    assert state["schema_version"] == ROLLOUT_RECOVERY_SCHEMA_VERSION == 2
    assert len(json.dumps(state)) < 200  # 300 steps, and still no bigger than an empty ledger plus a range


def test_out_of_order_training_merges_ranges_when_holes_close():
    ledger = RolloutRecoveryLedger()
    for p in range(6):
        _reserve(ledger, p)
    order = [1, 3, 0, 5, 4, 2]
    seen = []
    for p in order:
        _complete(ledger, f"s1p{p}")
        ledger.mark_group_trained(f"s1p{p}")
        seen.append(ledger.trained_positions)
    assert seen == [
        [(1, 2)],
        [(1, 2), (3, 4)],
        [(0, 2), (3, 4)],
        [(0, 2), (3, 4), (5, 6)],
        [(0, 2), (3, 6)],
        [(0, 6)],
    ]
    assert ledger.trained_count == 6


def test_with_position_merges_left_right_and_both():
    assert with_position([], 4) == [(4, 5)]
    assert with_position([(0, 2)], 2) == [(0, 3)]  # joins the left
    assert with_position([(3, 5)], 2) == [(2, 5)]  # joins the right
    assert with_position([(0, 2), (3, 5)], 2) == [(0, 5)]  # closes the hole
    assert with_position([(0, 2), (6, 8)], 4) == [(0, 2), (4, 5), (6, 8)]
    assert [position_in([(0, 2), (4, 5)], p) for p in range(6)] == [True, True, False, False, True, False]


def test_a_group_is_trained_once_and_its_position_never_comes_back():
    ledger = RolloutRecoveryLedger()
    _train(ledger, 0)
    with pytest.raises(LedgerError, match=r"group s1p0 \(position 0\) was already trained"):
        ledger.mark_group_trained("s1p0")
    with pytest.raises(LedgerError, match="group again: dataloader position 0 was already trained"):
        _reserve(ledger, 0, "again")  # not while its record is still there
    ledger.compact_trained(["s1p0"])
    with pytest.raises(LedgerError, match="group again: dataloader position 0 was already trained"):
        _reserve(ledger, 0, "again")  # nor after it was compacted
    with pytest.raises(LedgerError, match="unknown group s1p0: not in the ledger"):
        ledger.mark_group_trained("s1p0")
    _reserve(ledger, 1)
    with pytest.raises(LedgerError, match="group twin: dataloader position 1 is held by group s1p1"):
        _reserve(ledger, 1, "twin")
    with pytest.raises(LedgerError, match="s1p1 is generating, not complete"):
        ledger.mark_group_trained("s1p1")
    assert ledger.trained_count == 1 and ledger.trained_positions == [(0, 1)]


def test_a_trained_group_is_refused_even_if_only_its_position_says_so():
    """Defence in depth: a record reset to complete whose position is in the ranges is not trained again."""
    ledger = RolloutRecoveryLedger()
    _train(ledger, 0)
    ledger.groups["s1p0"].status = PromptGroupStatus.COMPLETE
    with pytest.raises(LedgerError, match=r"s1p0 \(position 0\) was already trained"):
        ledger.mark_group_trained("s1p0")


def test_restart_keeps_the_ranges():
    ledger = RolloutRecoveryLedger()
    _train(ledger, 0)
    _reserve(ledger, 1, n=2)
    (req, _) = ledger.reserved_attempts()
    ledger.mark_dispatched(req.rollout_id, INST)
    ledger.bring_back(set())
    assert ledger.trained_positions == [(0, 1)]
    again = RolloutRecoveryLedger.from_state_dict(json.loads(ledger.state_json()))
    assert again.trained_positions == [(0, 1)] and again.is_trained_position(0) and not again.is_trained_position(1)


def _state_with(trained_in_ledger=True):
    """A valid state: s1p0..s1p2 trained (s1p1 still in the ledger), s1p4 generating."""
    ledger = RolloutRecoveryLedger()
    for p in range(3):
        _train(ledger, p)
    ledger.compact_trained(["s1p0", "s1p2"] if trained_in_ledger else ["s1p0", "s1p1", "s1p2"])
    _reserve(ledger, 4)
    return ledger.state_dict()


def _refused(state) -> str:
    with pytest.raises(ValidationError) as exc:
        RolloutRecoveryLedger().load_state_dict(state)
    return str(exc.value)


def _group(state, gid):
    return next(g for g in state["groups"] if g["group_id"] == gid)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.update(trained_positions=[[0, 1]], trained_count=1),
         "group s1p1 is trained but its position 1 is not in trained_positions"),
        (lambda s: s.update(trained_positions=[[0, 5]], trained_count=5),
         "group s1p4 is generating but its position 4 is in trained_positions (trained already)"),
        (lambda s: _group(s, "s1p4").update(position=1),
         "groups s1p1 and s1p4 share dataloader position 1"),
        (lambda s: s.update(trained_positions=[[0, 2], [1, 3]], trained_count=3),
         "trained_positions[1] = [1, 3) overlaps [0, 2)"),
        (lambda s: s.update(trained_positions=[[5, 6], [0, 3]], trained_count=4),
         "trained_positions[1] = [0, 3) is not sorted (it comes after [5, 6))"),
        (lambda s: s.update(trained_positions=[[0, 2], [2, 3]], trained_count=3),
         "trained_positions[1] = [2, 3) touches [0, 2): ranges must be merged"),
        (lambda s: s.update(trained_positions=[[0, 3], [7, 7]], trained_count=3),
         "trained_positions[1] = [7, 7) is empty or negative"),
        (lambda s: s.update(trained_count=2), "trained_count is 2 but trained_positions hold 3 positions"),
        (lambda s: _group(s, "s1p4").update(position=-1), "position"),
        (lambda s: s.pop("trained_count"), "trained_count"),
    ],
)
def test_inconsistent_states_are_refused_naming_the_group_or_range(mutate, message):
    good = _state_with()
    RolloutRecoveryLedger().load_state_dict(copy.deepcopy(good))  # the base state is valid
    state = copy.deepcopy(good)
    mutate(state)
    assert message in _refused(state)


def test_the_old_schema_is_refused_saying_what_to_do():
    old = _state_with(trained_in_ledger=False)
    old.update(schema_version=1, trained_group_ids=["s1p0", "s1p1", "s1p2"])
    del old["trained_positions"], old["trained_count"]
    for g in old["groups"]:
        del g["position"]
    text = _refused(old)
    assert "ledger schema_version 1 (a list of trained_group_ids) was written by an older version" in text
    assert "use a new checkpoint_dir" in text
    assert text.count("Value error") == 1  # one clear reason, not a list of missing fields
    assert "is unknown; this code reads 2" in _refused({**_state_with(), "schema_version": 99})
    with pytest.raises(ValidationError, match="older version"):
        LedgerState.model_validate(old)


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(12)), st.integers(min_value=1, max_value=4))
def test_property_any_training_order_gives_the_merged_positions(order, in_flight):
    """Train positions in any order with at most ``in_flight`` reserved at once: the ranges equal a
    plain merge of what was trained, never exceed the groups in flight plus one, and round-trip."""
    ledger = RolloutRecoveryLedger()
    trained: list[int] = []
    pending = list(order)
    reserved: list[int] = []
    next_free = 0
    while pending or reserved:
        while len(reserved) < in_flight and next_free < len(order):  # the dataloader hands out in order
            _reserve(ledger, next_free)
            reserved.append(next_free)
            next_free += 1
        # train the earliest-listed position that is reserved (out of order within the window)
        p = next(q for q in pending if q in reserved)
        pending.remove(p)
        reserved.remove(p)
        _complete(ledger, f"s1p{p}")
        ledger.mark_group_trained(f"s1p{p}")
        ledger.compact_trained([f"s1p{p}"])
        trained.append(p)
        expect = []
        for q in sorted(trained):
            if expect and expect[-1][1] == q:
                expect[-1] = (expect[-1][0], q + 1)
            else:
                expect.append((q, q + 1))
        assert ledger.trained_positions == expect and ledger.trained_count == len(trained)
        assert range_problem(ledger.trained_positions) is None
        assert len(ledger.trained_positions) <= len(reserved) + 1
        again = RolloutRecoveryLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
        assert again.trained_positions == ledger.trained_positions
        with pytest.raises(LedgerError, match=f"position {p} was already trained"):
            _reserve(ledger, p, "replay")
    assert ledger.trained_positions == [(0, 12)]
