"""The recovery ledger: lifecycle, Gym identity, restart rules, persistence."""

from __future__ import annotations

import copy
import json
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import gym_checkpoint_inventory, gym_checkpoint_keys
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import (
    LedgerError,
    PromptGroupStatus,
    RecoveryTargetLevel as L,
    RolloutAttemptRecord,
    RolloutAttemptStatus as S,
    RolloutRecoveryLedger,
    RolloutRetriesExhausted,
)
from nemo_rl.experience.sample import RolloutSample

INST = "nemo_gym/replica-0"


def merged_ranges(positions):
    """Reference merge of sorted positions into [lo, hi) ranges, written the plain way."""
    out = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _next_position(ledger):
    """The next free dataloader position, as the controller's dataloader would hand it out."""
    held = [g.position for g in ledger.groups.values()] + [hi - 1 for _, hi in ledger.trained_positions]
    return max(held, default=-1) + 1


def _reserve(ledger, group_id="grp0", level=L.TURN, n=2, **kw):
    return ledger.reserve_group(
        group_id=group_id,
        prompt_id=kw.get("prompt_id", f"p-{group_id}"),
        prompt_index=kw.get("prompt_index", 0),
        task_source=kw.get("task_source", "workplace"),
        agent_name=kw.get("agent_name", "simple_agent"),
        restore_level=level,
        num_generations=n,
        target_step=kw.get("target_step", 1),
        position=kw.get("position", _next_position(ledger)),
    )


def _dispatch_all(ledger, instance=INST):
    ids = []
    for req in ledger.reserved_attempts():
        ledger.mark_dispatched(req.rollout_id, req.gym_instance_id or instance)
        ids.append(req.rollout_id)
    return ids


def _triple(ledger, rollout_id):
    """What Gym would report after restoring the episode ``rollout_id``."""
    ep = EpisodeId.from_capture_key(rollout_id)
    group_id, g, _ = ledger._by_base[ep.rollout_id]
    attempt = ledger.groups[group_id].siblings[g].current_attempt
    return (attempt.gym_instance_id, ep.rollout_id, ep.attempt + 1)


def test_rollout_id_format_and_capture_key_parity():
    a = RolloutAttemptRecord(gym_instance_id=INST)
    base = a.base_rollout_id("step1-p3", 2)
    assert base == f"step1-p3_g2_a{a.attempt_uuid}"
    assert a.rollout_id("step1-p3", 2) == base
    for n in (1, 2, 17):
        b = a.model_copy(update={"gym_attempt": n})
        ep = EpisodeId(rollout_id=base, attempt=n)
        assert b.rollout_id("step1-p3", 2) == ep.capture_key == f"{base}-a{n}"
        assert b.episode("step1-p3", 2) == ep
        assert EpisodeId.from_capture_key(b.rollout_id("step1-p3", 2)) == ep


def test_reserve_validates_group_id_and_duplicates():
    ledger = RolloutRecoveryLedger()
    with pytest.raises(ValidationError, match="group_id"):
        _reserve(ledger, group_id="bad id/with slash")
    _reserve(ledger, group_id="g1")
    with pytest.raises(LedgerError, match="g1"):
        _reserve(ledger, group_id="g1")


def test_lifecycle_dispatch_seal_complete_train():
    ledger = RolloutRecoveryLedger()
    group = _reserve(ledger, n=3)
    reqs = ledger.reserved_attempts()
    assert [r.generation_index for r in reqs] == [0, 1, 2]
    assert all(r.group_id == "grp0" and r.gym_instance_id is None for r in reqs)
    for r in reqs:
        ledger.mark_dispatched(r.rollout_id, INST)
    assert ledger.reserved_attempts() == []
    ledger.mark_sealed(reqs[0].rollout_id, 1.0)
    ledger.mark_sealed(reqs[2].rollout_id, 0.0)
    assert ledger.complete_groups() == []
    with pytest.raises(LedgerError, match="not complete"):
        ledger.mark_group_trained("grp0")
    ledger.mark_sealed(reqs[1].rollout_id, 0.5)
    assert [g.group_id for g in ledger.complete_groups()] == ["grp0"]
    assert group.status is PromptGroupStatus.COMPLETE
    ledger.mark_group_trained("grp0")
    assert (ledger.trained_positions, ledger.trained_count) == ([(0, 1)], 1)
    assert ledger.complete_groups() == []
    with pytest.raises(LedgerError, match=r"grp0 \(position 0\) was already trained"):
        ledger.mark_group_trained("grp0")


