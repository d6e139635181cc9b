"""Control routes over real loopback HTTP, driving a FakeParticipant."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import threading
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_patches.checkpoint import control as control_module
from gym_patches.checkpoint.control import ParticipantControlPlane
from gym_patches.checkpoint.control import scope as scope_module
from gym_patches.checkpoint.control.scope import TASK_NAME_PREFIX, JobFailed, TaskScope
from gym_patches.checkpoint.errors import ERROR_STATUS, CheckpointError
from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from gym_patches.checkpoint.participant import CheckpointParticipant, Record
from gym_patches.checkpoint.storage import FileSystemWriter
from gym_patches.checkpoint.store import MANIFEST_NAME
from gym_patches.checkpoint.wire import (
    CHECKPOINT_ID_PATTERN,
    CHECKPOINT_ROUTE_PREFIX,
    MAX_EPISODES_PER_REQUEST,
    PrepareReport,
)
from gym_patches.utils.pacing import TurnPacer

TOKEN = "tok-3f9c1e7a"


class FakeParticipant(CheckpointParticipant):
    """Test-only participant. ``live`` keys block under ``block``; if
    ``restart_only``, they are unsaved (not blockers) under ``best_effort``."""

    def __init__(self, kind: str = "agent", *, restart_only: bool = False):
        super().__init__()
        self.kind = kind  # type: ignore[misc]
        self.restart_only = restart_only
        self.live: set[str] = set()
        self.saved: dict[str, Record] = {}
        self.installed: list[Record] = []
        self.closes = 0
        self.opens = 0
        self.exports = 0
        self.fail_close = False
        self.fail_install: Exception | None = None
        self.export_gate: asyncio.Event | None = None
        self.export_cancelled = False
        self.log: list[str] | None = None  # shared call log, for ordering checks

    def _note(self, what: str) -> None:
        if self.log is not None:
            self.log.append(what)

    def set_live(self, *keys: str) -> None:
        self.live = set(keys)
        self.notify_changed()

    def save(self, key: str, **state: Any) -> None:
        ep = EpisodeId.from_capture_key(key)
        self.saved[key] = {"episode_id": ep.model_dump(), "state": state}

    async def close_admission(self, policy):
        self._note(f"close:{policy}")
        if self.fail_close:
            raise RuntimeError("fake close failure")
        self.closes += 1
        self.accepting = False

    async def open_admission(self):
        self._note("open")
        self.opens += 1
        self.accepting = True

    def readiness(self) -> PrepareReport:
        if self.accepting:
            return PrepareReport.build([], counts={"live": len(self.live)})
        if self.restart_only and self.policy == "best_effort":
            return PrepareReport.build([], unsaved=sorted(self.live))
        return PrepareReport.build(sorted(self.live))

    async def export(self, episodes):
        self.exports += 1
        if self.export_gate is not None:
            try:
                await self.export_gate.wait()
            except asyncio.CancelledError:
                self.export_cancelled = True
                raise
        keys = None if episodes is None else {e.capture_key for e in episodes}
        self.last_export = keys
        return [r for k, r in sorted(self.saved.items()) if keys is None or k in keys]

    async def install(self, records):
        if self.fail_install is not None:
            raise self.fail_install
        self.installed.extend(records)
        return [next_attempt(EpisodeId.model_validate(r["episode_id"])).capture_key for r in records]

    async def retire(self, episodes):
        self._note("retire:" + ",".join(e.capture_key for e in episodes))
        return await super().retire(episodes)

    def status_extra(self):
        return {"restart_only": self.restart_only}


class Harness:
    def __init__(self, client: TestClient, plane: ParticipantControlPlane, participant: FakeParticipant):
        self.client, self.plane, self.participant = client, plane, participant

    async def call(self, op: str, body: Any = None, *, token: str | None = TOKEN, raw: bytes | None = None):
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        path = f"{CHECKPOINT_ROUTE_PREFIX}/{op}"
        if op == "status":
            resp = await self.client.get(path, headers=headers)
        else:
            data = raw if raw is not None else json.dumps(body).encode()
            resp = await self.client.post(path, data=data, headers={**headers, "Content-Type": "application/json"})
        return resp.status, await resp.json()

    async def ok(self, op: str, **body: Any) -> dict:
        body.setdefault("deadline_ts", time.time() + 10)
        status, reply = await self.call(op, body)
        assert status == 200, reply
        return reply

    async def err(self, op: str, code: str, **body: Any) -> str:
        body.setdefault("deadline_ts", time.time() + 10)
        status, reply = await self.call(op, body)
        assert status >= 400 and reply["error"]["code"] == code, (status, reply)
        return reply["error"]["detail"]


async def start(participant: FakeParticipant, **kw: Any) -> Harness:
    kw.setdefault("instance", "agent_a")
    kw.setdefault("writer", FileSystemWriter())
    plane = ParticipantControlPlane(participant, auth_token=TOKEN, **kw)
    app = web.Application()
    plane.install(app)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return Harness(client, plane, participant)


@pytest.fixture
async def h():
    harness = await start(FakeParticipant())
    yield harness
    await harness.client.close()


def ep(key: str) -> dict:
    return EpisodeId.from_capture_key(key).model_dump()


def own_tasks() -> list[asyncio.Task]:
    """The control plane's tasks still running (each one is named ``TASK_NAME_PREFIX...``)."""
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(TASK_NAME_PREFIX) and not t.done()]


# -- auth -----------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
async def test_bad_token_is_401_and_changes_nothing(h, token):
    for op in ("status", "prepare", "resume"):
        status, reply = await h.call(op, {"checkpoint_id": "c1", "deadline_ts": time.time() + 5}, token=token)
        assert status == 401 and reply["error"]["code"] == "unauthorized"
        assert TOKEN not in json.dumps(reply)
    assert h.plane.phase == "idle" and h.plane.checkpoint_id is None
    assert h.participant.closes == 0 and h.participant.accepting
    await h.ok("prepare", checkpoint_id="c1")  # the id was not fenced by the rejected resume


async def test_status_shape(h):
    status, body = await h.call("status")
    assert status == 200
    assert body["kind"] == "agent" and body["instance"] == "agent_a" and body["phase"] == "idle"
    assert body["checkpoint_id"] is None and body["lease_expires_at"] is None
    assert body["report"]["ready"] is True and body["restart_only"] is False


