"""ResourcesParticipant rules (docs/design.md §4.5), driven directly without sockets."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from gym_patches.checkpoint.errors import CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.records import Fragment
from gym_patches.checkpoint.resources import ResourcesParticipant, SessionStateHooks, UnknownSessionError


class CounterHooks(SessionStateHooks):
    """A session state is a dict ``{"count": n}``; closing records what was freed."""

    def __init__(self) -> None:
        self.closed: list[Any] = []

    def export_session_state(self, state: Any) -> dict[str, Any]:
        return {"count": state["count"]}

    def restore_session_state(self, data: dict[str, Any]) -> Any:
        if set(data) != {"count"} or not isinstance(data["count"], int):
            raise ValueError(f"bad counter state {data!r}")
        return {"count": data["count"]}

    async def close_state(self, state: Any) -> None:
        self.closed.append(state)


def ep(key: str) -> EpisodeId:
    return EpisodeId.from_capture_key(key)


async def seed(p: ResourcesParticipant, key: str, sid: str, count: int = 0) -> None:
    async with p.seeding(ep(key)):
        p.add_session(sid, ep(key), {"count": count})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
def hooks() -> CounterHooks:
    return CounterHooks()


def test_unknown_mode_is_refused(hooks: CounterHooks) -> None:
    with pytest.raises(ValueError, match="checkpoint_mode"):
        ResourcesParticipant("saves", hooks)  # type: ignore[arg-type]


async def test_status_extra_and_counts(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks)
    assert p.status_extra() == {"mode": "exported", "replayable": False}
    await seed(p, "r1", "s1")
    report = p.readiness()
    assert report.ready and report.counts["sessions"] == 1 and report.counts["inflight"] == 0


async def test_exported_prepare_waits_for_inflight_call_and_holds_new_ones(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1")
    await seed(p, "r2", "s2")
    entered, leave = asyncio.Event(), asyncio.Event()

    async def running_call() -> None:
        async with p.session_call("s1") as s:
            entered.set()
            await leave.wait()
            s.state["count"] += 1

    task = asyncio.create_task(running_call())
    await entered.wait()
    await p.close_admission("block")
    report = p.readiness()
    assert not report.ready and report.blockers == ["r1"] and report.counts["inflight"] == 1

    held_ran = asyncio.Event()

    async def held_call() -> None:
        async with p.session_call("s2") as s:
            held_ran.set()
            s.state["count"] += 10

    held = asyncio.create_task(held_call())
    await settle()
    assert not held_ran.is_set() and p.readiness().counts["waiting"] == 1

    leave.set()
    await task
    report = p.readiness()
    assert report.ready and report.blockers == [] and report.unsaved == []
    records = await p.export(None)
    assert records == [
        {"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_id": "s1", "state": {"count": 1}},
        {"episode_id": {"rollout_id": "r2", "attempt": 0}, "session_id": "s2", "state": {"count": 0}},
    ]
    assert not held_ran.is_set()
    await p.open_admission()
    await held
    assert p.sessions["s2"].state["count"] == 10


async def test_seeds_wait_while_closed_in_every_mode(hooks: CounterHooks) -> None:
    for mode in ("exported", "stateless", "restart_only"):
        p = ResourcesParticipant(mode, hooks)  # type: ignore[arg-type]
        await p.close_admission("best_effort")
        task = asyncio.create_task(seed(p, "r9", "s9"))
        await settle()
        assert not task.done() and "s9" not in p.sessions, mode
        await p.open_admission()
        await task
        assert "s9" in p.sessions, mode


@pytest.mark.parametrize("mode, replayable, shown", [
    ("restart_only", False, ("restart_only", False)),
    ("restart_only", True, ("replayed", True)),  # a declared replayable restart-only server
    ("replayed", False, ("replayed", True)),
])
async def test_restart_only_block_and_best_effort(hooks: CounterHooks, mode, replayable, shown) -> None:
    """A ``replayed`` server behaves exactly as a restart-only one: only its status differs."""
    p = ResourcesParticipant(mode, hooks, replayable=replayable)
    assert p.status_extra() == {"mode": shown[0], "replayable": shown[1]}
    await seed(p, "r1", "s1")
    await seed(p, "r2-a1", "s2")
    await p.close_admission("block")
    report = p.readiness()
    assert not report.ready and report.blockers == ["r1", "r2-a1"] and report.unsaved == []
    assert p.is_ready() is False
    # tool calls are not held: the state never leaves the process anyway
    async with p.session_call("s1") as s:
        s.state["count"] += 1
    await p.open_admission()

    p.policy = "best_effort"
    await p.close_admission("best_effort")
    report = p.readiness()
    assert report.ready and report.blockers == [] and report.unsaved == ["r1", "r2-a1"]
    assert p.is_ready() is True
    assert await p.export(None) == []
    with pytest.raises(CheckpointError, match=shown[0]):
        await p.install([{"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_id": "x", "state": None}])
    with pytest.raises(CheckpointError, match="only the model server installs them"):
        await p.install([], replay={"r1"})


def test_saving_servers_declare_replayable_and_a_stateless_one_is_by_nature(hooks: CounterHooks) -> None:
    assert ResourcesParticipant("exported", hooks, replayable=True).status_extra() == \
        {"mode": "exported", "replayable": True}
    assert ResourcesParticipant("stateless", hooks).status_extra() == {"mode": "stateless", "replayable": True}


async def test_stateless_exports_routing_only(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("stateless", hooks)
    await seed(p, "r1", "s1", count=5)
    await p.close_admission("block")
    records = await p.export([ep("r1"), ep("elsewhere")])
    assert records == [{"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_id": "s1", "state": None}]
    fresh = ResourcesParticipant("stateless", CounterHooks())
    assert await fresh.install(records) == ["r1-a1"]
    assert fresh.sessions["s1"].episode == ep("r1-a1") and fresh.sessions["s1"].state is None


async def test_export_scope_and_install_under_next_attempt(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1", count=3)
    await seed(p, "r2-a2", "s2", count=4)
    await p.close_admission("block")
    records = await p.export([ep("r2-a2")])
    assert [r["session_id"] for r in records] == ["s2"]

    fresh = ResourcesParticipant("exported", CounterHooks())
    keys = await fresh.install(copy.deepcopy(await p.export(None)))
    assert keys == ["r1-a1", "r2-a3"]
    session = fresh.lookup("s2")  # the saved cookie routes to the restored state
    assert session.episode == ep("r2-a3") and session.state == {"count": 4}


async def test_install_is_all_or_nothing(hooks: CounterHooks) -> None:
    good = {"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_id": "s1", "state": {"count": 1}}
    bad_state = {"episode_id": {"rollout_id": "r2", "attempt": 0}, "session_id": "s2", "state": {"count": "x"}}
    no_episode = {"session_id": "s3", "state": {"count": 1}}
    extra = dict(good, session_id="s4", owner="me")
    for broken, pattern in ((bad_state, "record 1 .*invalid state"), (no_episode, "record 1 has no valid episode_id"),
                            (extra, "unknown field")):
        p = ResourcesParticipant("exported", hooks)
        with pytest.raises(CheckpointError, match=pattern):
            await p.install([good, broken])
        assert p.sessions == {}
    assert {"count": 1} in hooks.closed  # the state built before the failure was freed
    p = ResourcesParticipant("exported", hooks)
    with pytest.raises(CheckpointError, match="repeat session"):
        await p.install([good, dict(good, episode_id={"rollout_id": "r5", "attempt": 0})])
    await p.install([good])
    with pytest.raises(CheckpointError, match="already live"):
        await p.install([good])


async def test_retire_frees_sessions_and_refuses_the_attempt(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("restart_only", hooks)
    await seed(p, "r1", "s1", count=7)
    await seed(p, "r2", "s2")
    assert await p.retire([ep("r1")]) == ["r1"]
    assert {"count": 7} in hooks.closed and set(p.sessions) == {"s2"}
    with pytest.raises(StaleAttemptError):
        p.lookup("s1")
    with pytest.raises(StaleAttemptError):
        await seed(p, "r1", "s1b")
    await seed(p, "r1-a1", "s1c")  # the next attempt is fine
    with pytest.raises(UnknownSessionError):
        p.lookup("nope")
    with pytest.raises(UnknownSessionError):
        p.lookup(None)
    await p.close_admission("block")
    assert p.readiness().blockers == ["r1-a1", "r2"]


async def test_retire_during_a_call_frees_after_it(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1", count=1)
    async with p.session_call("s1"):
        await p.retire([ep("r1")])
        assert hooks.closed == []  # still in use
    assert hooks.closed == [{"count": 1}]


async def test_seed_retired_while_seeding_is_refused(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks)
    with pytest.raises(StaleAttemptError):
        async with p.seeding(ep("r1")):
            assert p.readiness().counts["inflight"] == 1
            await p.retire([ep("r1")])
            p.add_session("s1", ep("r1"), {"count": 0})
    assert p.sessions == {} and p.readiness().counts["inflight"] == 0


async def test_end_session_and_shutdown_free_states(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1", count=1)
    await seed(p, "r2", "s2", count=2)
    async with p.session_call("s1") as s:
        await p.end_session(s)
    assert hooks.closed == [{"count": 1}]
    with pytest.raises(UnknownSessionError):
        p.lookup("s1")
    await p.shutdown()
    assert hooks.closed == [{"count": 1}, {"count": 2}] and p.sessions == {}


async def test_readiness_change_wakes_a_waiter(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1")
    gate = asyncio.Event()

    async def call() -> None:
        async with p.session_call("s1"):
            await gate.wait()

    task = asyncio.create_task(call())
    await settle()
    await p.close_admission("block")
    waiter = asyncio.create_task(p.wait_changed(5.0))
    await settle()
    gate.set()
    await asyncio.wait_for(waiter, 1.0)  # woken by the call ending, long before the timeout
    await task
    assert p.readiness().ready


def count_exports(hooks: CounterHooks) -> list[Any]:
    """Record the count of every state the hooks export, in order (the hooks still export it)."""
    exports: list[Any] = []
    real = hooks.export_session_state

    def counting(state: Any) -> Any:
        exports.append(state["count"])
        return real(state)

    hooks.export_session_state = counting  # type: ignore[method-assign]
    return exports


async def test_export_is_reused_until_a_call_begins_on_the_session(hooks: CounterHooks) -> None:
    """A session's export is taken again only after a call began on it (calls are what change a state)."""
    exports = count_exports(hooks)
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1")
    await seed(p, "r2", "s2")
    first = await p.export(None)
    again = await p.export(None)
    assert exports == [0, 0] and again == first and again[0]["state"] is first[0]["state"]
    async with p.session_call("s1") as session:
        session.state["count"] += 1
    third = await p.export(None)
    assert exports == [0, 0, 1], "only the session a call ran on is exported again"
    assert [r["state"] for r in third] == [{"count": 1}, {"count": 0}]