def test_seal_errors_name_the_rollout():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=1)
    (req,) = ledger.reserved_attempts()
    with pytest.raises(LedgerError, match=f"{req.rollout_id}.*not dispatched"):
        ledger.mark_sealed(req.rollout_id, 1.0)
    with pytest.raises(LedgerError, match="unknown rollout grp0_g0_a" + "0" * 32):
        ledger.mark_sealed("grp0_g0_a" + "0" * 32, 1.0)
    ledger.mark_dispatched(req.rollout_id, INST)
    with pytest.raises(LedgerError, match=f"{req.rollout_id}-a1 is stale"):
        ledger.mark_sealed(req.rollout_id + "-a1", 1.0)
    retry = ledger.mark_failed(req.rollout_id)
    assert retry != req.rollout_id
    with pytest.raises(LedgerError, match=f"{req.rollout_id} is not the current attempt"):
        ledger.mark_sealed(req.rollout_id, 1.0)
    ledger.mark_dispatched(retry, INST)
    ledger.mark_sealed(retry, 1.0)
    with pytest.raises(LedgerError, match=retry):
        ledger.mark_sealed(retry, 1.0)  # a second seal is refused


def test_failure_retries_from_prompt_then_exhausts():
    ledger = RolloutRecoveryLedger(max_attempts_per_sibling=3)
    _reserve(ledger, n=1)
    rid = ledger.reserved_attempts()[0].rollout_id
    seen = {rid}
    for _ in range(2):
        ledger.mark_dispatched(rid, INST)
        rid = ledger.mark_failed(rid)
        assert rid not in seen and rid.startswith("grp0_g0_a")
        seen.add(rid)
        (req,) = ledger.reserved_attempts()
        assert req.rollout_id == rid and req.gym_instance_id is None
    ledger.mark_dispatched(rid, INST)
    with pytest.raises(RolloutRetriesExhausted, match=rid):
        ledger.mark_failed(rid)
    assert ledger.reserved_attempts() == []
    statuses = [a.status for a in ledger.groups["grp0"].siblings[0].attempts]
    assert statuses == [S.FAILED] * 3


def test_inventory_covers_only_turn_level_live_attempts():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, "turn1", L.TURN, n=2)
    _reserve(ledger, "pref1", L.PREFIX, n=1)
    _reserve(ledger, "sib1", L.SIBLING, n=1)
    reqs = {r.rollout_id: r for r in ledger.reserved_attempts()}
    it = iter(reqs)
    t0, t1, p0, s0 = next(it), next(it), next(it), next(it)
    ledger.mark_dispatched(t0, INST)
    ledger.mark_dispatched(t1, "nemo_gym/replica-1")
    ledger.mark_dispatched(p0, INST)
    ledger.mark_dispatched(s0, INST)
    ledger.mark_sealed(t1, 1.0)
    inv = gym_checkpoint_inventory(ledger, [INST, "nemo_gym/replica-1"])
    assert {e.capture_key for e in inv[INST]} == {t0, p0}
    assert inv["nemo_gym/replica-1"] == []
    assert set(gym_checkpoint_keys(ledger, [INST, "nemo_gym/replica-1"])[INST]) == {e.capture_key for e in inv[INST]}
    with pytest.raises(LedgerError, match=f"({t0}|{p0}).*{INST}.*not in the live topology"):
        gym_checkpoint_inventory(ledger, ["other/replica-0"])