# -- phases ---------------------------------------------------------------------
async def test_full_cycle_prepare_commit_resume(h, tmp_path):
    h.participant.save("r1", turn=2)
    h.participant.save("r2-a1", turn=5)
    deadline = time.time() + 10
    reply = await h.ok("prepare", checkpoint_id="c1", deadline_ts=deadline)
    assert reply["phase"] == "prepared" and reply["report"]["ready"]
    assert h.plane.phase == "prepared" and not h.participant.accepting
    assert h.plane.lease_expires_at == pytest.approx(deadline + 600.0)
    reply = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path), episode_ids=None)
    assert reply["phase"] == "committed" and reply["episode_ids"] == ["r1", "r2-a1"]
    manifest = reply["manifest"]
    assert (tmp_path / "gym" / "agent" / "agent_a" / MANIFEST_NAME).exists()
    assert manifest["record_count"] == 2 and manifest["checkpoint_id"] == "c1"
    _, status = await h.call("status")
    assert status["phase"] == "committed" and status["checkpoint_id"] == "c1"
    reply = await h.ok("resume", checkpoint_id="c1")
    assert reply == {"phase": "idle", "idempotent": False}
    assert h.participant.accepting and h.plane.phase == "idle" and h.plane.lease_expires_at is None
    assert await h.ok("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": True}
    assert h.participant.opens == 1
    await h.err("prepare", "stale_checkpoint", checkpoint_id="c1")
    await h.err("commit", "stale_checkpoint", checkpoint_id="c1", checkpoint_dir=str(tmp_path))
    assert h.plane.phase == "idle"


class EndingParticipant(FakeParticipant):
    """An agent that says which runs it answered lately (``ended_runs``)."""

    def ended_runs(self) -> list[str]:
        return ["done-1", "done-2"]


async def test_the_prepared_reply_alone_carries_the_runs_the_agent_answered_lately(h, tmp_path):
    assert (await h.ok("prepare", checkpoint_id="c0"))["report"]["ended"] is None  # the default: not said
    await h.ok("resume", checkpoint_id="c0")
    ending = await start(EndingParticipant())
    try:
        ending.participant.live.add("r9")
        preparing = await ending.ok("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
        assert preparing["phase"] == "preparing" and preparing["report"]["ended"] is None  # not ready: not yet
        ending.participant.live.clear()
        prepared = await ending.ok("prepare", checkpoint_id="c1")
        assert prepared["phase"] == "prepared" and prepared["report"]["ended"] == ["done-1", "done-2"]
        _, status = await ending.call("status")
        assert status["report"]["ended"] is None  # probes stay small
    finally:
        await ending.client.close()


async def test_idempotent_retries_and_conflicts(h, tmp_path):
    first = await h.ok("prepare", checkpoint_id="c1")
    assert await h.ok("prepare", checkpoint_id="c1") == first
    assert h.participant.closes == 1
    await h.err("prepare", "checkpoint_conflict", checkpoint_id="c1", restart_only_policy="best_effort")
    await h.err("prepare", "checkpoint_conflict", checkpoint_id="c2")
    h.participant.save("r1")
    h.participant.save("r2")
    scope = [ep("r2"), ep("r1")]
    commit = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path), episode_ids=scope)
    again = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path), episode_ids=scope[::-1])
    assert again == commit and h.participant.exports == 1
    await h.err("commit", "checkpoint_conflict", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                episode_ids=[ep("r1")])
    await h.err("commit", "checkpoint_conflict", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "other"),
                episode_ids=scope)
    assert await h.ok("prepare", checkpoint_id="c1") == first  # stored, even though now committed
    await h.err("resume", "checkpoint_conflict", checkpoint_id="c9")
    assert h.plane.phase == "committed" and not h.participant.accepting


async def test_invalid_phase(h, tmp_path):
    detail = await h.err("commit", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(tmp_path))
    assert "prepared" in detail
    await h.err("renew", "invalid_phase", checkpoint_id="c1")
    await h.ok("prepare", checkpoint_id="c1")
    detail = await h.err("retire", "invalid_phase", checkpoint_id="c1", episode_ids=[ep("r1")])
    assert "resume first" in detail
    await h.err("restore", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                episode_ids=[], source_checkpoint_id="c0")
    assert h.plane.phase == "prepared" and h.participant.retired == {}


async def test_retire_from_idle(h):
    reply = await h.ok("retire", checkpoint_id="c5", episode_ids=[ep("r1-a2"), ep("r3")])
    assert reply == {"retired": ["r1-a2", "r3"]}
    assert h.participant.retired == {"r1": 2, "r3": 0}
    assert h.plane.phase == "idle" and h.plane.lease_expires_at is None
    await h.ok("prepare", checkpoint_id="c5")  # retiring did not fence the id


async def test_renew_extends_lease(h):
    deadline = time.time() + 10
    await h.ok("prepare", checkpoint_id="c1", deadline_ts=deadline)
    reply = await h.ok("renew", checkpoint_id="c1", deadline_ts=deadline + 100)
    assert reply["lease_expires_at"] == pytest.approx(deadline + 700)
    reply = await h.ok("renew", checkpoint_id="c1", deadline_ts=deadline)  # never shortens
    assert reply["lease_expires_at"] == pytest.approx(deadline + 700)
    await h.err("renew", "checkpoint_conflict", checkpoint_id="c2")


async def test_resume_on_idle_fences_id(h):
    assert await h.ok("resume", checkpoint_id="c7") == {"phase": "idle", "idempotent": True}
    assert h.participant.opens == 0
    await h.err("prepare", "stale_checkpoint", checkpoint_id="c7")
    assert h.participant.closes == 0