async def test_after_a_checkpoint_a_call_ending_while_open_exports_its_session(hooks: CounterHooks) -> None:
    exports = count_exports(hooks)
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1")
    async with p.session_call("s1") as session:
        session.state["count"] += 1
    assert exports == [], "before any checkpoint nothing is exported ahead of time"
    await p.close_admission("block")
    await p.open_admission()
    assert exports == [1]  # at close, the idle session
    async with p.session_call("s1") as session:
        session.state["count"] += 1
    assert exports == [1, 2], "the call ended while open: exported at once"
    await p.close_admission("block")
    [record] = await p.export(None)
    assert exports == [1, 2] and record["state"] == {"count": 2}, "the capture reuses it"


async def test_capture_records_are_frozen_for_fragment_states_and_plain_for_python_ones(hooks: CounterHooks) -> None:
    from gym_patches.checkpoint.records import CapturedRecord, fragment
    from pydantic import BaseModel

    class Count(BaseModel):
        count: int

    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1")
    plain_records = await p.capture_records()
    assert plain_records == await p.export(None) and type(plain_records[0]) is dict  # Python objects: encoded by the capture
    hooks.export_session_state = lambda state: fragment(Count(count=state["count"]))  # type: ignore[method-assign]
    async with p.session_call("s1") as session:  # a call begins: the next capture exports again
        session.state["count"] += 5
    [entry] = await p.capture_records()
    assert type(entry) is CapturedRecord and entry.key == "r1" and bytes(entry.record["state"]) == b'{"count":5}'
    assert (await p.capture_records())[0] is entry, "kept while no call begins on the session"