def test_restart_turn_restored_goes_back_to_its_replica():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=2)
    r0, r1 = _dispatch_all(ledger)
    ledger.mark_sealed(r1, 1.0)
    uuid_before = ledger.groups["grp0"].siblings[0].current_attempt.attempt_uuid
    summary = ledger.bring_back({_triple(ledger, r0)})
    assert summary.restored_turn == [f"{r0}-a1"]
    assert summary.kept_siblings == [r1]
    assert summary.restarted_from_prompt == [] and summary.redone_groups == []
    attempt = ledger.groups["grp0"].siblings[0].current_attempt
    assert attempt.attempt_uuid == uuid_before
    assert (attempt.status, attempt.gym_attempt, attempt.gym_instance_id) == (S.RESERVED, 1, INST)
    # Still in the inventory: a snapshot taken before redispatch must save it again.
    assert [e.capture_key for e in gym_checkpoint_inventory(ledger, [INST])[INST]] == [f"{r0}-a1"]
    (req,) = ledger.reserved_attempts()
    assert req == ("grp0", 0, f"{r0}-a1", INST)
    with pytest.raises(LedgerError, match="must return to it"):
        ledger.mark_dispatched(req.rollout_id, "nemo_gym/replica-1")
    ledger.mark_dispatched(req.rollout_id, INST)
    ledger.mark_sealed(req.rollout_id, 0.0)
    assert [g.group_id for g in ledger.complete_groups()] == ["grp0"]


def test_restart_turn_twice_bumps_again():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=1)
    (r0,) = _dispatch_all(ledger)
    ledger.bring_back({_triple(ledger, r0)})
    # crashed again before redispatch: the RESERVED a1 episode was saved again
    ledger.bring_back({(INST, r0, 2)})
    assert ledger.reserved_attempts()[0].rollout_id == f"{r0}-a2"


def test_restart_turn_not_restored_restarts_from_prompt():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=2)
    r0, r1 = _dispatch_all(ledger)
    ledger.mark_sealed(r1, 1.0)
    summary = ledger.bring_back(set())
    assert summary.restored_turn == []
    assert summary.kept_siblings == [r1]
    (fresh,) = summary.restarted_from_prompt
    sib0 = ledger.groups["grp0"].siblings[0]
    assert [a.status for a in sib0.attempts] == [S.ABANDONED, S.RESERVED]
    assert sib0.current_attempt.gym_attempt == 0 and sib0.current_attempt.gym_instance_id is None
    assert fresh == sib0.current_attempt.rollout_id("grp0", 0) != r0
    assert ledger.reserved_attempts()[0].gym_instance_id is None


def test_restart_sibling_keeps_sealed_and_untouched_reserved():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, level=L.SIBLING, n=3)
    reqs = ledger.reserved_attempts()
    ledger.mark_dispatched(reqs[0].rollout_id, INST)
    ledger.mark_dispatched(reqs[1].rollout_id, INST)
    ledger.mark_sealed(reqs[1].rollout_id, 1.0)
    summary = ledger.bring_back()
    assert summary.kept_siblings == [reqs[1].rollout_id]
    assert len(summary.restarted_from_prompt) == 1
    assert ledger.reserved_attempts()[1].rollout_id == reqs[2].rollout_id  # never started
    assert ledger.groups["grp0"].siblings[0].attempts[0].status is S.ABANDONED


def test_restart_sibling_level_refuses_restored_triple():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, level=L.SIBLING, n=1)
    (r0,) = _dispatch_all(ledger)
    before = ledger.state_dict()
    with pytest.raises(ValueError, match=r0):
        ledger.bring_back({(INST, r0, 1)})
    assert ledger.state_dict() == before  # nothing changed


def test_restart_unknown_restored_triple_is_named():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=1)
    (r0,) = _dispatch_all(ledger)
    with pytest.raises(ValueError, match="no ledger attempt consumes.*replica-9"):
        ledger.bring_back({(INST, r0, 1), ("nemo_gym/replica-9", r0, 1)})
    with pytest.raises(ValueError, match="no ledger attempt consumes"):
        ledger.bring_back({(INST, r0, 3)})  # wrong attempt


