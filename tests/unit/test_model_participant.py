"""The model server's admission gate and checkpoint participant (docs/design.md §4.5, "Model")."""

from __future__ import annotations

import asyncio

import pytest

from gym_patches.checkpoint.errors import CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.model import PolicyModelParticipant


async def wait_until(predicate, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


class FakeServer:
    """Drives calls through the gate the way the model server does."""

    def __init__(self, gate: PolicyModelParticipant):
        self.gate = gate
        self.go: dict[str | None, asyncio.Event] = {}
        self.delivered: list[tuple[str | None, str]] = []

    async def backend(self, key: str | None) -> str:
        await self.go.setdefault(key, asyncio.Event()).wait()
        return f"reply for {key}"

    async def call(self, key: str | None) -> str:
        async with self.gate.call(key) as ticket:
            reply = await self.gate.run(ticket, self.backend(key))
            await self.gate.release_response(ticket)
            self.delivered.append((key, reply))
            self.gate.delivered(ticket)
            return reply

    def finish(self, key: str | None) -> None:
        self.go.setdefault(key, asyncio.Event()).set()


@pytest.fixture
def gate() -> PolicyModelParticipant:
    return PolicyModelParticipant()


async def test_reply_finishing_while_closed_is_held_until_open(gate):
    server = FakeServer(gate)
    task = asyncio.create_task(server.call("r1"))
    await wait_until(lambda: gate.readiness().counts["inflight"] == 1)
    await gate.close_admission("block")
    assert gate.status_extra()["accepting"] is False
    assert gate.readiness().ready, "a call still generating must not block prepare"
    server.finish("r1")
    await wait_until(lambda: gate.readiness().counts["held"] == 1)
    await asyncio.sleep(0.05)
    assert not task.done() and server.delivered == []
    report = gate.readiness()
    assert report.ready and report.counts == {"waiting": 0, "inflight": 0, "held": 1, "writing": 0}
    await gate.open_admission()
    assert await asyncio.wait_for(task, 1) == "reply for r1"
    assert server.delivered == [("r1", "reply for r1")]
    assert gate.status_extra()["accepting"] is True
    assert gate.readiness().counts == {"waiting": 0, "inflight": 0, "held": 0, "writing": 0}


async def test_reply_being_written_blocks_readiness(gate):
    seen = []
    async with gate.call("r1-a2") as ticket:
        await gate.run(ticket, asyncio.sleep(0))
        await gate.release_response(ticket)
        await gate.close_admission("best_effort")  # prepare lands mid-write
        report = gate.readiness()
        seen.append((report.ready, report.blockers, report.counts["writing"]))
    assert seen == [(False, ["r1-a2"], 1)]
    assert gate.readiness().ready


async def test_call_arriving_while_closed_waits_then_runs(gate):
    server = FakeServer(gate)
    await gate.close_admission("block")
    tracked = asyncio.create_task(server.call("r2"))
    ungated = asyncio.create_task(server.call(None))
    server.finish("r2")
    server.finish(None)
    await wait_until(lambda: gate.readiness().counts["waiting"] == 2)
    await asyncio.sleep(0.05)
    assert not tracked.done() and not ungated.done()
    assert gate.readiness().ready
    await gate.open_admission()
    assert await asyncio.wait_for(tracked, 1) == "reply for r2"
    assert await asyncio.wait_for(ungated, 1) == "reply for None"
    # Only the tracked call counts towards a record.
    assert await gate.export(None) == [{"episode_id": {"rollout_id": "r2", "attempt": 0}, "delivered_calls": 1}]


async def test_waiting_counts_change_wakes_prepare(gate):
    server = FakeServer(gate)
    waiter = asyncio.create_task(gate.wait_changed(5.0))
    await asyncio.sleep(0)
    task = asyncio.create_task(server.call("r1"))
    await asyncio.wait_for(waiter, 1.0)  # admission of the call woke it
    server.finish("r1")
    await task


async def test_retire_cancels_generating_and_held_calls_and_refuses_later_ones(gate):
    server = FakeServer(gate)
    generating = asyncio.create_task(server.call("r1"))
    held = asyncio.create_task(server.call("r1-a1"))
    other = asyncio.create_task(server.call("r9"))
    await wait_until(lambda: gate.readiness().counts["inflight"] == 3)
    await gate.close_admission("block")
    server.finish("r1-a1")
    await wait_until(lambda: gate.readiness().counts["held"] == 1)
    assert await gate.retire([EpisodeId(rollout_id="r1", attempt=1)]) == ["r1-a1"]
    for task in (generating, held):
        with pytest.raises(StaleAttemptError, match="r1"):
            await asyncio.wait_for(task, 1)
    assert not other.done(), "another rollout is untouched"
    with pytest.raises(StaleAttemptError):
        async with gate.call("r1-a1"):
            pass
    with pytest.raises(StaleAttemptError):
        async with gate.call("r1"):
            pass
    await gate.open_admission()
    server.finish("r1-a2")
    assert await asyncio.wait_for(server.call("r1-a2"), 1) == "reply for r1-a2"
    server.finish("r9")
    await asyncio.wait_for(other, 1)
    assert gate.readiness().counts == {"waiting": 0, "inflight": 0, "held": 0, "writing": 0}


async def test_retire_wakes_a_call_waiting_for_admission(gate):
    server = FakeServer(gate)
    await gate.close_admission("block")
    waiting = asyncio.create_task(server.call("r3"))
    await wait_until(lambda: gate.readiness().counts["waiting"] == 1)
    await gate.retire([EpisodeId(rollout_id="r3")])
    with pytest.raises(StaleAttemptError):
        await asyncio.wait_for(waiting, 1)


async def test_export_and_install(gate):
    server = FakeServer(gate)
    for key in ("r1", "r1", "r2"):
        server.finish(key)
        await server.call(key)
    held = asyncio.create_task(server.call("r4"))  # undelivered: never counted
    await wait_until(lambda: gate.readiness().counts["inflight"] == 1)
    await gate.close_admission("block")
    everything = await gate.export(None)
    assert everything == [
        {"episode_id": {"rollout_id": "r1", "attempt": 0}, "delivered_calls": 2},
        {"episode_id": {"rollout_id": "r2", "attempt": 0}, "delivered_calls": 1},
    ]
    scoped = await gate.export([EpisodeId(rollout_id="r1"), EpisodeId(rollout_id="r4")])
    assert scoped == [
        {"episode_id": {"rollout_id": "r1", "attempt": 0}, "delivered_calls": 2},
        {"episode_id": {"rollout_id": "r4", "attempt": 0}, "delivered_calls": 0},
    ]
    assert all("token" not in key for rec in everything for key in rec)
    await gate.open_admission()
    server.finish("r4")
    await held

    fresh = PolicyModelParticipant()
    with pytest.raises(CheckpointError, match="record 1"):
        await fresh.install([scoped[0], {"episode_id": {"rollout_id": "r4"}, "delivered_calls": -1}])
    assert await fresh.export(None) == [], "a failed install installs nothing"
    assert await fresh.install(scoped) == ["r1-a1", "r4-a1"]
    assert await fresh.export(None) == [{"episode_id": {"rollout_id": "r1", "attempt": 1}, "delivered_calls": 2}]
    with pytest.raises(StaleAttemptError):  # the restored-from attempt is superseded
        async with fresh.call("r1"):
            pass
    restored = FakeServer(fresh)
    restored.finish("r1-a1")
    await restored.call("r1-a1")
    assert (await fresh.export([EpisodeId(rollout_id="r1", attempt=1)]))[0]["delivered_calls"] == 3
    await fresh.retire([EpisodeId(rollout_id="r4", attempt=1)])
    with pytest.raises(StaleAttemptError):  # installing onto a retired attempt is refused
        await fresh.install([{"episode_id": {"rollout_id": "r4", "attempt": 0}, "delivered_calls": 1}])


async def test_retired_episodes_are_not_exported(gate):
    server = FakeServer(gate)
    server.finish("r5")
    await server.call("r5")
    await gate.retire([EpisodeId(rollout_id="r5")])
    assert await gate.export(None) == []
    assert await gate.export([EpisodeId(rollout_id="r5")]) == []


# -- bookkeeping kept on ticket moves, captures reused while a count is unchanged ---------------------


def scanned_counts(gate: PolicyModelParticipant) -> tuple[dict[str, int], list[str]]:
    """Readiness counts and blockers worked out by a scan of every admitted ticket."""
    counts = {"waiting": 0, "inflight": 0, "held": 0, "writing": 0}
    blockers = []
    for ticket in gate._tickets.values():
        counts["inflight" if ticket.state == "generating" else ticket.state] += 1
        if ticket.state == "writing" and ticket.episode is not None:
            blockers.append(ticket.capture_key)
    return counts, sorted(blockers)


def assert_readiness_matches_a_scan(gate: PolicyModelParticipant) -> None:
    report = gate.readiness()
    assert (report.counts, report.blockers) == scanned_counts(gate)
    assert gate.is_ready() is report.ready  # the cheap check the control plane polls agrees


async def test_readiness_kept_on_ticket_moves_matches_a_scan(gate):
    server = FakeServer(gate)
    writing = asyncio.Event()

    async def slow_writer(key: str) -> None:  # holds its reply while "writing" it
        async with gate.call(key) as ticket:
            await gate.run(ticket, server.backend(key))
            await gate.release_response(ticket)
            await writing.wait()
            gate.delivered(ticket)

    tasks = [asyncio.create_task(server.call(k)) for k in ("r1", "r2", None)]
    writer = asyncio.create_task(slow_writer("r3"))
    server.finish("r3")
    await wait_until(lambda: gate.readiness().counts["writing"] == 1)
    assert_readiness_matches_a_scan(gate)
    await gate.close_admission("block")
    late = asyncio.create_task(server.call("r4"))  # waits for reopen
    server.finish("r1")  # finishes while closed: held
    server.finish(None)
    await wait_until(lambda: gate.readiness().counts["held"] == 2 and gate.readiness().counts["waiting"] == 1)
    assert_readiness_matches_a_scan(gate)
    assert gate.readiness().blockers == ["r3"]
    writing.set()
    await writer
    await gate.retire([EpisodeId(rollout_id="r2")])
    with pytest.raises(StaleAttemptError):
        await tasks[1]
    assert_readiness_matches_a_scan(gate)
    await gate.open_admission()  # wakes the held and the waiting calls
    server.finish("r4")
    await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2], late), 1)
    assert gate.readiness().counts == {"waiting": 0, "inflight": 0, "held": 0, "writing": 0}
    assert_readiness_matches_a_scan(gate)
    assert all(not tickets for tickets in gate._by_state.values())