@pytest.mark.parametrize("bad, named", [
    ({"count": b"\x00"}, "state.count is a bytes"),
    ({"count": {1, 2}}, "state.count is a set"),
    ({"count": float("nan")}, "state.count is nan"),
    ({"count": [1, (2, 3)]}, "state.count[1] is a tuple"),
    ({1: 0}, "state has a non-string key 1"),
])
async def test_a_state_that_is_not_plain_json_fails_the_export_naming_it(hooks: CounterHooks, bad, named) -> None:
    """msgspec would write these quietly changed (base64, arrays, null): the export refuses them."""
    hooks.export_session_state = lambda state: bad  # type: ignore[method-assign]
    p = ResourcesParticipant("exported", hooks, instance="counter")
    await seed(p, "r1", "s1")
    with pytest.raises(CheckpointError, match=r"counter: session 's1' of r1 exported a state that is not plain JSON") as info:
        await p.export(None)
    assert named in str(info.value)


# -- bookkeeping kept on every call (no scan of every session while rollouts are held) -------------


def scanned_readiness(p: ResourcesParticipant) -> tuple[bool, list[str], dict[str, int]]:
    """What readiness must say in a saving mode, worked out by a scan of the live sessions."""
    seeding = [s.episode.capture_key for s in p._seeding.values()]  # in flight, but never blocking
    busy = sorted({s.episode.capture_key for s in p.sessions.values() if s.inflight})
    counts = {"inflight": sum(s.inflight for s in p.sessions.values()) + len(seeding),
              "sessions": len(p.sessions), "waiting": p._waiting}
    return not busy, busy, counts


