"""Staged snapshots: a ``capture`` prepare serialises inside the pause, ``persist`` writes after resume.

Over real loopback HTTP against ``ParticipantControlPlane`` with the fake
participant of ``test_control_plane`` (it isolates the control plane from any
real server).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
import time

import pytest

from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.storage import FileSystemWriter, StorageWriter
from gym_patches.checkpoint.store import read_participant_state
from tests.unit.test_control_plane import FakeParticipant, ep, own_tasks, start


@pytest.fixture
async def h():
    harness = await start(FakeParticipant())
    yield harness
    await harness.client.close()


async def test_a_capture_prepare_writes_nothing_and_persist_after_resume_writes_the_scope_from_the_copy(h, tmp_path):
    for key, turn in (("r1", 1), ("r2", 2), ("r3", 3)):
        h.participant.save(key, turn=turn)
    reply = await h.ok("prepare", checkpoint_id="c1", capture=True)
    assert reply["phase"] == "prepared" and reply["captured"] == ["r1", "r2", "r3"] and reply["captured_bytes"] > 0
    assert not (tmp_path / "gym").exists()  # nothing written inside the pause
    await h.ok("resume", checkpoint_id="c1")
    h.participant.save("r1", turn=99)  # the rollout moved on after resume
    persisted = await h.ok("persist", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                           episode_ids=[ep("r2"), ep("r1"), ep("r9")])  # r3 out of scope; r9 never captured
    manifest = persisted["manifest"]
    assert manifest["checkpoint_id"] == "c1" and manifest["record_count"] == 2
    assert persisted["episode_ids"] == ["r1", "r2"]
    _, records = read_participant_state(tmp_path, "agent", "agent_a", "c1")
    assert {r["episode_id"]["rollout_id"]: r["state"]["turn"] for r in records} == {"r1": 1, "r2": 2}
    again = await h.ok("persist", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                       episode_ids=[ep("r1"), ep("r2"), ep("r9")])
    assert again == persisted  # a retry (same scope, any order) gets the same answer
    await h.err("persist", "checkpoint_conflict", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                episode_ids=[ep("r1")])
    assert h.plane.phase == "idle" and h.participant.exports == 1


async def test_persist_of_an_unknown_replaced_or_uncaptured_checkpoint_is_stale(h, tmp_path):
    await h.err("persist", "stale_checkpoint", checkpoint_id="never", checkpoint_dir=str(tmp_path), episode_ids=[])
    h.participant.save("r1", turn=1)
    for cid in ("c1", "c2"):
        await h.ok("prepare", checkpoint_id=cid, capture=True)
        await h.ok("resume", checkpoint_id=cid)
    await h.ok("prepare", checkpoint_id="c3")  # no capture: the newest capture (c2) stays
    await h.ok("resume", checkpoint_id="c3")
    for cid in ("c1", "c3"):
        detail = await h.err("persist", "stale_checkpoint", checkpoint_id=cid,
                             checkpoint_dir=str(tmp_path / cid), episode_ids=[ep("r1")])
        assert cid in detail
    reply = await h.ok("persist", checkpoint_id="c2", checkpoint_dir=str(tmp_path / "c2"), episode_ids=[ep("r1")])
    assert reply["manifest"]["checkpoint_id"] == "c2"


async def test_a_blocking_commit_still_writes_inside_the_pause(h, tmp_path):
    h.participant.save("r1", turn=1)
    reply = await h.ok("prepare", checkpoint_id="c1")
    assert reply["captured"] is None and reply["captured_bytes"] == 0
    reply = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path))
    assert reply["manifest"]["record_count"] == 1
    await h.err("persist", "stale_checkpoint", checkpoint_id="c1", checkpoint_dir=str(tmp_path), episode_ids=[])


async def test_a_prepare_retry_that_changes_capture_conflicts(h):
    h.participant.save("r1", turn=1)
    await h.ok("prepare", checkpoint_id="c1", capture=True)
    await h.err("prepare", "checkpoint_conflict", checkpoint_id="c1")
    assert (await h.ok("prepare", checkpoint_id="c1", capture=True))["captured"] == ["r1"]
    assert h.participant.exports == 1, "a retry gets the stored reply; it does not capture again"
    h.participant.set_live("r2")  # blocks: the next prepare keeps preparing
    await h.ok("resume", checkpoint_id="c1")
    first = await h.ok("prepare", checkpoint_id="c2", capture=True, deadline_ts=time.time() + 0.2)
    assert first["phase"] == "preparing" and first["captured"] is None
    detail = await h.err("prepare", "checkpoint_conflict", checkpoint_id="c2", capture=False)
    assert "capture True" in detail


async def test_unsaved_episodes_cannot_be_persisted(tmp_path):
    participant = FakeParticipant(restart_only=True)
    harness = await start(participant)
    try:
        participant.save("r1", turn=1)
        participant.set_live("r2")
        reply = await harness.ok("prepare", checkpoint_id="c1", restart_only_policy="best_effort", capture=True)
        assert reply["report"]["unsaved"] == ["r2"]
        await harness.ok("resume", checkpoint_id="c1")
        detail = await harness.err("persist", "restart_in_scope", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                                   episode_ids=[ep("r1"), ep("r2")])
        assert "'r2'" in detail
        ok = await harness.ok("persist", checkpoint_id="c1", checkpoint_dir=str(tmp_path), episode_ids=[ep("r1")])
        assert ok["episode_ids"] == ["r1"]
    finally:
        await harness.client.close()


async def test_the_model_persists_the_same_records_from_its_capture_as_a_commit_exports(tmp_path):
    """Zero-delivered in-scope episodes get a record unless retired, judged as things stood when prepared."""
    from gym_patches.checkpoint.model import PolicyModelParticipant
    from gym_patches.checkpoint.store import read_participant_state as read

    model = PolicyModelParticipant()
    harness = await start(model)
    try:
        model._delivered[EpisodeId.from_capture_key("r1")] = 2
        model._delivered[EpisodeId.from_capture_key("r2-a1")] = 0  # restored, no reply yet
        model.mark_retired(EpisodeId.from_capture_key("r3"))
        scope = [ep("r1"), ep("r2-a1"), ep("r3"), ep("r4")]
        await harness.ok("prepare", checkpoint_id="c1")
        committed = await harness.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "commit"),
                                     episode_ids=scope)
        await harness.ok("resume", checkpoint_id="c1")
        reply = await harness.ok("prepare", checkpoint_id="c2", capture=True)
        assert reply["captured"] == ["r1"]
        await harness.ok("resume", checkpoint_id="c2")
        model.mark_retired(EpisodeId.from_capture_key("r4"))  # after resume: the capture does not see it
        model._delivered[EpisodeId.from_capture_key("r1")] = 5
        persisted = await harness.ok("persist", checkpoint_id="c2", checkpoint_dir=str(tmp_path / "persist"),
                                     episode_ids=scope)
        assert persisted["episode_ids"] == committed["episode_ids"] == ["r1", "r2-a1", "r4"]
        _, a = read(tmp_path / "commit", "model", "agent_a", "c1")
        _, b = read(tmp_path / "persist", "model", "agent_a", "c2")
        assert a == b and {r["episode_id"]["rollout_id"]: r["delivered_calls"] for r in b} == {"r1": 2, "r2": 0, "r4": 0}
    finally:
        await harness.client.close()


async def test_forget_drops_retired_marks_while_idle_only(h, tmp_path):
    h.participant.mark_retired(EpisodeId.from_capture_key("r1-a2"))
    h.participant.mark_retired(EpisodeId.from_capture_key("r2"))
    await h.ok("prepare", checkpoint_id="c1")
    await h.err("forget", "checkpoint_conflict", checkpoint_id="f1", rollout_ids=["r1"])  # not while one is active
    await h.ok("resume", checkpoint_id="c1")
    reply = await h.ok("forget", checkpoint_id="f1", rollout_ids=["r1", "never-seen"])
    assert reply == {"forgotten": 1}
    assert set(h.participant.retired) == {"r2"}
    await h.err("forget", "invalid_request", checkpoint_id="f2", rollout_ids=[])


def test_the_model_participant_forgets_delivery_counts():
    from gym_patches.checkpoint.model import PolicyModelParticipant

    model = PolicyModelParticipant()
    model._delivered[EpisodeId.from_capture_key("r1")] = 2
    model._delivered[EpisodeId.from_capture_key("r1-a1")] = 1
    model._delivered[EpisodeId.from_capture_key("r2")] = 3
    model.mark_retired(EpisodeId.from_capture_key("r1"))
    assert model.forget({"r1"}) == 3
    assert list(model._delivered) == [EpisodeId.from_capture_key("r2")] and model.retired == {}


def test_the_ledger_compacts_trained_groups_and_names_their_rollouts():
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import gym_checkpoint_inventory
    from nemo_rl.experience.rollout_recovery import LedgerError, RolloutRecoveryLedger

    ledger = RolloutRecoveryLedger()
    ledger.reserve_group("g1", "p", 0, None, None, "turn", 2, 1, position=0)
    ledger.reserve_group("g2", "p", 1, None, None, "turn", 1, 1, position=1)
    for req in ledger.reserved_attempts():
        ledger.mark_dispatched(req.rollout_id, "a/replica-0")
    keys = sorted(e.capture_key for e in gym_checkpoint_inventory(ledger, ["a/replica-0"])["a/replica-0"])
    failed = [k for k in keys if k.startswith("g1_g0")][0]
    retry = ledger.mark_failed(failed)
    ledger.mark_dispatched(retry, "a/replica-0")
    for key in [retry] + [k for k in keys if k != failed]:
        ledger.mark_sealed(key, 1.0)
    with pytest.raises(LedgerError, match="only trained groups"):
        ledger.compact_trained(["g1"])
    ledger.mark_group_trained("g1")
    ids = ledger.compact_trained(["g1"])
    assert sorted(ids) == sorted([failed, retry, [k for k in keys if k.startswith("g1_g1")][0]])
    assert set(ledger.groups) == {"g2"} and ledger.trained_positions == [(0, 1)]
    again = RolloutRecoveryLedger.from_state_dict(ledger.state_dict())  # a compacted ledger round-trips
    assert again.trained_positions == [(0, 1)] and again.trained_count == 1 and set(again.groups) == {"g2"}
    with pytest.raises(LedgerError, match="unknown group g1: not in the ledger"):
        ledger.mark_group_trained("g1")
    with pytest.raises(LedgerError, match="position 0 was already trained"):  # nor can it come back
        ledger.reserve_group("g1", "p", 0, None, None, "turn", 2, 1, position=0)


async def test_the_copy_is_immune_to_changes_in_place_after_resume(h, tmp_path):
    """A record holding Python objects is encoded at capture; one of immutable values (a fragment)
    is kept as it is and encoded by persist: either way persist writes what was there at prepare."""
    from gym_patches.checkpoint.records import fragment
    from pydantic import BaseModel

    class World(BaseModel):
        turn: int

    h.participant.save("r1", turn=1)
    h.participant.saved["r2"] = {"episode_id": dict(ep("r2")), "state": fragment(World(turn=2)), "tag": "x"}
    reply = await h.ok("prepare", checkpoint_id="c1", capture=True)
    assert reply["captured"] == ["r1", "r2"]
    await h.ok("resume", checkpoint_id="c1")
    h.participant.saved["r1"]["state"]["turn"] = 99  # changed in place
    h.participant.saved["r1"]["episode_id"]["rollout_id"] = "zz"
    h.participant.saved["r2"]["episode_id"]["attempt"] = 7
    h.participant.saved["r2"]["tag"] = "y"
    await h.ok("persist", checkpoint_id="c1", checkpoint_dir=str(tmp_path), episode_ids=[ep("r1"), ep("r2")])
    _, records = read_participant_state(tmp_path, "agent", "agent_a", "c1")
    assert records == [
        {"episode_id": {"rollout_id": "r1", "attempt": 0}, "state": {"turn": 1}},
        {"episode_id": {"rollout_id": "r2", "attempt": 0}, "state": {"turn": 2}, "tag": "x"},
    ]


class FakePersistCoordinator:
    """Test-only stand-in for ``GymCheckpointCoordinator.persist``: isolates the snapshotter's check
    of what Gym wrote from Ray and the servers (the real path runs in the functional tests)."""

    def __init__(self, written: dict[str, dict[str, list[str]]], agents: dict[str, list[str]],
                 left: dict[str, str] | None = None):
        self.written, self.agents, self.calls, self.left = written, agents, [], left or {}

    async def persist(self, checkpoint_id, root, scope, handles=None):
        from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointCommitSummary

        self.calls.append((checkpoint_id, root, {iid: {s: [e.capture_key for e in eps] for s, eps in by.items()}
                                                 for iid, by in scope.items()}))
        return ({iid: GymCheckpointCommitSummary(root, by_server, sorted(self.agents[iid]))
                 for iid, by_server in self.written.items() if iid not in self.left}, dict(self.left))


async def test_a_staged_snapshot_indexes_what_gym_wrote_and_refuses_a_lost_capture(tmp_path):
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import GymOwnershipError
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import PendingPersist, StagedStager

    iid = "nemo_gym/replica-0"
    pending = PendingPersist(scopes={iid: {"agent": ["r1", "r2"], "model": ["r1", "r2"]}},
                             exported={iid: {"r1", "r2"}}, unsaved={iid: ["r3"]})
    stager = StagedStager.__new__(StagedStager)  # only the persist step is exercised
    stager.coordinator = FakePersistCoordinator({iid: {"agent": ["r1", "r2"], "model": ["r1", "r2", "r9"]}},
                                                {iid: ["r1", "r2"]})
    index = await stager.persist("c1", tmp_path, pending)
    assert stager.coordinator.calls == [("c1", str(tmp_path), pending.scopes)]
    assert index.instances == {iid: {"agent": ["r1", "r2"], "model": ["r1", "r2"]}}  # kept to the turn-level saves
    assert index.turn_level == {iid: ["r1", "r2"]} and index.unsaved == {iid: ["r3"]}
    stager.coordinator = FakePersistCoordinator({iid: {"agent": ["r1"], "model": ["r1", "r2"]}}, {iid: ["r1"]})
    with pytest.raises(GymOwnershipError, match=r"captured \['r2'\] at prepare but did not write them"):
        await stager.persist("c1", tmp_path, pending)


async def test_a_replica_that_leaves_during_the_persist_is_left_out_of_the_index_and_the_row(tmp_path):
    """A replica the coordinator let go while persisting (lost, taken over by the in-run recovery, a stopped
    server) saves nothing: its rollouts are not in the index (they restart from the prompt if restored), the
    other replica's are, and the row counts them as left out, not saved."""
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.outcome import SnapshotOutcome
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import PendingPersist, StagedStager

    r0, r1 = "nemo_gym/replica-0", "nemo_gym/replica-1"
    pending = PendingPersist(scopes={r0: {"agent": ["a"]}, r1: {"agent": ["b", "c"]}},
                             exported={r0: {"a"}, r1: {"b", "c"}}, unsaved={r0: [], r1: ["d"]})
    stager = StagedStager.__new__(StagedStager)
    stager.coordinator = FakePersistCoordinator({r0: {"agent": ["a"]}, r1: {"agent": ["b", "c"]}},
                                                {r0: ["a"], r1: ["b", "c"]}, left={r1: "Gym server 'agent' stopped"})
    outcome = SnapshotOutcome("c1", "staged", 1)
    outcome.saved = 3
    index = await stager.persist("c1", tmp_path, pending, outcome)
    assert index.turn_level == {r0: ["a"]} and r1 not in index.instances and r1 not in index.unsaved
    assert outcome.left_out == {r1: "Gym server 'agent' stopped"} and outcome.left_out_rollouts == 2
    assert outcome.saved == 1


