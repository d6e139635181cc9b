"""Agent checkpoint participants driven by the real loop (checkpoint/agent.py, loop.py).

The model and resources servers are replaced by ``FakeLoopIO`` only to put a
session exactly where a test needs it (a held model reply, a tool in flight);
the participant and the loop under test are the real ones.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gym_patches.checkpoint.agent import (
    AgentSessionParticipant,
    EndedRuns,
    RestartOnlyAgentParticipant,
    make_record,
)
from gym_patches.checkpoint.errors import AdmissionClosedError, CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.records import fragment, plain, record_key
from gym_patches.responses_api_agents.loop import (
    TOKEN_INFO_KEYS,
    RunRequestError,
    SimpleAgentLoopState,
    run_episode,
)
from gym_patches.utils.pacing import TurnPacer

pytestmark = pytest.mark.timeout(20)

ROW = {
    "id": "row-1",
    "responses_create_params": {"input": "book lunch", "tools": [{"type": "function", "name": "lookup"}]},
}


def call_reply(*names: str, rid: str = "r") -> dict[str, Any]:
    output = [
        {"type": "function_call", "call_id": f"{rid}-c{i}", "name": n, "arguments": json.dumps({"q": n})}
        for i, n in enumerate(names)
    ]
    output[-1].update(prompt_token_ids=[1, 2], generation_token_ids=[3], generation_log_probs=[-0.5], weight_version=0)
    return {"id": rid, "object": "response", "model": "m", "output": output,
            "usage": {"input_tokens": 2, "output_tokens": 1, "total_tokens": 3}}


def final_reply(text: str = "Done.", rid: str = "f") -> dict[str, Any]:
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}],
            "prompt_token_ids": [1], "generation_token_ids": [4], "generation_log_probs": [-0.1], "weight_version": 0}
    return {"id": rid, "object": "response", "model": "m", "output": [item],
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}


class FakeLoopIO:
    """In-process stand-in for the model and resources servers. Replies are
    scripted per capture key; a gate (asyncio.Event) holds a model turn, a tool
    or a seed until the test opens it."""

    def __init__(self, script: dict[str, list[dict[str, Any]]]):
        self.script = script
        self.model_bodies: dict[str, list[dict[str, Any]]] = {}
        self.tool_calls: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.seeds: list[str] = []
        self.verified: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        self.model_gates: dict[tuple[str, int], asyncio.Event] = {}
        self.tool_gates: dict[str, asyncio.Event] = {}
        self.seed_gates: dict[str, asyncio.Event] = {}

    def gate_model(self, key: str, turn: int) -> asyncio.Event:
        return self.model_gates.setdefault((key, turn), asyncio.Event())

    def gate_tool(self, name: str) -> asyncio.Event:
        return self.tool_gates.setdefault(name, asyncio.Event())

    def gate_seed(self, key: str) -> asyncio.Event:
        return self.seed_gates.setdefault(key, asyncio.Event())

    async def seed(self, row: dict[str, Any], capture_key: str) -> dict[str, str]:
        self.seeds.append(capture_key)
        gate = self.seed_gates.get(capture_key)
        if gate is not None:
            await gate.wait()
        return {"ng_session": f"s-{capture_key}"}

    async def call_model(self, capture_key: str, body: dict[str, Any]) -> dict[str, Any]:
        bodies = self.model_bodies.setdefault(capture_key, [])
        bodies.append(body)
        turn = len(bodies)
        gate = self.model_gates.get((capture_key, turn))
        if gate is not None:
            await gate.wait()
        return self.script[EpisodeId.from_capture_key(capture_key).rollout_id][turn - 1]

    async def call_tool(self, name: str, arguments: dict[str, Any], cookies: dict[str, str]) -> str:
        self.tool_calls.append((name, arguments, cookies))
        gate = self.tool_gates.get(name)
        if gate is not None:
            await gate.wait()
        return f"ok:{name}"

    async def verify(self, row: dict[str, Any], output: list[dict[str, Any]], cookies: dict[str, str]) -> float:
        self.verified.append((row, output))
        return 1.0 if output and output[-1].get("type") == "message" else 0.0


async def until(cond, timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


def start(p: AgentSessionParticipant, io: FakeLoopIO, key: str, max_steps: int = 6) -> asyncio.Task:
    episode = EpisodeId.from_capture_key(key)

    async def runner(activation=None, restored_from=None, restored_state=None):
        return await run_episode(io, ROW, capture_key=key, max_steps=max_steps, activation=activation,
                                 restored_from=restored_from, restored_state=restored_state)

    return asyncio.create_task(p.run_session(episode, runner))


def phase(p: AgentSessionParticipant, key: str) -> str | None:
    s = p._sessions.get(key)
    return None if s is None else s.phase


# -- the loop ---------------------------------------------------------------


async def test_loop_runs_tools_and_verifies():
    io = FakeLoopIO({"r1": [call_reply("lookup", "book"), final_reply()]})
    reply = await run_episode(io, ROW, capture_key="r1", max_steps=6)
    assert reply.termination_reason == "final_answer" and reply.reward == 1.0
    assert reply.num_model_calls == 2 and reply.restored_from is None
    types = [i["type"] for i in reply.response["output"]]
    assert types == ["function_call", "function_call", "function_call_output", "function_call_output", "message"]
    assert reply.response["output"][1]["generation_token_ids"] == [3]  # token info kept for training
    assert [c[0] for c in io.tool_calls] == ["lookup", "book"]
    assert io.tool_calls[0][2] == {"ng_session": "s-r1"}
    second = io.model_bodies["r1"][1]["input"]
    assert second[0] == {"type": "message", "role": "user", "content": "book lunch"}
    assert [i["type"] for i in second[1:]] == types[:4]
    assert not any(k in item for item in second for k in TOKEN_INFO_KEYS)  # never sent back as input
    assert io.model_bodies["r1"][0]["tools"] == ROW["responses_create_params"]["tools"]


async def test_loop_stops_at_max_steps_and_on_incomplete():
    io = FakeLoopIO({"r1": [call_reply("a"), call_reply("b"), final_reply()]})
    reply = await run_episode(io, ROW, capture_key="r1", max_steps=2)
    assert reply.termination_reason == "max_steps" and reply.num_model_calls == 2
    assert reply.response["output"][-1]["type"] == "function_call_output"
    cut = final_reply()
    cut["incomplete_details"] = {"reason": "max_output_tokens"}
    io = FakeLoopIO({"r2": [cut]})
    reply = await run_episode(io, ROW, capture_key="r2", max_steps=6)
    assert reply.termination_reason == "incomplete" and reply.num_model_calls == 1


async def test_loop_turns_bad_calls_into_outputs_without_calling_tools():
    bad = call_reply("lookup")
    bad["output"][0]["arguments"] = "{not json"
    reserved = call_reply("verify")
    io = FakeLoopIO({"r1": [bad, reserved, final_reply()]})
    reply = await run_episode(io, ROW, capture_key="r1", max_steps=6)
    outs = [i["output"] for i in reply.response["output"] if i["type"] == "function_call_output"]
    assert outs[0].startswith("Error: arguments of lookup are not valid JSON")
    assert outs[1].startswith("Error: unknown tool 'verify'")
    assert io.tool_calls == [] and len(io.verified) == 1


# -- AgentSessionParticipant ----------------------------------------------------


async def test_session_waiting_on_model_counts_as_parked_at_B0():
    p = AgentSessionParticipant()
    io = FakeLoopIO({"r1": [call_reply("lookup"), final_reply()]})
    gate = io.gate_model("r1", 2)
    run = start(p, io, "r1")
    await until(lambda: phase(p, "r1") == "awaiting_model" and len(io.model_bodies.get("r1", [])) == 2)
    await p.close_admission("block")
    report = p.readiness()
    assert report.ready and report.blockers == []
    assert report.counts == {"sessions": 1, "at_boundary": 0, "awaiting_model": 1}
    [record] = map(plain, await p.export(None))
    assert record["episode_id"] == {"rollout_id": "r1", "attempt": 0}
    assert record["boundary"] == "B0" and record["session_key"] == "run:r1"
    state = record["state"]
    assert state["step"] == 1 and state["pending_tools"] is False
    assert [i["type"] for i in state["new_outputs"]] == ["function_call", "function_call_output"]
    assert state["resources_cookies"] == {"ng_session": "s-r1"} and state["seed_row"] == ROW
    await p.open_admission()
    gate.set()
    reply = await run
    assert reply.termination_reason == "final_answer" and reply.reward == 1.0
    assert p.readiness().counts["sessions"] == 0


async def test_reply_after_ready_is_kept_but_session_stays_at_B0_until_reopen():
    p = AgentSessionParticipant()
    io = FakeLoopIO({"r1": [call_reply("lookup"), call_reply("book"), final_reply()]})
    gate = io.gate_model("r1", 2)
    run = start(p, io, "r1")
    await until(lambda: len(io.model_bodies.get("r1", [])) == 2)
    await p.close_admission("block")
    assert p.readiness().ready  # counted at B0
    gate.set()  # the reply arrives while the park is requested
    await until(lambda: phase(p, "r1") == "holding_reply")
    await asyncio.sleep(0.02)
    assert [c[0] for c in io.tool_calls] == ["lookup"]  # turn 2's tool did not run
    assert p.readiness().ready
    [record] = map(plain, await p.export([EpisodeId(rollout_id="r1")]))
    assert record["boundary"] == "B0" and record["state"]["step"] == 1
    await p.open_admission()
    reply = await run
    assert [c[0] for c in io.tool_calls] == ["lookup", "book"]
    assert reply.num_model_calls == 3 and len(io.model_bodies["r1"]) == 3  # the kept reply was used


async def test_running_tools_block_then_park_at_P2_and_reply_before_ready_parks_at_P1():
    p = AgentSessionParticipant()
    io = FakeLoopIO({"ra": [call_reply("lookup", rid="a1"), final_reply()],
                     "rb": [call_reply("slow", rid="b1"), final_reply()]})
    model_gate = io.gate_model("ra", 1)
    tool_gate = io.gate_tool("slow")
    run_a, run_b = start(p, io, "ra"), start(p, io, "rb")
    await until(lambda: phase(p, "ra") == "awaiting_model" and ("slow", {"q": "slow"}, {"ng_session": "s-rb"}) in io.tool_calls)
    await p.close_admission("block")
    report = p.readiness()
    assert not report.ready and report.blockers == ["rb"] and report.blocker_count == 1
    model_gate.set()  # ra's reply arrives before the agent was ready: it goes on to P1
    await until(lambda: phase(p, "ra") == "parked")
    assert [c[0] for c in io.tool_calls] == ["slow"]  # ra's tools stay pending
    assert not p.readiness().ready
    tool_gate.set()
    await until(lambda: phase(p, "rb") == "parked")
    report = p.readiness()
    assert report.ready and report.counts == {"sessions": 2, "at_boundary": 2, "awaiting_model": 0}
    records = {r["episode_id"]["rollout_id"]: plain(r) for r in await p.export(None)}
    a, b = records["ra"], records["rb"]
    assert a["boundary"] == "P1" and a["state"]["pending_tools"] is True and a["state"]["step"] == 1
    assert [i["type"] for i in a["state"]["new_outputs"]] == ["function_call"]
    assert a["state"]["last_model_response"]["id"] == "a1"
    assert b["boundary"] == "P2" and b["state"]["pending_tools"] is False
    assert [i["type"] for i in b["state"]["new_outputs"]] == ["function_call", "function_call_output"]
    await p.open_admission()
    assert (await run_a).reward == 1.0 and (await run_b).reward == 1.0


async def test_capture_reuses_an_unmoved_sessions_bytes_and_never_a_moved_ones():
    """A session that has not run since the last capture is not serialised again; one that has is."""
    p = AgentSessionParticipant()
    io = FakeLoopIO({"r1": [call_reply("lookup"), call_reply("lookup", rid="r2"), final_reply()]})
    first, second = io.gate_model("r1", 1), io.gate_model("r1", 2)
    run = start(p, io, "r1")
    await until(lambda: phase(p, "r1") == "awaiting_model")
    await p.close_admission("block")
    [a] = await p.export(None)
    await p.open_admission()
    await p.close_admission("block")  # the next snapshot: the session is still waiting on its first reply
    [b] = await p.export(None)
    assert b["state"] is a["state"], "an unmoved session must reuse its captured bytes"
    await p.open_admission()
    first.set()  # the reply arrives: the loop runs the tool and waits on the second turn
    await until(lambda: phase(p, "r1") == "awaiting_model" and len(io.model_bodies["r1"]) == 2)
    await p.close_admission("block")
    [c] = await p.export(None)
    live = p._sessions["r1"].state
    assert c["state"] is not a["state"] and bytes(c["state"]) == bytes(fragment(live))
    assert plain(c)["state"]["step"] == 1 and plain(a)["state"]["step"] == 0
    await p.open_admission()
    second.set()
    assert (await run).reward == 1.0


async def test_sessions_are_serialised_as_they_come_to_rest_once_a_checkpoint_has_been_prepared():
    """Before any checkpoint nothing is serialised; after one, a session coming to rest while open is
    (so the next capture finds its bytes ready and reuses them)."""
    p = AgentSessionParticipant()
    io = FakeLoopIO({"r1": [call_reply("lookup"), call_reply("lookup", rid="r2"), final_reply()]})
    first, second = io.gate_model("r1", 1), io.gate_model("r1", 2)
    run = start(p, io, "r1")
    await until(lambda: phase(p, "r1") == "awaiting_model")
    assert p._sessions["r1"].captured is None and not p.capture_eagerly  # runs without snapshots never pay
    await p.close_admission("block")
    await p.open_admission()
    first.set()  # open: the loop runs the tool and comes to rest waiting on its second reply
    await until(lambda: phase(p, "r1") == "awaiting_model" and len(io.model_bodies["r1"]) == 2)
    s = p._sessions["r1"]
    assert s.captured is not None and s.captured[0] == s.version
    entry = s.captured[1]
    assert entry.key == "r1" and bytes(entry.record["state"]) == bytes(fragment(s.state))
    await p.close_admission("block")
    [record] = await p.export(None)
    assert record["state"] is entry.record["state"], "the export reuses the bytes taken while open"
    assert await p.capture_records() == [entry] and (await p.capture_records())[0] is entry
    await p.open_admission()
    second.set()
    assert (await run).reward == 1.0


async def test_a_seed_in_flight_never_blocks_and_its_run_waits_for_reopen_before_its_first_turn():
    p = AgentSessionParticipant()
    io = FakeLoopIO({"r1": [final_reply()], "r2": [final_reply()]})
    seed_gate = io.gate_seed("r1")
    run1 = start(p, io, "r1")
    await until(lambda: io.seeds == ["r1"])
    await p.close_admission("block")
    report = p.readiness()
    assert report.ready and report.blockers == [] and report.unsaved == ["r1"]  # not started: nothing to wait for
    run2 = start(p, io, "r2")
    await asyncio.sleep(0.02)
    assert io.seeds == ["r1"] and phase(p, "r2") == "admitting"  # waits for reopen before seeding
    seed_gate.set()
    await asyncio.sleep(0.05)
    assert phase(p, "r1") == "seeding" and io.model_bodies == {}  # seeded, but no first turn while closed
    report = p.readiness()
    assert report.ready and report.counts["sessions"] == 1 and report.counts["at_boundary"] == 0  # r1 seeded
    assert report.unsaved == ["r1", "r2"]  # they restart from their prompts after a crash, losing a seed at most
    assert await p.export(None) == [] and await p.capture_records() == []
    with pytest.raises(CheckpointError, match="has not reached its first boundary"):
        await p.export([EpisodeId(rollout_id="r1")])
    await p.open_admission()
    assert (await run1).reward == 1.0 and (await run2).reward == 1.0
    assert io.seeds == ["r1", "r2"]


async def test_export_skips_episodes_it_does_not_host():
    p = AgentSessionParticipant()
    await p.close_admission("block")
    assert await p.export([EpisodeId(rollout_id="elsewhere")]) == []
    assert await p.export(None) == []


async def test_install_continues_from_P1_and_B0_without_seeding():
    script = {"rp": [call_reply("lookup", rid="p1"), final_reply()],
              "rb": [call_reply("lookup", rid="b1"), final_reply()]}
    p = AgentSessionParticipant()
    io = FakeLoopIO(script)
    gate_p = io.gate_model("rp", 1)
    slow = io.gate_tool("lookup")
    runs = {k: start(p, io, k) for k in script}
    # rp waits on its first reply; rb runs its first tool
    await until(lambda: len(io.tool_calls) == 1 and phase(p, "rp") == "awaiting_model")
    await p.close_admission("block")
    gate_p.set()  # rp's reply arrives before ready (rb's tool still runs): rp parks at P1
    await until(lambda: phase(p, "rp") == "parked")
    slow.set()
    await until(lambda: p.readiness().ready)
    records = {r["episode_id"]["rollout_id"]: plain(r) for r in await p.export(None)}
    assert records["rp"]["boundary"] == "P1" and records["rb"]["boundary"] == "P2"
    await p.open_admission()
    await p.retire([EpisodeId(rollout_id=k) for k in script])
    for run in runs.values():
        with pytest.raises(StaleAttemptError):
            await run

    fresh = AgentSessionParticipant()
    io2 = FakeLoopIO({"rp": [final_reply()], "rb": [final_reply()]})  # turns after the boundary
    keys = await fresh.install(list(records.values()))
    assert sorted(keys) == ["rb-a1", "rp-a1"] and fresh.is_restored("rp-a1")
    assert fresh.readiness().counts == {"sessions": 2, "at_boundary": 2, "awaiting_model": 0}
    reply_p = await start(fresh, io2, "rp-a1")
    assert reply_p.restored_from == "P1" and reply_p.rollout_id == "rp-a1"
    assert io2.seeds == []  # never seeded again
    assert io2.tool_calls[0] == ("lookup", {"q": "lookup"}, {"ng_session": "s-rp"})  # pending tool ran first, saved cookie
    assert len(io2.model_bodies["rp-a1"]) == 1  # only the final turn was asked for
    assert [i["type"] for i in reply_p.response["output"]] == ["function_call", "function_call_output", "message"]
    assert reply_p.num_model_calls == 2
    reply_b = await start(fresh, io2, "rb-a1")
    assert reply_b.restored_from == "P2" and reply_b.reward == 1.0
    sent = io2.model_bodies["rb-a1"][0]["input"]
    assert [i.get("type") for i in sent[1:]] == ["function_call", "function_call_output"]
    assert not fresh.is_restored("rb-a1")


def _state(**kw) -> SimpleAgentLoopState:
    return SimpleAgentLoopState(seed_row=ROW, resources_cookies={"ng_session": "s"}, **kw)


async def test_install_is_all_or_nothing_and_validates_records():
    p = AgentSessionParticipant()
    ok = make_record(EpisodeId(rollout_id="r1"), "B0", _state())
    p1_without_calls = make_record(EpisodeId(rollout_id="r2"), "P1", _state(step=1, pending_tools=True))
    with pytest.raises(CheckpointError, match="record 1"):
        await p.install([ok, p1_without_calls])
    assert not p.is_restored("r1-a1")
    mismatch = make_record(EpisodeId(rollout_id="r3"), "P2", _state(step=1, pending_tools=True))
    extra = dict(ok, surprise=1)
    for bad in (mismatch, extra, {"episode_id": {"rollout_id": "x"}}, dict(ok, session_key="run:other")):
        with pytest.raises(CheckpointError):
            await p.install([bad])
    with pytest.raises(CheckpointError, match="two records"):
        await p.install([ok, ok])
    assert await p.install([]) == []
    assert await p.install([ok]) == ["r1-a1"]


async def test_restored_session_is_saved_again_until_its_run_starts():
    p = AgentSessionParticipant()
    state = _state(step=1, new_outputs=[{"type": "function_call", "call_id": "c", "name": "lookup", "arguments": "{}"},
                                        {"type": "function_call_output", "call_id": "c", "output": "ok"}])
    assert await p.install([make_record(EpisodeId(rollout_id="r1"), "P2", state)]) == ["r1-a1"]
    await p.close_admission("block")
    io = FakeLoopIO({"r1": [final_reply()]})
    run = start(p, io, "r1-a1")  # arrives while closed: waits, keeps its restored state
    await until(lambda: phase(p, "r1-a1") == "admitting")
    report = p.readiness()
    assert report.ready and report.counts == {"sessions": 1, "at_boundary": 1, "awaiting_model": 0}
    assert report.unsaved == []  # its restored state is still saved
    [record] = map(plain, await p.export([EpisodeId(rollout_id="r1", attempt=1)]))
    assert record["episode_id"] == {"rollout_id": "r1", "attempt": 1} and record["boundary"] == "P2"
    assert record["state"] == state.model_dump(mode="json")
    await p.open_admission()
    reply = await run
    assert reply.restored_from == "P2" and reply.reward == 1.0 and io.seeds == []
    assert [i["type"] for i in reply.response["output"]] == ["function_call", "function_call_output", "message"]


async def test_retire_cancels_the_run_refuses_the_attempt_and_drops_restored_state():
    p = AgentSessionParticipant()
    io = FakeLoopIO({"r1": [call_reply("lookup"), final_reply()]})
    io.gate_model("r1", 1)
    run = start(p, io, "r1")
    await until(lambda: phase(p, "r1") == "awaiting_model")
    assert await p.retire([EpisodeId(rollout_id="r1")]) == ["r1"]
    with pytest.raises(StaleAttemptError):
        await run
    with pytest.raises(StaleAttemptError):
        await start(p, io, "r1")
    await p.install([make_record(EpisodeId(rollout_id="r2"), "B0", _state())])
    await p.retire([EpisodeId(rollout_id="r2", attempt=1)])
    assert not p.is_restored("r2-a1")
    with pytest.raises(CheckpointError, match="retired"):
        await p.install([make_record(EpisodeId(rollout_id="r2"), "B0", _state())])
    assert p.status_extra() == {"restart_only": False, "replayable": False}


async def test_duplicate_run_is_refused():
    p = AgentSessionParticipant()
    io = FakeLoopIO({"r1": [final_reply()]})
    gate = io.gate_model("r1", 1)
    run = start(p, io, "r1")
    await until(lambda: phase(p, "r1") == "awaiting_model")
    with pytest.raises(RunRequestError) as err:
        await start(p, io, "r1")
    assert err.value.status == 409 and err.value.code == "rollout_in_progress"
    gate.set()
    assert (await run).reward == 1.0


# -- RestartOnlyAgentParticipant ----------------------------------------------


async def _tracked(p: RestartOnlyAgentParticipant, key: str, gate: asyncio.Event) -> asyncio.Task:
    episode = EpisodeId.from_capture_key(key)
    p.admit(episode)

    async def work():
        await gate.wait()
        return key

    task = asyncio.create_task(p.track(episode, work))
    await until(lambda: key in p.tracked)
    return task


async def test_restart_only_block_reports_blockers_and_refuses_new_runs():
    p = RestartOnlyAgentParticipant()
    gate = asyncio.Event()
    run = await _tracked(p, "r1", gate)
    await p.close_admission("block")
    report = p.readiness()
    assert not report.ready and report.blockers == ["r1"] and report.unsaved == []
    with pytest.raises(AdmissionClosedError):
        p.admit(EpisodeId(rollout_id="r2"))
    await p.open_admission()
    gate.set()
    assert await run == "r1"
    assert p.readiness().ready and p.tracked == []


async def test_restart_only_best_effort_is_ready_with_unsaved_and_keeps_running():
    p = RestartOnlyAgentParticipant()
    gate = asyncio.Event()
    run1 = await _tracked(p, "r1", gate)
    await p.close_admission("best_effort")
    report = p.readiness()
    assert report.ready and report.blockers == [] and report.unsaved == ["r1"]
    run2 = await _tracked(p, "r2-a1", gate)  # admitted while closed, tracked as unsaved
    assert p.readiness().unsaved == ["r1", "r2-a1"]
    assert await p.export(None) == []
    gate.set()  # runs go on while closed
    assert await run1 == "r1" and await run2 == "r2-a1"
    assert p.readiness().unsaved == []
    assert p.status_extra() == {"restart_only": True, "replayable": False}


async def test_restart_only_install_and_retire():
    p = RestartOnlyAgentParticipant()
    assert await p.install([]) == []
    with pytest.raises(CheckpointError, match="cannot restore sessions") as err:
        await p.install([make_record(EpisodeId(rollout_id="r1"), "B0", _state())])
    assert err.value.code == "invalid_checkpoint_state"
    run = await _tracked(p, "r1", asyncio.Event())
    assert await p.retire([EpisodeId(rollout_id="r1")]) == ["r1"]
    with pytest.raises(StaleAttemptError):
        await run
    with pytest.raises(StaleAttemptError):
        p.admit(EpisodeId(rollout_id="r1"))
    p.admit(EpisodeId(rollout_id="r1", attempt=1))  # the next attempt is welcome


# -- bookkeeping kept on phase moves (no scan of every session while rollouts are held) --------


def scanned_readiness(p: AgentSessionParticipant) -> tuple[bool, list[str], list[str], dict[str, int]]:
    """What readiness must say, worked out by a scan of every session (the rule docs/design.md §4.5 states)."""
    blockers, unsaved, counts = [], [], {"sessions": 0, "at_boundary": 0, "awaiting_model": 0}
    for key, s in p._sessions.items():
        if s.phase == "admitting":
            if key not in p._restored:
                unsaved.append(key)
            continue
        counts["sessions"] += 1  # started: seeding or past it
        if s.phase == "seeding":  # not started for a checkpoint: only its seed would be lost
            unsaved.append(key)
            continue
        if s.phase == "parked":
            counts["at_boundary"] += 1
        elif s.phase in ("awaiting_model", "holding_reply"):
            counts["awaiting_model"] += 1
        else:
            blockers.append(key)
    counts["sessions"] += len(p._restored)
    counts["at_boundary"] += len(p._restored)
    return not blockers, sorted(blockers), sorted(unsaved), counts


def assert_readiness_matches_a_scan(p: AgentSessionParticipant) -> None:
    """Also: every session at a boundary has its current record kept, or is left for the capture."""
    report = p.readiness()
    assert (report.ready, report.blockers, report.unsaved, report.counts) == scanned_readiness(p)
    assert p.is_ready() is report.ready  # the cheap check the control plane polls agrees
    resting = {s for s in p._sessions.values() if s.phase in ("parked", "awaiting_model", "holding_reply")}
    assert set(p._records) | p._uncaptured == resting and not set(p._records) & p._uncaptured
    assert all(s.captured is not None and s.captured == (s.version, entry) for s, entry in p._records.items())


async def test_readiness_kept_on_phase_moves_matches_a_scan_through_a_checkpoint_cycle():
    keys = ["m1", "m2", "t1", "s1", "f1"]
    script = {k: [call_reply("lookup", rid=f"{k}1"), final_reply(rid=f"{k}2")] for k in keys + ["late"]}
    p = AgentSessionParticipant()
    io = FakeLoopIO(script)
    for k in ("m1", "m2", "f1"):
        io.gate_model(k, 1)  # they wait on the model; t1 runs its tool, s1 seeds
    tool = io.gate_tool("lookup")
    seed = io.gate_seed("s1")
    runs = {k: start(p, io, k) for k in keys}
    await until(lambda: phase(p, "t1") == "running" and len(io.tool_calls) == 1 and phase(p, "s1") == "seeding"
                and all(phase(p, k) == "awaiting_model" for k in ("m1", "m2", "f1")))
    assert_readiness_matches_a_scan(p)
    assert await p.install([make_record(EpisodeId(rollout_id="gone"), "B0", _state())]) == ["gone-a1"]
    await p.close_admission("block")
    late = start(p, io, "late")  # arrives while closed: admitting, unsaved
    await until(lambda: phase(p, "late") == "admitting")
    assert_readiness_matches_a_scan(p)
    assert not p.readiness().ready and p.readiness().blockers == ["t1"]  # a seed in flight does not block
    seed.set()
    tool.set()  # t1's tool returns: it parks at P2; s1, seeded, waits for reopen before its first turn
    await until(lambda: phase(p, "t1") == "parked")
    assert_readiness_matches_a_scan(p)
    report = p.readiness()
    assert report.ready and report.unsaved == ["late", "s1"] and phase(p, "s1") == "seeding"
    captured = {record_key(c) if type(c) is dict else c.key for c in await p.capture_records()}
    assert captured == {"m1", "m2", "t1", "f1", "gone-a1"}  # the restored one as a plain record
    await p.open_admission()
    io.gate_model("f1", 1).set()
    assert (await runs["f1"]).reward == 1.0
    assert_readiness_matches_a_scan(p)
    await p.retire([EpisodeId(rollout_id="m2"), EpisodeId(rollout_id="gone", attempt=1)])
    with pytest.raises(StaleAttemptError):
        await runs["m2"]
    assert_readiness_matches_a_scan(p)
    io.gate_model("m1", 1).set()
    for run in (late, runs["t1"], runs["s1"], runs["m1"]):
        assert (await run).reward == 1.0
    assert p._sessions == {} and all(not s for s in p._by_phase.values()) and not p._uncaptured
    assert_readiness_matches_a_scan(p)


async def test_close_serialises_only_sessions_that_came_to_rest_unserialised():
    """Before the first checkpoint sessions come to rest unserialised: the first close serialises
    those. After it they are serialised as they come to rest, so a later close has nothing left."""
    script = {k: [call_reply("lookup", rid=f"{k}1"), call_reply("lookup", rid=f"{k}2"), final_reply()]
              for k in ("r1", "r2")}
    p = AgentSessionParticipant()
    io = FakeLoopIO(script)
    second = {k: io.gate_model(k, 2) for k in script}
    io.gate_model("r1", 3)
    io.gate_model("r2", 3)
    runs = {k: start(p, io, k) for k in script}
    await until(lambda: all(len(io.model_bodies.get(k, [])) == 2 for k in script))
    assert {s.key for s in p._uncaptured} == {"r1", "r2"} and p._sessions["r1"].captured is None
    await p.close_admission("block")
    assert not p._uncaptured and all(s.captured is not None for s in p._sessions.values())
    await p.open_admission()
    second["r1"].set()  # r1 moves while open and comes to rest again: serialised on the way
    await until(lambda: len(io.model_bodies["r1"]) == 3)
    s1, s2 = p._sessions["r1"], p._sessions["r2"]
    assert not p._uncaptured and s1.captured is not None and s1.captured[0] == s1.version
    kept = s2.captured
    await p.close_admission("block")
    assert s2.captured is kept, "an unmoved session is not serialised again"
    by_key = {c.key: c for c in await p.capture_records()}
    assert by_key["r1"] is s1.captured[1] and by_key["r2"] is kept[1]
    await p.open_admission()
    await p.retire([EpisodeId(rollout_id=k) for k in script])
    for run in runs.values():
        with pytest.raises(StaleAttemptError):
            await run


async def test_capture_refuses_a_session_off_its_boundary_naming_the_first_in_key_order():
    script = {k: [call_reply("lookup", rid=k), final_reply()] for k in ("rb", "ra", "rc")}
    p = AgentSessionParticipant()
    io = FakeLoopIO(script)
    tool = io.gate_tool("lookup")
    io.gate_model("rc", 1)
    runs = {k: start(p, io, k) for k in script}
    await until(lambda: len(io.tool_calls) == 2 and phase(p, "rc") == "awaiting_model")
    await p.close_admission("block")
    with pytest.raises(CheckpointError, match=r"session ra is running, not parked at a boundary"):
        await p.capture_records()
    tool.set()
    await until(lambda: p.readiness().ready)
    assert sorted(c.key for c in await p.capture_records()) == ["ra", "rb", "rc"]
    await p.open_admission()
    io.gate_model("rc", 1).set()
    for run in runs.values():
        assert (await run).reward == 1.0


# -- what ended lately (the caller's drain waits only for those replies) ------


async def test_the_agent_names_the_runs_it_answered_lately_and_not_those_still_running_or_unseen():
    p = AgentSessionParticipant()
    io = FakeLoopIO({"done": [final_reply()], "live": [call_reply("lookup"), final_reply()]})
    gate = io.gate_model("live", 1)
    assert p.ended_runs() == []
    done, live = start(p, io, "done"), start(p, io, "live")
    await done
    await until(lambda: phase(p, "live") == "awaiting_model")
    await p.close_admission("block")
    assert p.readiness().ready and p.readiness().ended is None  # a status report never carries them
    assert p.ended_runs() == ["done"]  # "live" is held (exported); a run never sent is in neither
    gate.set()
    await p.open_admission()
    await live
    assert p.ended_runs() == ["done", "live"]


async def test_a_restart_only_agent_names_its_ended_runs_too():
    p = RestartOnlyAgentParticipant()

    async def work() -> str:
        return "ok"

    assert await p.track(EpisodeId(rollout_id="r1"), work) == "ok"
    assert p.ended_runs() == ["r1"]


def test_ended_runs_are_forgotten_after_the_window_oldest_first():
    now = [0.0]
    ended = EndedRuns(window_s=10.0, clock=lambda: now[0])
    ended.add("a")
    now[0] = 4.0
    ended.add("b")
    now[0] = 5.0
    ended.add("a")  # the same key again: it moves to the end, with its new time
    assert ended.keys() == ["b", "a"]
    now[0] = 14.5
    assert ended.keys() == ["a"]
    now[0] = 100.0
    assert ended.keys() == []


# -- paced turns: a running session's steps go first while closed ----------------


class PacedServer:
    """Stand-in for the agent's ``GymServer``: only its name and its ``TurnPacer``."""

    def __init__(self, per_turn: int):
        self.name = "paced-agent"
        self.pacer = TurnPacer(per_turn=per_turn)