def assert_readiness_matches_a_scan(p: ResourcesParticipant) -> None:
    """Also: every idle live session has its current record kept, or is left for the capture."""
    report = p.readiness()
    assert (report.ready, report.blockers, report.counts) == scanned_readiness(p)
    assert p.is_ready() is report.ready  # the cheap check the control plane polls agrees
    idle = {sid for sid, s in p.sessions.items() if not s.inflight}
    assert set(p._records) | set(p._unexported) == idle and not set(p._records) & set(p._unexported)
    assert all(p.sessions[sid].captured == (p.sessions[sid].calls, entry) for sid, entry in p._records.items())


class FragmentHooks(CounterHooks):
    """States exported as JSON fragments (the Workplace server's way), so records are frozen and kept."""

    def export_session_state(self, state: Any) -> Any:
        return Fragment(b'{"count":%d}' % state["count"])


@pytest.mark.parametrize("fragments", [False, True], ids=["python-states", "fragment-states"])
async def test_readiness_kept_on_calls_matches_a_scan(fragments: bool) -> None:
    """Two calls on one session, a session ended and one retired with calls in flight, a seed in
    flight, an install: the kept counts equal a scan at every step."""
    hooks = FragmentHooks() if fragments else CounterHooks()
    p = ResourcesParticipant("exported", hooks)
    for i in range(4):
        await seed(p, f"r{i}", f"s{i}")
    gates = {name: asyncio.Event() for name in ("a", "b", "c", "d")}
    entered: list[str] = []

    async def call(sid: str, gate: str) -> None:
        async with p.session_call(sid):
            entered.append(gate)
            await gates[gate].wait()

    tasks = [asyncio.create_task(call("s0", "a")), asyncio.create_task(call("s0", "b")),
             asyncio.create_task(call("s1", "c")), asyncio.create_task(call("s2", "d"))]
    seed_gate = asyncio.Event()

    async def slow_seed() -> None:
        async with p.seeding(ep("r9")):
            await seed_gate.wait()
            p.add_session("s9", ep("r9"), {"count": 0})

    seeding = asyncio.create_task(slow_seed())
    await settle()
    assert sorted(entered) == ["a", "b", "c", "d"]
    assert_readiness_matches_a_scan(p)
    assert p.readiness().counts["inflight"] == 5
    await p.end_session(p.sessions["s1"])  # ended with its call in flight: no longer live, not counted
    await p.retire([ep("r2")])
    assert_readiness_matches_a_scan(p)
    assert p.readiness().blockers == ["r0"]  # r9 seeding: counted in flight, never a blocker
    gates["a"].set()
    await settle()
    assert_readiness_matches_a_scan(p)
    assert p.readiness().counts["inflight"] == 2
    await p.close_admission("block")
    gates["b"].set()
    gates["c"].set()
    gates["d"].set()
    seed_gate.set()
    await asyncio.gather(*tasks, seeding, return_exceptions=True)
    assert_readiness_matches_a_scan(p)
    assert p.readiness().ready
    records = await p.export(None)
    await p.open_admission()
    fresh = ResourcesParticipant("exported", hooks)
    await fresh.install(copy.deepcopy(records))
    assert_readiness_matches_a_scan(fresh)
    assert fresh.readiness().counts == {"inflight": 0, "sessions": 3, "waiting": 0}
    await p.shutdown()
    assert p._busy == {} and p._busy_calls == 0 and p._unexported == {}
    assert_readiness_matches_a_scan(p)