def test_restart_prompt_group_redoes_everything():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, level=L.PROMPT_GROUP, n=2)
    _reserve(ledger, group_id="later", level=L.PROMPT_GROUP, n=1)  # never dispatched
    reqs = ledger.reserved_attempts()
    r0, r1 = reqs[0].rollout_id, reqs[1].rollout_id
    ledger.mark_dispatched(r0, INST)
    ledger.mark_dispatched(r1, INST)
    ledger.mark_sealed(r0, 1.0)
    summary = ledger.bring_back()
    assert summary.redone_groups == ["grp0"]
    assert summary.discarded_rollout_ids == [r0]  # the sealed sibling is redone too
    assert summary.kept_siblings == [] and summary.restored_turn == []
    grp = ledger.groups["grp0"]
    assert [s.attempts[0].status for s in grp.siblings] == [S.ABANDONED, S.ABANDONED]
    assert grp.siblings[0].attempts[0].reward is None
    new_ids = [r.rollout_id for r in ledger.reserved_attempts() if r.group_id == "grp0"]
    assert sorted(new_ids) == sorted(summary.restarted_from_prompt)
    assert len(new_ids) == 2 and not set(new_ids) & {r0, r1}
    assert ledger.reserved_attempts()[-1] == reqs[2]  # "later" untouched


def test_prompt_group_untouched_group_is_not_redone():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, level=L.PROMPT_GROUP, n=2)
    ids = [r.rollout_id for r in ledger.reserved_attempts()]
    summary = ledger.bring_back()
    assert summary.redone_groups == []
    assert [r.rollout_id for r in ledger.reserved_attempts()] == ids


def test_complete_groups_survive_restart():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, level=L.PROMPT_GROUP, n=1)
    (r0,) = _dispatch_all(ledger)
    ledger.mark_sealed(r0, 1.0)
    summary = ledger.bring_back()
    assert summary.redone_groups == [] and summary.discarded_rollout_ids == []
    assert [g.group_id for g in ledger.complete_groups()] == ["grp0"]


def test_state_dict_round_trip_is_json():
    ledger = RolloutRecoveryLedger(max_attempts_per_sibling=5)
    _reserve(ledger, "a", L.TURN, n=2)
    _reserve(ledger, "b", L.SIBLING, n=1)
    ra0, ra1, rb0 = _dispatch_all(ledger)
    ledger.mark_sealed(ra1, 0.25)
    ledger.mark_failed(rb0)
    state = ledger.state_dict()
    restored = RolloutRecoveryLedger.from_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    assert restored.max_attempts_per_sibling == 5
    assert restored.reserved_attempts() == ledger.reserved_attempts()
    restored.mark_sealed(ra0, 1.0)  # the index is rebuilt
    assert [g.group_id for g in restored.complete_groups()] == ["a"]


def test_load_state_dict_rejects_bad_state():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=2)
    (r0, _r1) = _dispatch_all(ledger)
    good = ledger.state_dict()

    def broken(mutate):
        state = copy.deepcopy(good)
        mutate(state)
        with pytest.raises(ValidationError) as exc:
            RolloutRecoveryLedger().load_state_dict(state)
        return str(exc.value)

    assert "surprise" in broken(lambda s: s["groups"][0].update(surprise=1))
    assert "extra" in broken(lambda s: s["groups"][0]["siblings"][0]["attempts"][0].update(extra=1))
    assert "schema_version" in broken(lambda s: s.update(schema_version=99))
    assert "gym_instance_id" in broken(
        lambda s: s["groups"][0]["siblings"][0]["attempts"][0].update(gym_attempt=1, gym_instance_id=None)
    )
    assert "group grp0 is generating but its position 0 is in trained_positions" in broken(
        lambda s: s.update(trained_positions=[[0, 1]], trained_count=1))
    assert "expected_generations" in broken(lambda s: s["groups"][0].update(expected_generations=3))
    assert "reused" in broken(
        lambda s: s["groups"][0]["siblings"][1]["attempts"][0].update(
            attempt_uuid=s["groups"][0]["siblings"][0]["attempts"][0]["attempt_uuid"]
        )
    )