class PacedLoopIO(FakeLoopIO):
    """``FakeLoopIO`` whose tool calls take their share of a turn twice, as ``ServerClient`` does
    (before the send, after the reply). ``log`` records each grant."""

    def __init__(self, script: dict[str, list[dict[str, Any]]], pacer: TurnPacer, log: list[str]):
        super().__init__(script)
        self.pacer, self.log, self.sending = pacer, log, False

    async def call_tool(self, name: str, arguments: dict[str, Any], cookies: dict[str, str]) -> str:
        self.sending = True
        await self.pacer.turn()
        self.log.append("send")
        out = await super().call_tool(name, arguments, cookies)
        await self.pacer.turn()
        self.log.append("reply")
        return out


async def burst_and_one_running_session(close: bool) -> tuple[list[str], int, AgentSessionParticipant]:
    """5,000 paced steps of a burst in line, then a session whose tool call queues behind them;
    ``close`` closes admission once its send waits. Returns the grant log, where the close fell in
    it, and the participant (the session has parked or finished when this returns)."""
    server = PacedServer(per_turn=8)
    p = AgentSessionParticipant(server)
    log: list[str] = []
    io = PacedLoopIO({"rb": [call_reply("lookup", rid="b1"), final_reply()]}, server.pacer, log)

    async def burst_step() -> None:
        await server.pacer.turn()
        log.append("burst")

    burst = [asyncio.create_task(burst_step()) for _ in range(5000)]
    run = start(p, io, "rb")
    for _ in range(50):  # one turn each
        if io.sending:
            break
        await asyncio.sleep(0)
    assert io.sending and server.pacer.waiting > 4000
    closed_at = len(log)
    if close:
        await p.close_admission("best_effort")
        await until(lambda: phase(p, "rb") == "parked")
    await asyncio.gather(*burst)
    if close:
        await p.open_admission()
    assert (await run).reward == 1.0
    return log, closed_at, p


async def test_while_closed_a_running_sessions_steps_go_before_the_burst():
    log, closed_at, p = await burst_and_one_running_session(close=True)
    after_close = log[closed_at:]
    # Its queued send is promoted at the close; its reply, queued while closed, goes first too.
    assert after_close.index("reply") < 3 * p.pacer.per_turn, after_close[:40]


async def test_while_open_a_running_sessions_steps_wait_their_turn():
    log, closed_at, _ = await burst_and_one_running_session(close=False)
    assert log.index("send") > 4000  # behind the burst that was in line first