async def test_close_exports_only_sessions_not_exported_since_their_last_call() -> None:
    hooks = FragmentHooks()
    exports: list[int] = []
    export = hooks.export_session_state

    def counting(state: Any) -> Any:
        exports.append(state["count"])
        return export(state)

    hooks.export_session_state = counting  # type: ignore[method-assign]
    p = ResourcesParticipant("exported", hooks)
    await seed(p, "r1", "s1", count=1)
    await seed(p, "r2", "s2", count=2)
    await p.close_admission("block")
    assert sorted(exports) == [1, 2] and p._unexported == {}, "the first close exports every idle session"
    await p.open_admission()
    await seed(p, "r3", "s3", count=3)  # seeded after a checkpoint: exported as it goes live
    assert sorted(exports) == [1, 2, 3] and p._unexported == {}
    async with p.session_call("s1") as session:
        session.state["count"] = 10  # its call ends while open: exported as it ends
    assert sorted(exports) == [1, 2, 3, 10] and p._unexported == {}
    await p.close_admission("block")
    assert sorted(exports) == [1, 2, 3, 10], "nothing has moved since: the close exports nothing"
    entries = {e.key: bytes(e.record["state"]) for e in await p.capture_records()}
    assert entries == {"r1": b'{"count":10}', "r2": b'{"count":2}', "r3": b'{"count":3}'}
    assert sorted(exports) == [1, 2, 3, 10], "the capture made nothing again"


async def test_capture_refuses_a_call_in_flight_naming_the_first_live_session(hooks: CounterHooks) -> None:
    p = ResourcesParticipant("exported", hooks, instance="counter")
    for sid in ("s1", "s2", "s3"):
        await seed(p, f"r{sid[1]}", sid)
    leave = asyncio.Event()

    async def call(sid: str) -> None:
        async with p.session_call(sid):
            await leave.wait()

    tasks = [asyncio.create_task(call("s3")), asyncio.create_task(call("s2"))]
    await settle()
    with pytest.raises(CheckpointError, match=r"counter: session 's2' of r2 has a call in flight"):
        await p.capture_records()
    leave.set()
    await asyncio.gather(*tasks)
    assert len(await p.capture_records()) == 3