# ----- property: no sealed sample is lost or duplicated -----------------------
INSTANCES = ["nemo_gym/replica-0", "nemo_gym/replica-1"]
# Weighted so that crashes often hit groups with both sealed and running siblings.
_OPS = ["reserve"] * 2 + ["dispatch"] * 4 + ["seal"] * 2 + ["fail", "snapshot", "snapshot", "crash", "train"]
ops = st.lists(
    st.tuples(
        st.sampled_from(_OPS),
        st.integers(min_value=0, max_value=63),
        st.integers(min_value=0, max_value=63),
    ),
    min_size=8,
    max_size=60,
)


class _Run:
    """A driver that keeps the ledger and data plane in step, like the controller does."""

    def __init__(self, tmpdir):
        self.tmpdir = tmpdir
        self.ledger = RolloutRecoveryLedger(max_attempts_per_sibling=100)
        self.store = DataPlaneStore()
        self.trained: list[str] = []  # survives crashes: what training consumed
        self.trained_samples: dict[str, list[str]] = {}
        self.snap = None
        self.n_groups = 0
        self.snapshot()

    def reserve(self, a, b):
        level = list(L)[a % 4]
        gid = f"grp{self.n_groups}"
        self.n_groups += 1
        self.ledger.reserve_group(gid, f"p{a}", self.n_groups, "src", "agent", level, 2 + b % 2, 1,
                                  position=self.n_groups - 1)

    def _live(self, status):
        return [
            (g.group_id, s.generation_index, s.current_attempt)
            for g in self.ledger.groups.values()
            if g.status is PromptGroupStatus.GENERATING
            for s in g.siblings
            if s.current_attempt.status is status
        ]

    def dispatch(self, a, b):
        reqs = self.ledger.reserved_attempts()
        if reqs:
            req = reqs[a % len(reqs)]
            self.ledger.mark_dispatched(req.rollout_id, req.gym_instance_id or INSTANCES[b % 2])

    def seal(self, a, b):
        live = self._live(S.DISPATCHED)
        if live:
            gid, g, attempt = live[a % len(live)]
            rid = attempt.rollout_id(gid, g)
            self.ledger.mark_sealed(rid, float(b))
            self.store.put(RolloutSample(rollout_id=rid, group_id=gid, generation_index=g, reward=float(b)))

    def fail(self, a, b):
        live = self._live(S.DISPATCHED)
        if live:
            gid, g, attempt = live[a % len(live)]
            self.ledger.mark_failed(attempt.rollout_id(gid, g))

    def train(self, a, b):
        for group in self.ledger.complete_groups():
            samples = self.store.pop_group(group.group_id)
            assert [s.generation_index for s in samples] == list(range(group.expected_generations))
            self.ledger.mark_group_trained(group.group_id)
            self.trained.append(group.group_id)
            self.trained_samples[group.group_id] = [s.rollout_id for s in samples]
            self.snapshot()  # a trainer step publishes a snapshot with it

    def snapshot(self, a=0, b=0):
        meta = self.store.save(self.tmpdir)
        self.snap = (json.dumps(self.ledger.state_dict()), meta["sha256"], self.n_groups)

    def crash(self, a, b):
        if b % 2:
            self.snapshot()  # crash right after a snapshot: in-flight work is in it
        state, sha, self.n_groups = self.snap
        self.ledger = RolloutRecoveryLedger.from_state_dict(json.loads(state))
        self.store = DataPlaneStore.load(self.tmpdir, sha)
        inventory = gym_checkpoint_inventory(self.ledger, INSTANCES)
        # Gym restores some saved episodes (the rest were unsaved / restart-only).
        restored = {
            (iid, ep.rollout_id, ep.attempt + 1)
            for iid, eps in inventory.items()
            for i, ep in enumerate(eps)
            if (a >> (i % 6)) & 1
        }
        summary = self.ledger.bring_back(restored)
        assert len(summary.restored_turn) == len(restored)
        self.store.discard(summary.discarded_rollout_ids)

    def check(self):
        assert self.ledger.sealed_rollout_ids() == self.store.rollout_ids()
        assert len(set(self.trained)) == len(self.trained)
        positions = sorted(int(g.removeprefix("grp")) for g in self.trained)  # grp<i> took position i
        assert self.ledger.trained_positions == merged_ranges(positions)
        assert self.ledger.trained_count == len(self.trained)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_property_no_sealed_sample_lost_or_duplicated(program):
    with tempfile.TemporaryDirectory() as tmp:
        run = _Run(tmp)
        for op, a, b in program:
            getattr(run, op)(a, b)
            run.check()
        # Drain: finish everything; every reserved group is trained exactly once.
        for _ in range(100):
            if not run.ledger.reserved_attempts() and not run._live(S.DISPATCHED):
                break
            run.dispatch(0, 0)
            run.seal(0, 1)
            run.train(0, 0)
            run.check()
        run.train(0, 0)
        run.check()
        assert sorted(run.trained) == sorted(f"grp{i}" for i in range(run.n_groups))
        for gid, ids in run.trained_samples.items():
            assert len(ids) == len(set(ids))