async def test_capture_records_equal_the_export_and_are_reused_while_a_count_is_unchanged(gate):
    from gym_patches.checkpoint.records import CapturedRecord

    server = FakeServer(gate)
    for key in ("r2", "r1", "r1", "r3"):
        server.finish(key)
        await server.call(key)
    gate._delivered[EpisodeId(rollout_id="r0")] = 0  # restored, no reply yet: no record
    first = await gate.capture_records()
    assert all(type(c) is CapturedRecord for c in first)
    assert sorted((c.key, c.record) for c in first) == [
        (r["episode_id"]["rollout_id"], r) for r in await gate.export(None)]
    by_key = {c.key: c for c in first}
    server.finish("r2")
    await server.call("r2")  # r2 moved; r1 and r3 did not
    again = {c.key: c for c in await gate.capture_records()}
    assert again["r1"] is by_key["r1"] and again["r3"] is by_key["r3"]
    assert again["r2"] is not by_key["r2"] and again["r2"].record["delivered_calls"] == 2
    assert by_key["r2"].record["delivered_calls"] == 1, "a capture already taken never changes"
    await gate.retire([EpisodeId(rollout_id="r3")])
    assert gate.forget({"r1"}) >= 1
    assert sorted(c.key for c in await gate.capture_records()) == ["r2"]
    assert set(gate._capture_cache) == {EpisodeId(rollout_id="r2")}