# -- the persist write is a job of its capture ------------------------------------------------
class FullDisk(FileSystemWriter):
    """Test-only writer: every records file fails like a full disk (the manifest is never reached)."""

    def __init__(self) -> None:
        self.calls = 0

    def write(self, path, data):
        self.calls += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


class BlockedWriter(FileSystemWriter):
    """Test-only writer that waits for ``gate`` (set from another thread) before writing."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()

    def write(self, path, data):
        self.entered.set()
        self.gate.wait(10)
        super().write(path, data)


@pytest.fixture
def writer(h):
    """Gives the harness's control plane ``w`` as its writer (what its persist writes through)."""

    def use(w: StorageWriter) -> StorageWriter:
        h.plane.writer = w
        return w

    return use


async def test_a_failed_persist_answers_its_error_to_every_retry_names_the_file_and_is_logged_once(
        h, tmp_path, writer, caplog):
    h.participant.save("r1", turn=1)
    await h.ok("prepare", checkpoint_id="c1", capture=True)
    await h.ok("resume", checkpoint_id="c1")
    disk = writer(FullDisk())
    body = {"checkpoint_id": "c1", "checkpoint_dir": str(tmp_path), "episode_ids": [ep("r1")]}
    with caplog.at_level(logging.WARNING):
        details = [await h.err("persist", "invalid_checkpoint_state", **body) for _ in range(2)]
    assert details[0] == details[1] and "No space left on device" in details[0]
    assert str(tmp_path / "gym" / "agent" / "agent_a" / "records-") in details[0]
    assert disk.calls == 1, "a retry gets the failed write's error; it does not write again"
    assert len([r for r in caplog.records if "No space left on device" in r.getMessage()]) == 1
    assert [p.name for p in (tmp_path / "gym" / "agent" / "agent_a").iterdir()] == []  # no temp file left
    assert own_tasks() != [] and len(own_tasks()) == 1  # only the lease watcher