# -- prepare readiness ----------------------------------------------------------
async def test_prepare_not_ready_at_deadline_stays_closed(h):
    h.participant.set_live("r1", "r2")
    t0 = time.monotonic()
    reply = await h.ok("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
    assert time.monotonic() - t0 >= 0.25
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["r1", "r2"] and reply["report"]["blocker_count"] == 2
    assert h.plane.phase == "preparing" and not h.participant.accepting
    # a retry re-waits; the blockers finish meanwhile
    asyncio.get_running_loop().call_later(0.1, h.participant.set_live)
    reply = await h.ok("prepare", checkpoint_id="c1", deadline_ts=time.time() + 5)
    assert reply["phase"] == "prepared" and h.participant.closes == 1
    await h.ok("resume", checkpoint_id="c1")
    assert h.participant.accepting


async def test_prepare_wakes_when_ready(h):
    h.participant.set_live("r1")
    asyncio.get_running_loop().call_later(0.15, h.participant.set_live)
    t0 = time.monotonic()
    reply = await h.ok("prepare", checkpoint_id="c1", deadline_ts=time.time() + 20)
    assert reply["phase"] == "prepared" and time.monotonic() - t0 < 2


async def test_resume_interleaves_with_waiting_prepare(h):
    h.participant.set_live("r1")
    waiting = asyncio.create_task(h.call("prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 20}))
    for _ in range(100):
        if h.plane.phase == "preparing":
            break
        await asyncio.sleep(0.01)
    assert await h.ok("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": False}
    status, reply = await asyncio.wait_for(waiting, 2)
    assert status == 409 and reply["error"]["code"] == "stale_checkpoint"
    assert h.participant.accepting and h.plane.phase == "idle"


async def test_close_failure_reopens(h):
    h.participant.fail_close = True
    status, reply = await h.call("prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 5})
    assert status == 500 and "fake close failure" in reply["error"]["detail"]
    assert h.plane.phase == "idle" and h.participant.opens == 1 and h.participant.accepting


async def test_commit_rechecks_readiness(h, tmp_path):
    await h.ok("prepare", checkpoint_id="c1")
    h.participant.set_live("r9")
    await h.err("commit", "invalid_phase", checkpoint_id="c1", checkpoint_dir=str(tmp_path))
    assert h.plane.phase == "prepared" and not (tmp_path / "gym").exists()


# -- best effort ----------------------------------------------------------------
async def test_best_effort_unsaved_and_restart_in_scope(tmp_path):
    h = await start(FakeParticipant(restart_only=True))
    try:
        h.participant.set_live("r1")
        h.participant.save("r2")
        reply = await h.ok("prepare", checkpoint_id="c1", restart_only_policy="best_effort")
        assert reply["phase"] == "prepared" and reply["report"]["unsaved"] == ["r1"]
        assert h.participant.policy == "best_effort"
        for scope in (None, [ep("r1"), ep("r2")]):
            detail = await h.err("commit", "restart_in_scope", checkpoint_id="c1",
                                 checkpoint_dir=str(tmp_path), episode_ids=scope)
            assert "r1" in detail
        assert h.plane.phase == "prepared" and h.participant.exports == 0
        reply = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path), episode_ids=[ep("r2")])
        assert reply["episode_ids"] == ["r2"]
    finally:
        await h.client.close()


async def test_a_run_that_arrived_after_the_prepared_reply_is_left_out_of_the_commit(tmp_path):
    """Unsaved now, unknown to the controller when it chose the scope (it reached the server after the
    prepared reply): the commit leaves it out instead of refusing, and the drain restarts it."""
    h = await start(FakeParticipant(restart_only=True))
    try:
        h.participant.save("r2")
        reply = await h.ok("prepare", checkpoint_id="c1", restart_only_policy="best_effort")
        assert reply["phase"] == "prepared" and reply["report"]["unsaved"] == []
        h.participant.set_live("r3")  # a /run arriving while closed
        reply = await h.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path),
                           episode_ids=[ep("r2"), ep("r3")])
        assert reply["episode_ids"] == ["r2"] and h.participant.last_export == {"r2"}
    finally:
        await h.client.close()


async def test_block_policy_restart_only_blocks(tmp_path):
    h = await start(FakeParticipant(restart_only=True))
    try:
        h.participant.set_live("r1")
        reply = await h.ok("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.1)
        assert reply["phase"] == "preparing" and reply["report"]["blockers"] == ["r1"]
    finally:
        await h.client.close()


# -- lease ----------------------------------------------------------------------
async def test_lease_expiry_reopens_and_fences():
    h = await start(FakeParticipant(), lease_grace_seconds=0.3)
    try:
        h.participant.set_live("r1")
        reply = await h.ok("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.1)
        assert reply["phase"] == "preparing" and not h.participant.accepting
        for _ in range(150):
            if h.participant.accepting:
                break
            await asyncio.sleep(0.01)
        assert h.participant.accepting and h.plane.phase == "idle" and h.plane.lease_expires_at is None
        await h.err("prepare", "stale_checkpoint", checkpoint_id="c1")
        h.participant.set_live()
        assert (await h.ok("prepare", checkpoint_id="c2", deadline_ts=time.time() + 5))["phase"] == "prepared"
    finally:
        await h.client.close()
    assert own_tasks() == []  # the watcher stopped with the app


# -- commit under concurrency ---------------------------------------------------
async def test_commit_retry_while_running_shares_work(h, tmp_path):
    h.participant.save("r1")
    h.participant.export_gate = asyncio.Event()
    await h.ok("prepare", checkpoint_id="c1")
    body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 10, "checkpoint_dir": str(tmp_path)}
    first = asyncio.create_task(h.call("commit", body))
    await asyncio.sleep(0.1)
    second = asyncio.create_task(h.call("commit", body))
    other = await h.call("commit", {**body, "checkpoint_dir": str(tmp_path / "x")})
    assert other[0] == 409 and other[1]["error"]["code"] == "checkpoint_conflict"
    await asyncio.sleep(0.05)
    h.participant.export_gate.set()
    (s1, r1), (s2, r2) = await asyncio.gather(first, second)
    assert s1 == s2 == 200 and r1 == r2 and h.participant.exports == 1


async def test_resume_mid_commit_aborts_cleanly(h, tmp_path):
    h.participant.save("r1")
    h.participant.export_gate = asyncio.Event()
    await h.ok("prepare", checkpoint_id="c1")
    body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 10, "checkpoint_dir": str(tmp_path)}
    pending = asyncio.create_task(h.call("commit", body))
    await asyncio.sleep(0.1)
    assert await h.ok("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": False}
    assert h.participant.export_cancelled and h.participant.accepting
    status, reply = await asyncio.wait_for(pending, 2)
    assert status == 409 and reply["error"]["code"] == "stale_checkpoint"
    assert not (tmp_path / "gym" / "agent" / "agent_a" / MANIFEST_NAME).exists()


class SlowRecords(list):
    """Test-only record list that iterates slowly off the event-loop thread (the store's writer)."""

    def __iter__(self):
        for item in super().__iter__():
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.05)
            yield item


