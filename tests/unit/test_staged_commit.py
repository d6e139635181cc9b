"""Staged commit: capture (export + serialise) inside the pause, persist after resume.

Over real loopback HTTP against ``ParticipantControlPlane`` with the fake
participant of ``test_control_plane`` (it isolates the control plane from any
real server).
"""

from __future__ import annotations

import time

import pytest

from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.store import read_participant_state
from tests.unit.test_control_plane import FakeParticipant, ep, start


@pytest.fixture
async def h():
    harness = await start(FakeParticipant())
    yield harness
    await harness.client.close()


async def test_capture_writes_nothing_and_persist_after_resume_writes_the_captured_copy(h, tmp_path):
    h.participant.save("r1", turn=1)
    h.participant.save("r2", turn=2)
    await h.ok("prepare", checkpoint_id="c1")
    reply = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path), staged=True,
                       episode_ids=[ep("r1"), ep("r2")])
    assert reply["staged"] is True and reply["manifest"] is None and reply["captured_bytes"] > 0
    assert reply["episode_ids"] == ["r1", "r2"]
    assert not (tmp_path / "gym").exists()  # nothing written inside the pause
    await h.ok("resume", checkpoint_id="c1")
    h.participant.save("r1", turn=99)  # the rollout moved on after resume
    persisted = await h.ok("persist", checkpoint_id="c1")
    manifest = persisted["manifest"]
    assert manifest["checkpoint_id"] == "c1" and manifest["record_count"] == 2
    _, records = read_participant_state(tmp_path, "agent", "agent_a", "c1")
    assert {r["episode_id"]["rollout_id"]: r["state"]["turn"] for r in records} == {"r1": 1, "r2": 2}
    assert (await h.ok("persist", checkpoint_id="c1")) == persisted  # a retry gets the same answer
    assert h.plane.phase == "idle"


async def test_persist_of_an_unknown_or_replaced_capture_is_stale(h, tmp_path):
    await h.err("persist", "stale_checkpoint", checkpoint_id="never")
    h.participant.save("r1", turn=1)
    for cid in ("c1", "c2"):
        await h.ok("prepare", checkpoint_id=cid)
        await h.ok("commit", checkpoint_id=cid, checkpoint_dir=str(tmp_path / cid), staged=True)
        await h.ok("resume", checkpoint_id=cid)
    detail = await h.err("persist", "stale_checkpoint", checkpoint_id="c1")
    assert "c1" in detail
    assert (await h.ok("persist", checkpoint_id="c2"))["manifest"]["checkpoint_id"] == "c2"


async def test_a_blocking_commit_still_writes_inside_the_pause(h, tmp_path):
    h.participant.save("r1", turn=1)
    await h.ok("prepare", checkpoint_id="c1")
    reply = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path))
    assert reply["staged"] is False and reply["manifest"]["record_count"] == 1
    await h.err("persist", "stale_checkpoint", checkpoint_id="c1")  # nothing staged


async def test_staged_and_blocking_retries_conflict(h, tmp_path):
    h.participant.save("r1", turn=1)
    await h.ok("prepare", checkpoint_id="c1")
    await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path), staged=True)
    await h.err("commit", "checkpoint_conflict", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                deadline_ts=time.time() + 10)


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
    from nemo_rl.experience.rollout_recovery import LedgerError, RolloutRecoveryLedger

    ledger = RolloutRecoveryLedger()
    ledger.reserve_group("g1", "p", 0, None, None, "turn", 2, 1)
    ledger.reserve_group("g2", "p", 1, None, None, "turn", 1, 1)
    for req in ledger.reserved_attempts():
        ledger.mark_dispatched(req.rollout_id, "a/replica-0")
    keys = sorted(e.capture_key for e in ledger.gym_checkpoint_inventory(["a/replica-0"])["a/replica-0"])
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
    assert set(ledger.groups) == {"g2"} and ledger.trained_group_ids == ["g1"]
    again = RolloutRecoveryLedger.from_state_dict(ledger.state_dict())  # a compacted ledger round-trips
    assert again.trained_group_ids == ["g1"] and set(again.groups) == {"g2"}
    with pytest.raises(LedgerError, match="already trained"):
        ledger.mark_group_trained("g1")