async def test_a_persist_survives_a_dropped_connection_and_does_not_hold_the_lock(h, tmp_path, writer):
    h.participant.save("r1", turn=1)
    deadline = time.time() + 10
    await h.ok("prepare", checkpoint_id="c1", capture=True, deadline_ts=deadline)
    slow = writer(BlockedWriter())
    body = {"checkpoint_id": "c1", "deadline_ts": deadline, "checkpoint_dir": str(tmp_path),
            "episode_ids": [ep("r1")]}
    call = asyncio.create_task(h.call("persist", body))  # before resume: the pause's copy is written
    assert await asyncio.to_thread(slow.entered.wait, 5)
    call.cancel()  # the connection drops while the write is blocked
    with contextlib.suppress(asyncio.CancelledError):
        await call
    reply = await asyncio.wait_for(h.ok("renew", checkpoint_id="c1", deadline_ts=deadline + 5), 2)
    assert reply["lease_expires_at"] > deadline
    await asyncio.wait_for(h.ok("resume", checkpoint_id="c1"), 2)  # the capture's job is not the checkpoint's
    slow.gate.set()
    persisted = await asyncio.wait_for(h.ok("persist", **body), 5)
    assert persisted["episode_ids"] == ["r1"] and persisted["manifest"]["record_count"] == 1
    _, records = read_participant_state(tmp_path, "agent", "agent_a", "c1")
    assert records[0]["state"] == {"turn": 1}