async def test_resume_mid_write_stops_before_publish(h, tmp_path):
    for i in range(20):
        h.participant.save(f"r{i}")
    original = h.participant.export

    async def slow_export(episodes):
        return SlowRecords(await original(episodes))

    h.participant.export = slow_export  # type: ignore[method-assign]
    await h.ok("prepare", checkpoint_id="c1")
    body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 10, "checkpoint_dir": str(tmp_path)}
    pending = asyncio.create_task(h.call("commit", body))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    assert (await h.ok("resume", checkpoint_id="c1"))["idempotent"] is False
    assert time.monotonic() - t0 < 0.5  # stopped between records, not after all 20
    status, reply = await asyncio.wait_for(pending, 2)
    assert status == 409 and reply["error"]["code"] == "stale_checkpoint"
    assert list((tmp_path / "gym" / "agent" / "agent_a").iterdir()) == []  # nothing published, no temp file


# -- every job owned: dropped connections, errors kept, nothing left running -------------------
async def _drop(call: asyncio.Task) -> None:
    """Let the request reach the server, then drop its connection (the client goes away)."""
    await asyncio.sleep(0.1)
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call


async def test_a_commit_survives_a_dropped_connection_and_a_retry_gets_its_reply(h, tmp_path):
    h.participant.save("r1")
    h.participant.export_gate = asyncio.Event()
    await h.ok("prepare", checkpoint_id="c1")
    body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 10, "checkpoint_dir": str(tmp_path)}
    await _drop(asyncio.create_task(h.call("commit", body)))
    assert not h.participant.export_cancelled and len(own_tasks()) == 2  # the lease watcher and the commit
    h.participant.export_gate.set()
    status, reply = await h.call("commit", body)
    assert status == 200 and reply["phase"] == "committed" and reply["episode_ids"] == ["r1"]
    assert h.participant.exports == 1 and h.plane.phase == "committed"


class FailingExport(FakeParticipant):
    """Test-only: the export waits for ``export_gate`` and then raises ``failure``."""

    def __init__(self, failure: Exception):
        super().__init__()
        self.failure = failure
        self.export_gate = asyncio.Event()

    async def export(self, episodes):
        self.exports += 1
        await self.export_gate.wait()
        raise self.failure


@pytest.mark.parametrize("failure, status, code", [
    (RuntimeError("fake export failure"), 500, "internal_error"),
    (CheckpointError("fake export refused"), 422, "invalid_checkpoint_state"),
])
async def test_an_export_that_fails_after_the_connection_dropped_answers_every_retry_and_is_logged_once(
        tmp_path, caplog, failure, status, code):
    h = await start(FailingExport(failure))
    try:
        await h.ok("prepare", checkpoint_id="c1")
        body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 10, "checkpoint_dir": str(tmp_path)}
        with caplog.at_level(logging.WARNING):
            await _drop(asyncio.create_task(h.call("commit", body)))
            h.participant.export_gate.set()
            for _ in range(100):
                if not h.plane._scope.get("commit").running:
                    break
                await asyncio.sleep(0.01)
            for _ in range(2):  # the retry of the dropped call, and one more
                got, reply = await h.call("commit", body)
                assert got == status and reply["error"]["code"] == code, reply
                assert str(failure) in reply["error"]["detail"]
        assert h.participant.exports == 1, "a retry gets the failed job's error; it does not export again"
        logged = [r for r in caplog.records if str(failure) in r.getMessage() or str(failure) in (r.exc_text or "")]
        assert len(logged) == 1 and logged[0].name == scope_module.__name__, [r.getMessage() for r in logged]
        other = {**body, "checkpoint_dir": str(tmp_path / "other")}
        detail = await h.err("commit", "checkpoint_conflict", **other)
        assert "already ran with other arguments" in detail
        assert h.plane.phase == "prepared"
        await h.ok("resume", checkpoint_id="c1")
        assert own_tasks() != [] and len(own_tasks()) == 1  # only the lease watcher
    finally:
        await h.client.close()
    assert own_tasks() == []


async def test_stop_cancels_and_awaits_a_running_commit_and_leaves_nothing_running(tmp_path):
    h = await start(FakeParticipant())
    h.participant.save("r1")
    h.participant.export_gate = asyncio.Event()  # never set: the commit is still exporting at stop
    await h.ok("prepare", checkpoint_id="c1")
    pending = asyncio.create_task(h.call("commit", {"checkpoint_id": "c1", "deadline_ts": time.time() + 10,
                                                    "checkpoint_dir": str(tmp_path)}))
    await _drop(pending)
    assert len(own_tasks()) == 2
    await h.client.close()
    assert own_tasks() == [] and h.participant.export_cancelled
    assert not (tmp_path / "gym" / "agent" / "agent_a" / MANIFEST_NAME).exists()