def test_attempt_status_for_current_and_superseded_ids():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=2)
    r0, r1 = _dispatch_all(ledger)
    assert ledger.attempt_status(r0) is S.DISPATCHED
    retry = ledger.mark_failed(r0)
    assert ledger.attempt_status(r0) is None  # superseded
    assert ledger.attempt_status(retry) is S.RESERVED
    assert ledger.attempt_status("not-a-rollout") is None
    assert ledger.attempt_status(r1 + "-a1") is None  # wrong Gym attempt


def test_refused_attempt_is_reserved_again_with_a_bound():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=1)
    (r0,) = _dispatch_all(ledger)
    assert ledger.mark_refused(r0, max_refusals=2) == 1
    attempt = ledger.groups["grp0"].siblings[0].current_attempt
    assert (attempt.status, attempt.gym_instance_id, attempt.refusals) == (S.RESERVED, None, 1)
    assert ledger.refused_waiting() == [r0]
    assert gym_checkpoint_inventory(ledger, [INST]) == {INST: []}  # Gym never had it
    (req,) = ledger.reserved_attempts()
    assert req == ("grp0", 0, r0, None)
    ledger.mark_dispatched(r0, "nemo_gym/replica-1")
    assert ledger.refused_waiting() == []
    ledger.mark_refused(r0, max_refusals=2)
    ledger.mark_dispatched(r0, INST)
    with pytest.raises(LedgerError, match=f"{r0} was refused by Gym 3 times"):
        ledger.mark_refused(r0, max_refusals=2)
    assert ledger.attempt_status(r0) is S.DISPATCHED  # the refused call changed nothing
    ledger.mark_refused(r0, max_refusals=5)
    with pytest.raises(LedgerError, match=f"cannot mark rollout {r0} refused: it is reserved"):
        ledger.mark_refused(r0, max_refusals=5)


def test_a_refused_restored_attempt_keeps_its_replica_and_stays_in_the_inventory():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=1)
    (r0,) = _dispatch_all(ledger)
    ledger.bring_back({_triple(ledger, r0)})
    (req,) = ledger.reserved_attempts()
    ledger.mark_dispatched(req.rollout_id, INST)
    ledger.mark_refused(req.rollout_id, max_refusals=3)
    attempt = ledger.groups["grp0"].siblings[0].current_attempt
    assert (attempt.status, attempt.gym_instance_id, attempt.gym_attempt) == (S.RESERVED, INST, 1)
    assert [e.capture_key for e in gym_checkpoint_inventory(ledger, [INST])[INST]] == [f"{r0}-a1"]


def test_state_json_is_the_state_dict_as_json():
    ledger = RolloutRecoveryLedger()
    ledger.reserve_group("g1", "p", 0, None, "agent_a", "turn", 2, 1, position=0)
    for req in ledger.reserved_attempts():
        ledger.mark_dispatched(req.rollout_id, INST)
    assert json.loads(ledger.state_json()) == ledger.state_dict()
    assert RolloutRecoveryLedger.from_state_dict(json.loads(ledger.state_json())).state_dict() == ledger.state_dict()