async def test_a_newer_capture_stops_an_older_persist_before_it_publishes(h, tmp_path, writer):
    h.participant.save("r1", turn=1)
    await h.ok("prepare", checkpoint_id="c1", capture=True)
    await h.ok("resume", checkpoint_id="c1")
    slow = writer(BlockedWriter())
    old = asyncio.create_task(h.call("persist", {"checkpoint_id": "c1", "deadline_ts": time.time() + 10,
                                                 "checkpoint_dir": str(tmp_path / "c1"),
                                                 "episode_ids": [ep("r1")]}))
    assert await asyncio.to_thread(slow.entered.wait, 5)
    threading.Timer(0.2, slow.gate.set).start()
    reply = await h.ok("prepare", checkpoint_id="c2", capture=True)  # waits for the old write's thread
    assert reply["captured"] == ["r1"]
    status, body = await asyncio.wait_for(old, 5)
    assert status == 409 and body["error"]["detail"] == "persist for 'c1' was aborted by a newer capture"
    assert list((tmp_path / "c1" / "gym" / "agent" / "agent_a").iterdir()) == []  # nothing published
    await h.err("persist", "stale_checkpoint", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "c1"),
                episode_ids=[ep("r1")])
    await h.ok("resume", checkpoint_id="c2")
    assert (await h.ok("persist", checkpoint_id="c2", checkpoint_dir=str(tmp_path / "c2"),
                       episode_ids=[ep("r1")]))["episode_ids"] == ["r1"]


async def test_stop_waits_for_a_persist_still_writing_and_leaves_nothing_running(tmp_path):
    slow = BlockedWriter()
    harness = await start(FakeParticipant(), writer=slow)
    harness.participant.save("r1", turn=1)
    await harness.ok("prepare", checkpoint_id="c1", capture=True)
    await harness.ok("resume", checkpoint_id="c1")
    call = asyncio.create_task(harness.call("persist", {"checkpoint_id": "c1", "deadline_ts": time.time() + 10,
                                                        "checkpoint_dir": str(tmp_path),
                                                        "episode_ids": [ep("r1")]}))
    assert await asyncio.to_thread(slow.entered.wait, 5)
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    threading.Timer(0.2, slow.gate.set).start()
    await harness.client.close()
    assert own_tasks() == []
    assert list((tmp_path / "gym" / "agent" / "agent_a").iterdir()) == []  # stopped before publishing