async def test_a_lease_expiry_mid_commit_aborts_it_and_names_why(tmp_path):
    h = await start(FakeParticipant(), lease_grace_seconds=0.2)
    try:
        h.participant.save("r1")
        h.participant.export_gate = asyncio.Event()
        await h.ok("prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
        status, reply = await asyncio.wait_for(
            h.call("commit", {"checkpoint_id": "c1", "deadline_ts": time.time() + 0.3,
                              "checkpoint_dir": str(tmp_path)}), 5)
        assert status == 409 and reply["error"]["code"] == "stale_checkpoint"
        assert reply["error"]["detail"] == "commit for 'c1' was aborted by lease expiry"
        assert h.participant.export_cancelled and h.participant.accepting and len(own_tasks()) == 1
    finally:
        await h.client.close()


async def test_renew_and_status_answer_while_a_commit_writes(h, tmp_path):
    """The lock is not held across the write: a renew and a status answer while it is blocked."""
    gate = threading.Event()

    class BlockedWriter(FileSystemWriter):
        def write(self, path, data):
            gate.wait(10)
            super().write(path, data)

    h.participant.save("r1")
    deadline = time.time() + 10
    await h.ok("prepare", checkpoint_id="c1", deadline_ts=deadline)
    h.plane.writer = BlockedWriter()  # the plane's own writer: what its commit writes through
    try:
        commit = asyncio.create_task(h.call("commit", {"checkpoint_id": "c1", "deadline_ts": deadline,
                                                       "checkpoint_dir": str(tmp_path)}))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        reply = await asyncio.wait_for(h.ok("renew", checkpoint_id="c1", deadline_ts=deadline + 50), 2)
        assert reply["lease_expires_at"] == pytest.approx(deadline + 650)
        status, body = await asyncio.wait_for(h.call("status"), 2)
        assert status == 200 and body["phase"] == "prepared" and time.monotonic() - t0 < 1
        gate.set()
        status, reply = await asyncio.wait_for(commit, 5)
        assert status == 200 and reply["phase"] == "committed"
    finally:
        gate.set()


async def test_a_resume_mid_write_waits_for_the_write_thread_and_publishes_nothing(h, tmp_path):
    """Closing the scope stops the write before its rename and ends only once the thread has."""
    entered, gate = threading.Event(), threading.Event()

    class BlockedWriter(FileSystemWriter):
        def write(self, path, data):
            entered.set()
            gate.wait(10)
            super().write(path, data)

    h.participant.save("r1")
    await h.ok("prepare", checkpoint_id="c1")
    h.plane.writer = BlockedWriter()
    try:
        commit = asyncio.create_task(h.call("commit", {"checkpoint_id": "c1", "deadline_ts": time.time() + 10,
                                                       "checkpoint_dir": str(tmp_path)}))
        assert await asyncio.to_thread(entered.wait, 5)
        threading.Timer(0.3, gate.set).start()
        t0 = time.monotonic()
        assert (await h.ok("resume", checkpoint_id="c1"))["idempotent"] is False
        assert time.monotonic() - t0 >= 0.25, "the resume waited for the write thread"
        status, reply = await asyncio.wait_for(commit, 5)
        assert status == 409 and reply["error"]["detail"] == "commit for 'c1' was aborted by a resume"
        assert list((tmp_path / "gym" / "agent" / "agent_a").iterdir()) == []  # nothing published, no temp file
        assert len(own_tasks()) == 1
    finally:
        gate.set()


# -- restore --------------------------------------------------------------------
async def _committed_dir(tmp_path) -> str:
    src = await start(FakeParticipant())
    try:
        src.participant.save("r1", turn=1)
        src.participant.save("r2-a1", turn=4)
        await src.ok("prepare", checkpoint_id="c1")
        await src.ok("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path))
        await src.ok("resume", checkpoint_id="c1")
    finally:
        await src.client.close()
    return str(tmp_path)


async def test_restore_round_trip(h, tmp_path):
    directory = await _committed_dir(tmp_path)
    reply = await h.ok("restore", checkpoint_id="r-1", checkpoint_dir=directory,
                       episode_ids=[ep("r2-a1")], source_checkpoint_id="c1")
    assert reply == {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r2-a2"]}
    assert [r["state"] for r in h.participant.installed] == [{"turn": 4}]
    assert h.plane.phase == "restored" and h.plane.checkpoint_id == "r-1"
    again = await h.ok("restore", checkpoint_id="r-1", checkpoint_dir=directory,
                       episode_ids=[ep("r2-a1")], source_checkpoint_id="c1")
    assert again == reply and len(h.participant.installed) == 1
    await h.err("restore", "checkpoint_conflict", checkpoint_id="r-1", checkpoint_dir=directory,
                episode_ids=[ep("r1")], source_checkpoint_id="c1")
    # retire is allowed while restored
    await h.ok("retire", checkpoint_id="r-1", episode_ids=[ep("r2-a2")])
    await h.ok("resume", checkpoint_id="r-1")
    assert h.plane.phase == "idle" and h.participant.opens == 0  # restore never closed admission


async def test_restore_missing_episode_and_corrupt_file(h, tmp_path):
    directory = await _committed_dir(tmp_path)
    detail = await h.err("restore", "invalid_checkpoint_state", checkpoint_id="r-1", checkpoint_dir=directory,
                         episode_ids=[ep("r1"), ep("r9")], source_checkpoint_id="c1")
    assert "r9" in detail
    records = next((tmp_path / "gym" / "agent" / "agent_a").glob("records-*.jsonl"))
    data = bytearray(records.read_bytes())
    data[3] ^= 0x20
    records.write_bytes(bytes(data))
    status, reply = await h.call("restore", {"checkpoint_id": "r-1", "deadline_ts": time.time() + 5,
                                             "checkpoint_dir": directory, "episode_ids": [ep("r1")],
                                             "source_checkpoint_id": "c1"})
    assert status == 422 and reply["error"]["code"] == "invalid_checkpoint_state"
    assert str(records) in reply["error"]["detail"]
    assert h.plane.phase == "idle" and h.participant.installed == []


async def test_restore_install_failure_leaves_idle(h, tmp_path):
    directory = await _committed_dir(tmp_path)
    h.participant.fail_install = CheckpointError("fake install refused")
    detail = await h.err("restore", "invalid_checkpoint_state", checkpoint_id="r-1", checkpoint_dir=directory,
                         episode_ids=[ep("r1")], source_checkpoint_id="c1")
    assert "fake install refused" in detail and h.plane.phase == "idle"


# -- malformed requests ---------------------------------------------------------
VALID: dict[str, dict[str, Any]] = {
    "prepare": {"restart_only_policy": "block"},
    "renew": {},
    "resume": {},
    "retire": {"episode_ids": [{"rollout_id": "r1", "attempt": 0}]},
    "commit": {"checkpoint_dir": "DIR", "episode_ids": None},
    "restore": {"checkpoint_dir": "DIR", "episode_ids": [], "source_checkpoint_id": "c0"},
}


def valid_body(op: str, directory) -> dict[str, Any]:
    body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 30, **VALID[op]}
    if "checkpoint_dir" in body:
        body["checkpoint_dir"] = str(directory)
    return body


@pytest.mark.parametrize(
    "op, mutate, field",
    [
        ("prepare", {"checkpoint_id": "../etc"}, "checkpoint_id"),
        ("prepare", {"checkpoint_id": ""}, "checkpoint_id"),
        ("prepare", {"checkpoint_id": 7}, "checkpoint_id"),
        ("prepare", {"deadline_ts": "soon"}, "deadline_ts"),
        ("prepare", {"deadline_ts": -1}, "deadline_ts"),
        ("prepare", {"deadline_ts": True}, "deadline_ts"),
        ("commit", {"deadline_ts": "12"}, "deadline_ts"),
        ("retire", {"episode_ids": [{"rollout_id": "r1", "attempt": "1"}]}, "attempt"),
        ("prepare", {"restart_only_policy": "maybe"}, "restart_only_policy"),
        ("prepare", {"surprise_field": 1}, "surprise_field"),
        ("resume", {"deadline_ts": None}, "deadline_ts"),
        ("retire", {"episode_ids": []}, "episode_ids"),
        ("retire", {"episode_ids": [{"rollout_id": "r1-a2"}]}, "episode_ids"),
        ("commit", {"checkpoint_dir": ""}, "checkpoint_dir"),
        ("commit", {"episode_ids": "r1"}, "episode_ids"),
        ("restore", {"source_checkpoint_id": "a b"}, "source_checkpoint_id"),
    ],
)
async def test_malformed_requests_are_422_naming_the_field(h, tmp_path, op, mutate, field):
    await h.ok("prepare", checkpoint_id="c0")
    body = {**valid_body(op, tmp_path), **mutate}
    status, reply = await h.call(op, body)
    assert status == 422 and reply["error"]["code"] == "invalid_request"
    assert field in reply["error"]["detail"] and TOKEN not in reply["error"]["detail"]
    assert h.plane.phase == "prepared" and h.plane.checkpoint_id == "c0" and h.participant.closes == 1


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b"\xff\xfe", b'"str"', b'{"deadline_ts": NaN, "checkpoint_id": "c"}',
                                 b'{"deadline_ts": Infinity, "checkpoint_id": "c"}'])
async def test_unparseable_bodies(h, raw):
    status, reply = await h.call("prepare", raw=raw)
    assert status == 422 and reply["error"]["code"] == "invalid_request"
    assert h.plane.phase == "idle" and h.participant.closes == 0


_BAD_IDS = st.one_of(
    st.just(""),
    st.text(max_size=140).filter(lambda s: not re.match(CHECKPOINT_ID_PATTERN, s) or "\n" in s),
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
_BAD_DEADLINES = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0, -5.0, None, [], {}, True]),
    st.text(max_size=10).filter(lambda s: _not_a_number(s)),
)
_FIELD_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)


def _not_a_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return True
    return False


@st.composite
def malformed(draw, directory: str) -> tuple[str, dict[str, Any]]:
    op = draw(st.sampled_from(sorted(VALID)))
    body = {"checkpoint_id": "c0", "deadline_ts": 4102444800.0, **VALID[op]}
    if "checkpoint_dir" in body:
        body["checkpoint_dir"] = directory
    kind = draw(st.sampled_from(["id", "deadline", "extra", "missing", "episodes"]))
    if kind == "id":
        key = draw(st.sampled_from(["checkpoint_id", "source_checkpoint_id"] if op == "restore" else ["checkpoint_id"]))
        body[key] = draw(_BAD_IDS)
    elif kind == "deadline":
        body["deadline_ts"] = draw(_BAD_DEADLINES)
    elif kind == "extra":
        name = draw(_FIELD_NAMES.filter(lambda n: n not in body and n not in {"restart_only_policy", "episode_ids",
                                                                              "checkpoint_dir", "source_checkpoint_id"}))
        body[name] = draw(st.integers() | st.text(max_size=5))
    elif kind == "missing":
        required = ["checkpoint_id", "deadline_ts"] + [k for k in VALID[op] if k not in ("restart_only_policy",
                                                                                          "episode_ids")
                                                       or (op in ("retire", "restore") and k == "episode_ids")]
        del body[draw(st.sampled_from(required))]
    else:
        body["episode_ids"] = draw(st.sampled_from(
            [[{"rollout_id": ""}], [{"rollout_id": "r", "attempt": -1}], [{"rollout_id": "r", "x": 1}], 5, ["r1"]]
        ))
    return op, body


def test_malformed_control_requests_property(tmp_path):
    """Any malformed request: 4xx, an error code, and the phase/participant untouched."""
    loop = asyncio.new_event_loop()
    h = loop.run_until_complete(start(FakeParticipant()))
    try:
        loop.run_until_complete(h.ok("prepare", checkpoint_id="c0", deadline_ts=4102444800.0))

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(malformed(str(tmp_path)))
        def check(case):
            op, body = case
            status, reply = loop.run_until_complete(h.call(op, body))
            assert 400 <= status < 500, (op, body, status, reply)
            assert reply["error"]["code"] == "invalid_request", reply
            assert TOKEN not in json.dumps(reply)
            assert h.plane.phase == "prepared" and h.plane.checkpoint_id == "c0"
            assert h.participant.closes == 1 and h.participant.opens == 0 and h.participant.retired == {}

        check()
        assert not (tmp_path / "gym").exists()
    finally:
        loop.run_until_complete(h.client.close())
        loop.close()


# -- the status-code rule, body cap, past deadlines (docs/design.md "Control routes") ------------------
# Every code not listed here is a state conflict: 409.
NOT_409 = {"unauthorized": 401, "rollout_id_required": 400, "payload_too_large": 413, "invalid_request": 422,
           "invalid_checkpoint_state": 422, "internal_error": 500}


def test_status_code_rule():
    for code, status in ERROR_STATUS.items():
        assert status == NOT_409.get(code, 409), (code, status)
    assert set(NOT_409) <= set(ERROR_STATUS)


async def test_each_code_is_served_with_its_rule_status(tmp_path):
    """One real request per code the control routes produce; status and shape follow the rule."""
    h = await start(FakeParticipant(), max_body_bytes=64 * 1024)
    try:
        await _each_code(h, tmp_path)
    finally:
        await h.client.close()


async def _each_code(h: Harness, tmp_path) -> None:
    seen: dict[str, int] = {}

    async def record(op, body=None, **kw):
        status, reply = await h.call(op, body, **kw)
        assert set(reply) == {"error"} and set(reply["error"]) == {"code", "detail"}, reply
        seen[reply["error"]["code"]] = status

    await record("status", token="wrong")
    await record("prepare", {"checkpoint_id": "bad id", "deadline_ts": time.time() + 5})
    await record("commit", {"checkpoint_id": "c1", "deadline_ts": time.time() + 5, "checkpoint_dir": str(tmp_path)})
    await h.ok("prepare", checkpoint_id="c1")
    await record("prepare", {"checkpoint_id": "c2", "deadline_ts": time.time() + 5})
    await h.ok("resume", checkpoint_id="c1")
    await record("prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 5})
    await record("restore", {"checkpoint_id": "r1", "deadline_ts": time.time() + 5, "checkpoint_dir": str(tmp_path),
                             "episode_ids": [], "source_checkpoint_id": "c0"})
    h.participant.fail_close = True
    await record("prepare", {"checkpoint_id": "c3", "deadline_ts": time.time() + 5})
    h.participant.fail_close = False
    await record("prepare", raw=b'{"checkpoint_id": "c4", "deadline_ts": 1' + b"0" * (64 * 1024) + b"}")
    assert seen == {"unauthorized": 401, "invalid_request": 422, "invalid_phase": 409, "checkpoint_conflict": 409,
                    "stale_checkpoint": 409, "invalid_checkpoint_state": 422, "internal_error": 500,
                    "payload_too_large": 413}, seen
    assert all(status == NOT_409.get(code, 409) for code, status in seen.items())


async def test_body_over_the_cap_is_413_and_changes_nothing(tmp_path):
    h = await start(FakeParticipant(), max_body_bytes=4096)
    try:
        await h.ok("prepare", checkpoint_id="c0")
        lease = h.plane.lease_expires_at
        padded = {"checkpoint_id": "c0", "deadline_ts": time.time() + 10, "checkpoint_dir": "/" + "d" * 4096}
        status, reply = await h.call("commit", padded)  # with a Content-Length over the cap
        assert status == 413 and reply["error"]["code"] == "payload_too_large" and "4096" in reply["error"]["detail"]

        async def chunks():  # no Content-Length: the cap is enforced while reading
            yield b'{"checkpoint_id": "c0", "deadline_ts": 4102444800.0, "checkpoint_dir": "/'
            for _ in range(8):
                yield b"d" * 1024
            yield b'"}'

        resp = await h.client.post(f"{CHECKPOINT_ROUTE_PREFIX}/commit", data=chunks(),
                                   headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "payload_too_large"
        assert h.plane.phase == "prepared" and h.plane.checkpoint_id == "c0" and h.plane.lease_expires_at == lease
        assert h.participant.exports == 0 and not (tmp_path / "gym").exists()
        # just under the cap is parsed normally
        small = {"checkpoint_id": "c0", "deadline_ts": time.time() + 10, "checkpoint_dir": str(tmp_path)}
        assert (await h.ok("commit", **small))["phase"] == "committed"
    finally:
        await h.client.close()


def test_default_cap_admits_the_largest_valid_request():
    longest = {"rollout_id": "r" * 200, "attempt": 1_000_000}
    body = {"checkpoint_id": "c" * 128, "deadline_ts": 4102444800.0, "checkpoint_dir": "/" + "d" * 4095,
            "episode_ids": [longest] * MAX_EPISODES_PER_REQUEST, "source_checkpoint_id": "s" * 128}
    size = len(json.dumps(body).encode())
    assert size < control_module.MAX_CONTROL_BODY_BYTES, size
    from gym_patches.server_utils import MAX_REQUEST_BODY_BYTES

    assert control_module.MAX_CONTROL_BODY_BYTES < MAX_REQUEST_BODY_BYTES


@pytest.mark.parametrize("op", ["prepare", "renew", "retire", "commit", "restore"])
async def test_past_deadline_is_422_naming_the_field(h, tmp_path, op):
    await h.ok("prepare", checkpoint_id="c0")
    lease = h.plane.lease_expires_at
    body = {**valid_body(op, tmp_path), "checkpoint_id": "c0", "deadline_ts": time.time() - 0.5}
    status, reply = await h.call(op, body)
    assert status == 422 and reply["error"]["code"] == "invalid_request", reply
    assert "deadline_ts" in reply["error"]["detail"] and "future" in reply["error"]["detail"]
    assert h.plane.phase == "prepared" and h.plane.checkpoint_id == "c0" and h.plane.lease_expires_at == lease
    assert h.participant.closes == 1 and h.participant.exports == 0 and h.participant.retired == {}


async def test_past_deadline_on_an_idle_server_prepares_nothing(h):
    status, reply = await h.call("prepare", {"checkpoint_id": "late", "deadline_ts": time.time() - 30})
    assert status == 422 and "deadline_ts" in reply["error"]["detail"]
    assert h.plane.phase == "idle" and h.plane.lease_expires_at is None and h.participant.closes == 0
    assert (await h.ok("prepare", checkpoint_id="late"))["phase"] == "prepared"  # the id is not spent


async def test_resume_accepts_a_past_deadline(h):
    await h.ok("prepare", checkpoint_id="c0")
    reply = await h.ok("resume", checkpoint_id="c0", deadline_ts=time.time() - 60)
    assert reply == {"phase": "idle", "idempotent": False} and h.participant.opens == 1


async def test_deadline_equal_to_the_server_clock_is_past():
    now = [1_000_000.0]
    h = await start(FakeParticipant(), clock=lambda: now[0])
    try:
        status, reply = await h.call("prepare", {"checkpoint_id": "c1", "deadline_ts": now[0]})
        assert status == 422 and "deadline_ts" in reply["error"]["detail"]
        assert (await h.ok("prepare", checkpoint_id="c1", deadline_ts=now[0] + 0.001))["phase"] == "prepared"
    finally:
        await h.client.close()


# -- what a participant exports is checked ----------------------------------------
class StrayExporter(FakeParticipant):
    """Test-only: exports whatever ``records`` holds, ignoring the scope (a participant bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Record] = []

    async def export(self, episodes):
        return list(self.records)


async def test_records_outside_the_scope_or_without_an_episode_fail_the_commit(tmp_path):
    participant = StrayExporter()
    h = await start(participant)
    try:
        for n, (records, message) in enumerate([
            ([{"episode_id": {"rollout_id": "r1", "attempt": 0}}, {"episode_id": {"rollout_id": "r9", "attempt": 0}}],
             "agent_a exported 'r9', which is outside the commit scope"),
            ([{"state": 1}], "agent_a exported record 0 without a valid episode_id"),
            ([{"episode_id": {"rollout_id": "r1", "attempt": 0, "extra": 1}}],
             "agent_a exported record 0 without a valid episode_id"),
            ([{"episode_id": {"rollout_id": "r1-a2", "attempt": 0}}],  # the model's rules, not just the shape
             "agent_a exported record 0 without a valid episode_id"),
        ]):
            participant.records = records
            cid = f"c{n}"
            await h.ok("prepare", checkpoint_id=cid)
            detail = await h.err("commit", "invalid_checkpoint_state", checkpoint_id=cid,
                                 checkpoint_dir=str(tmp_path / cid), episode_ids=[ep("r1")])
            assert detail == message
            assert h.plane.phase == "prepared", "a failed commit leaves the checkpoint prepared"
            await h.ok("resume", checkpoint_id=cid)
        participant.records = [{"episode_id": {"rollout_id": "r1", "attempt": 0}, "state": {"k": 1}}]
        await h.ok("prepare", checkpoint_id="c-ok")
        reply = await h.ok("commit", checkpoint_id="c-ok", checkpoint_dir=str(tmp_path / "ok"),
                           episode_ids=[ep("r1")])
        assert reply["episode_ids"] == ["r1"]
        await h.ok("resume", checkpoint_id="c-ok")
    finally:
        await h.client.close()


async def test_a_capture_of_a_record_without_a_valid_episode_fails_the_prepare(tmp_path):
    participant = StrayExporter()
    h = await start(participant)
    try:
        for n, records in enumerate([[{"state": 1}], [{"episode_id": {"rollout_id": "r1", "attempt": -1}}]]):
            participant.records = records
            detail = await h.err("prepare", "invalid_checkpoint_state", checkpoint_id=f"c{n}", capture=True)
            assert detail == "agent_a exported record 0 without a valid episode_id"
            assert h.plane.phase == "preparing", "a failed capture is not prepared"
            await h.ok("resume", checkpoint_id=f"c{n}")
            assert h.plane.phase == "idle"
    finally:
        await h.client.close()


async def test_the_collector_is_held_only_while_prepared(tmp_path):
    import gc

    h = await start(FakeParticipant(), lease_grace_seconds=0.2)
    try:
        assert gc.isenabled()
        await h.ok("prepare", checkpoint_id="c1")
        assert not gc.isenabled(), "no full collection while rollouts are held"
        await h.ok("resume", checkpoint_id="c1")
        await h.ok("prepare", checkpoint_id="c1b", capture=True)
        assert not gc.isenabled()
        await h.ok("persist", checkpoint_id="c1b", checkpoint_dir=str(tmp_path), episode_ids=[])
        assert not gc.isenabled(), "a persist before resume keeps the pause's collector hold"
        await h.ok("resume", checkpoint_id="c1b")
        assert gc.isenabled()
        await h.ok("prepare", checkpoint_id="c2", deadline_ts=time.time() + 0.2)
        assert not gc.isenabled()
        for _ in range(200):  # the lease expires: the server reopens and the collector runs again
            if h.plane.phase == "idle":
                break
            await asyncio.sleep(0.01)
        assert h.plane.phase == "idle" and gc.isenabled()
    finally:
        await h.client.close()
        assert gc.isenabled()


# -- the task scope on its own ------------------------------------------------------------
async def test_a_scope_keeps_each_outcome_and_refuses_new_work_once_closed(caplog):
    scope = TaskScope("checkpoint 'c1'", "agent_a")

    async def fails(job):
        raise RuntimeError("boom")

    async def answers(job):
        return {"ok": 1}

    with caplog.at_level(logging.WARNING):
        failed = scope.spawn("a", "a for 'c1'", None, fails)
        done = scope.spawn("b", "b for 'c1'", None, answers)
        for _ in range(3):
            with pytest.raises(JobFailed, match="a for 'c1' failed: RuntimeError: boom"):
                await failed.result()
        assert await done.result() == {"ok": 1} and scope.get("b") is done
    assert len([r for r in caplog.records if "a for 'c1' failed" in r.getMessage()]) == 1
    await scope.close("a resume")
    with pytest.raises(CheckpointError, match="closed by a resume") as refused:
        scope.spawn("c", "c for 'c1'", None, answers)
    assert refused.value.code == "stale_checkpoint"
    assert await done.result() == {"ok": 1}, "outcomes stay readable after close"


async def test_closing_a_scope_outlasts_its_own_cancellation_until_the_thread_has_ended():
    scope = TaskScope("capture 'c1'", "agent_a")
    release, ended = threading.Event(), threading.Event()

    def blocking(stop):
        release.wait(5)
        ended.set()
        return stop.is_set()

    async def work(job):
        return await job.in_thread(blocking, job.stop)

    job = scope.spawn("w", "w for 'c1'", None, work)
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(scope.close("the server stopping"))
    await asyncio.sleep(0.05)
    closing.cancel()  # the closer itself is cancelled: it still waits for the thread
    await asyncio.sleep(0.05)
    assert not closing.done() and job.stop.is_set()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert ended.is_set() and job.task.cancelled() and scope.pending() == []
    with pytest.raises(CheckpointError, match="w for 'c1' was aborted by the server stopping"):
        await job.result()


# -- the server's pacer ---------------------------------------------------------
async def test_the_pacer_is_held_from_close_to_reopen_by_resume_lease_expiry_or_a_failed_close():
    """A checkpoint in progress holds the server's ``TurnPacer`` back (docs/design.md §4.5, "Paced
    turns"); every way out of it gives the hold back, and a resume of nothing takes none."""
    pacer = TurnPacer()
    h = await start(FakeParticipant(), lease_grace_seconds=0.3, pacer=pacer)
    try:
        await h.ok("resume", checkpoint_id="c0")
        assert not pacer.held
        await h.ok("prepare", checkpoint_id="c1")
        assert pacer.held
        await h.ok("prepare", checkpoint_id="c1")  # a retry takes no second hold
        await h.ok("resume", checkpoint_id="c1")
        assert not pacer.held

        h.participant.set_live("r1")  # never ready: the lease runs out
        reply = await h.ok("prepare", checkpoint_id="c2", deadline_ts=time.time() + 0.1)
        assert reply["phase"] == "preparing" and pacer.held
        for _ in range(150):
            if h.participant.accepting:
                break
            await asyncio.sleep(0.01)
        assert h.participant.accepting and not pacer.held

        h.participant.set_live()
        h.participant.fail_close = True
        status, _ = await h.call("prepare", {"checkpoint_id": "c3", "deadline_ts": time.time() + 5})
        assert status == 500 and not pacer.held
    finally:
        await h.client.close()
