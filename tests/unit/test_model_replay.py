"""The model participant's recorded calls and their replay (``gym_patches.checkpoint.replay``): recorded
as each call is delivered, captured incrementally, installed for replay, answered from the record while
the requests match, live from the first one that differs (the divergence named) and after the last.

The calls here go through the participant the way the model server drives them (``Driver``); the server
itself, its HTTP and a real agent are in tests/functional/test_replay.py.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gym_patches.checkpoint.agent import AgentSessionParticipant, RestartOnlyAgentParticipant
from gym_patches.checkpoint.calls import RestoreCall
from gym_patches.checkpoint.cuts import GenerationCut
from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.model import PolicyModelParticipant
from gym_patches.checkpoint.records import decode_record, encode_record
from gym_patches.checkpoint.replay import REPLAY_FIELD, RecordedCall, annotated, locate_divergence, request_digest
from gym_patches.checkpoint.wire import RestoreRequest
from gym_patches.responses_api_agents.loop import SimpleAgentLoopState, model_request

SYSTEM = {"role": "system", "content": "Use the tools."}
USER = {"role": "user", "content": "Book a meeting with Ana."}
TOOLS = [{"type": "function", "name": "find", "parameters": {"type": "object", "properties": {}}}]


def reply_of(n: int) -> dict[str, Any]:
    """A Responses reply as the model server writes it: a tool call for n < 2, else the final text."""
    last = ({"id": f"fc_{n}", "type": "function_call", "call_id": f"call_{n}", "name": "find", "arguments": "{}",
             "status": "completed"} if n < 2 else
            {"id": f"msg_{n}", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Done.", "annotations": []}]})
    return {"id": f"resp_{n}", "object": "response", "created_at": 1, "status": "completed", "model": "policy",
            "output": [{**last, "prompt_token_ids": [n, n], "generation_token_ids": [10 + n, 20 + n],
                        "generation_log_probs": [-0.5, -0.25], "weight_version": 3}]}


def body_of(n: int, outputs: list[str] | None = None) -> dict[str, Any]:
    """The agent's request for call n: the prompt, then each earlier reply's item and its tool's output."""
    items: list[Any] = [SYSTEM, USER]
    for i in range(n):
        item = {k: v for k, v in reply_of(i)["output"][-1].items()
                if k not in ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "weight_version")}
        items.append(item)
        items.append({"type": "function_call_output", "call_id": f"call_{i}",
                      "output": (outputs or [])[i] if outputs and i < len(outputs) else f"out {i}"})
    return {"input": items, "tools": TOOLS, "temperature": 1.0}


class Driver:
    """Drives calls through the gate as the model server does; counts the backend calls it makes."""

    def __init__(self, model: PolicyModelParticipant):
        self.model = model
        self.backend_calls: list[tuple[str, int]] = []

    async def call(self, key: str, body: dict[str, Any], n: int) -> dict[str, Any]:
        async with self.model.call(key) as ticket:
            plan = self.model.plan_call(ticket, body)
            if plan.recorded is not None:
                out, raw = plan.reply_for_agent(), None
            else:
                self.backend_calls.append((key, n))
                live = reply_of(n)
                raw = json.dumps(live).encode()
                note = plan.live_note()
                out = live if note is None else annotated(live, note)
            await self.model.release_response(ticket)
            self.model.delivered(ticket, raw)
            return out


def recording_model() -> PolicyModelParticipant:
    model = PolicyModelParticipant()
    model.record_calls = True
    return model


def from_disk(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as a restore reads them: each line encoded by the store, then parsed."""
    return [decode_record(encode_record(r)) for r in records]


async def first_attempt(calls: int, key: str = "r1") -> tuple[PolicyModelParticipant, list[dict[str, Any]]]:
    """A recording model that delivered ``calls`` calls of ``key``; its records as written to disk."""
    model = recording_model()
    driver = Driver(model)
    for n in range(calls):
        await driver.call(key, body_of(n), n)
    return model, from_disk(await model.export([EpisodeId.from_capture_key(key)]))


# -- recording ---------------------------------------------------------------------------------
async def test_without_record_calls_a_record_is_as_before_and_no_digest_is_taken():
    model = PolicyModelParticipant()
    driver = Driver(model)
    async with model.call("r1") as ticket:
        plan = model.plan_call(ticket, body_of(0))
        assert plan.digest is None and plan.recorded is None
    await driver.call("r1", body_of(0), 0)
    [record] = await model.export(None)
    assert set(record) == {"episode_id", "delivered_calls"} and record["delivered_calls"] == 1
    assert model.status_extra()["replay"]["recording"] is False


async def test_each_delivered_call_is_recorded_with_its_digests_and_reply_as_returned():
    model, [record] = await first_attempt(3)
    assert record["delivered_calls"] == 3 and len(record["calls"]) == 3
    for n, call in enumerate(record["calls"]):
        RecordedCall.model_validate(call)
        assert call["reply"] == reply_of(n)  # token ids, logprobs, weight_version: as the agent got them
        digest = request_digest(body_of(n))
        assert call["request_digest"] == digest.request and call["item_digests"] == digest.items
    assert len(record["calls"][2]["item_digests"]) == 6  # prompt (2) + two turns of (call, output)


async def test_a_capture_reuses_each_call_as_serialised_at_delivery_and_remakes_only_what_moved():
    model = recording_model()
    driver = Driver(model)
    for n in range(2):
        await driver.call("r1", body_of(n), n)
    await driver.call("r2", body_of(0), 0)
    first = {c.key: c for c in await model.capture_records()}
    await driver.call("r1", body_of(2), 2)
    second = {c.key: c for c in await model.capture_records()}
    assert second["r2"] is first["r2"]  # no call finished: the same captured record
    old, new = first["r1"].record["calls"], second["r1"].record["calls"]
    assert len(old) == 2 and len(new) == 3
    assert all(a is b for a, b in zip(old, new))  # earlier calls: the same bytes, not serialised again
    assert second["r1"].record["delivered_calls"] == 3
    assert second["r1"].size > first["r1"].size > len(old[0]) + len(old[1])


# -- replay -------------------------------------------------------------------------------------
async def test_a_replayed_episode_is_answered_from_its_record_while_the_requests_match_then_live():
    _, records = await first_attempt(2)
    model = PolicyModelParticipant()  # a fresh server; a replay needs no record_calls
    assert await model.install(records, replay={"r1"}) == ["r1-a1"]
    assert model.replay_stats().queued_calls == 2 and model.replay_stats().episodes_replayed == 1
    driver = Driver(model)
    got = [await driver.call("r1-a1", body_of(n), n) for n in range(3)]
    assert driver.backend_calls == [("r1-a1", 2)]  # only the call after the last recorded one
    for n in range(2):
        item = got[n]["output"][-1]
        assert item.pop(REPLAY_FIELD) == {"replayed": True, "call": n}
        assert got[n] == reply_of(n)  # the recorded reply, same token ids, logprobs and weight version
    assert got[2]["output"][-1].pop(REPLAY_FIELD) == {"replayed": False, "call": 2}  # where live took over
    assert got[2] == reply_of(2)
    assert REPLAY_FIELD not in (await driver.call("r1-a1", body_of(3), 3))["output"][-1]  # only the first live one
    stats = model.replay_stats()
    assert (stats.calls_replayed, stats.divergences, stats.calls_live_after_divergence, stats.queued_calls) == \
        (2, 0, 0, 0)


async def test_an_episode_replayed_with_no_recorded_call_says_so_on_its_first_delivered_call():
    _, records = await first_attempt(0)
    model = recording_model()
    await model.install(records, replay={"r1"})
    driver = Driver(model)
    async with model.call("r1-a1") as ticket:  # a call planned but never delivered (its backend failed)
        assert model.plan_call(ticket, body_of(0)).first_live
    first = await driver.call("r1-a1", body_of(0), 0)
    assert first["output"][-1][REPLAY_FIELD] == {"replayed": False, "call": 0}
    assert REPLAY_FIELD not in (await driver.call("r1-a1", body_of(1), 1))["output"][-1]
    assert model.replay_stats().episodes_replayed == 1 and model.replay_stats().calls_replayed == 0


async def test_an_agent_that_sends_a_replayed_item_back_with_its_annotation_still_matches():
    _, records = await first_attempt(2)
    model = PolicyModelParticipant()
    await model.install(records, replay={"r1"})
    driver = Driver(model)
    first = await driver.call("r1-a1", body_of(0), 0)
    body = body_of(1)
    body["input"][2] = {**body["input"][2], REPLAY_FIELD: first["output"][-1][REPLAY_FIELD]}
    await driver.call("r1-a1", body, 1)
    assert driver.backend_calls == [] and model.replay_stats().calls_replayed == 2


async def test_the_first_request_that_differs_ends_the_replay_and_names_the_call_item_and_tool():
    _, records = await first_attempt(3)
    model = recording_model()
    await model.install(records, replay={"r1"})
    driver = Driver(model)
    await driver.call("r1-a1", body_of(0), 0)
    await driver.call("r1-a1", body_of(1), 1)
    changed = ["out 0", "a different output"]  # the tool gave call 1's output differently this time
    diverged = await driver.call("r1-a1", body_of(2, changed), 2)
    assert driver.backend_calls == [("r1-a1", 2)]
    note = diverged["output"][-1][REPLAY_FIELD]
    assert note["replayed"] is False and note["call"] == 2
    assert note["divergence"] == {"call": 2, "item": 5, "kind": "tool_output", "item_type": "function_call_output",
                                  "tool": "find"}
    stats = model.replay_stats()
    assert (stats.calls_replayed, stats.divergences, stats.calls_live_after_divergence, stats.queued_calls) == \
        (2, 1, 1, 0)
    [record] = from_disk(await model.export([EpisodeId.from_capture_key("r1-a1")]))
    assert record["delivered_calls"] == 3
    assert [c["request_digest"] for c in record["calls"]] == [
        request_digest(body_of(0)).request, request_digest(body_of(1)).request,
        request_digest(body_of(2, changed)).request]  # the recorded third call belongs to the old trajectory
    [report] = model.calls.report().divergences
    assert (report.capture_key, report.call, report.tool) == ("r1-a1", 2, "find")


async def test_a_second_crash_replays_everything_again_also_mid_replay():
    _, records = await first_attempt(3)
    model = recording_model()
    await model.install(records, replay={"r1"})
    new = EpisodeId.from_capture_key("r1-a1")
    [before] = from_disk(await model.export([new]))
    assert before["delivered_calls"] == 0 and len(before["calls"]) == 3  # its queue is its record
    await Driver(model).call("r1-a1", body_of(0), 0)
    captured = {c.key: c for c in await model.capture_records()}
    [mid] = from_disk([captured["r1-a1"].record])
    assert mid["delivered_calls"] == 1 and mid["calls"] == records[0]["calls"]
    again = PolicyModelParticipant()
    await again.install([mid], replay={"r1-a1"})
    driver = Driver(again)
    for n in range(4):
        await driver.call("r1-a2", body_of(n), n)
    assert driver.backend_calls == [("r1-a2", 3)] and again.replay_stats().calls_replayed == 3


async def test_a_cut_of_the_call_after_the_recorded_ones_continues_that_call_after_the_replay():
    _, [record] = await first_attempt(2)
    cut = GenerationCut.build("r1.c", "a" * 64, [4, 5], [-1.0, -2.0], 1)
    record = {**record, "cut": cut.model_dump(), "cut_tokens": 2}
    model = PolicyModelParticipant()
    await model.install([record, {**copy.deepcopy(record), "episode_id": {"rollout_id": "r2", "attempt": 0}}],
                        replay={"r1", "r2"})
    driver = Driver(model)
    for n in range(2):
        await driver.call("r1-a1", body_of(n), n)
    assert model.take_restored_cut(EpisodeId.from_capture_key("r1-a1")) == cut  # call 2, the one cut
    await driver.call("r2-a1", body_of(0), 0)
    await driver.call("r2-a1", body_of(1, ["changed"]), 1)  # diverged before the cut call
    await driver.call("r2-a1", body_of(2, ["changed"]), 2)
    assert model.take_restored_cut(EpisodeId.from_capture_key("r2-a1")) is None


async def test_a_restore_at_its_turn_keeps_the_delivered_calls_and_queues_nothing():
    _, records = await first_attempt(2)
    model = recording_model()
    await model.install(records)  # no replay: the agent continues after its 2 delivered calls
    driver = Driver(model)
    await driver.call("r1-a1", body_of(2), 2)
    assert driver.backend_calls == [("r1-a1", 2)] and model.replay_stats().episodes_replayed == 0
    [record] = from_disk(await model.export([EpisodeId.from_capture_key("r1-a1")]))
    assert record["delivered_calls"] == 3 and len(record["calls"]) == 3
    assert record["calls"][:2] == records[0]["calls"]


async def test_forget_and_retire_drop_queues_and_recorded_calls():
    _, records = await first_attempt(2)
    model = recording_model()
    await model.install(records + [{**copy.deepcopy(records[0]), "episode_id": {"rollout_id": "r2", "attempt": 0}}],
                        replay={"r1", "r2"})
    assert model.replay_stats().queued_calls == 4
    assert model.forget({"r1"}) >= 2
    assert model.replay_stats().queued_calls == 2 and not model.calls.has_calls(EpisodeId.from_capture_key("r1-a1"))
    await model.retire([EpisodeId.from_capture_key("r2-a1")])
    assert model.replay_stats().queued_calls == 0 and list(model.calls.episodes()) == []


async def test_a_replay_of_an_episode_with_no_recorded_call_is_live_from_its_first_call():
    model = PolicyModelParticipant()
    await model.install([{"episode_id": {"rollout_id": "r1", "attempt": 0}, "delivered_calls": 0}], replay={"r1"})
    driver = Driver(model)
    await driver.call("r1-a1", body_of(0), 0)
    assert driver.backend_calls == [("r1-a1", 0)] and model.replay_stats().episodes_replayed == 1


async def test_a_replay_is_refused_where_it_does_not_belong():
    model = PolicyModelParticipant()
    with pytest.raises(CheckpointError, match="no record of.*'r9'"):
        await model.install([{"episode_id": {"rollout_id": "r1", "attempt": 0}, "delivered_calls": 0}],
                            replay={"r9"})
    for agent in (AgentSessionParticipant(), RestartOnlyAgentParticipant()):
        with pytest.raises(CheckpointError, match="restored by replay: only the model server"):
            await agent.install([], replay={"r1"})
    _, [record] = await first_attempt(1)
    record["calls"][0]["reply"] = {"id": "x"}
    with pytest.raises(CheckpointError, match=r"model record 0 is invalid: calls\.0\.reply"):
        await PolicyModelParticipant().install([record], replay={"r1"})


# -- digests and divergences ----------------------------------------------------------------------
def test_the_request_digest_covers_every_setting_and_item_and_not_the_replay_note():
    base = request_digest(body_of(1))
    assert request_digest(copy.deepcopy(body_of(1))) == base
    for change in ({"temperature": 0.5}, {"tools": []}, {"max_output_tokens": 9}, {"instructions": "x"}):
        assert request_digest({**body_of(1), **change}).request != base.request, change
    noted = body_of(1)
    noted["input"][2] = {**noted["input"][2], REPLAY_FIELD: {"replayed": True, "call": 0}}
    assert request_digest(noted) == base
    assert request_digest({"input": "hi"}).items == request_digest({"input": ["hi"]}).items


@pytest.mark.parametrize("body, kind, item", [
    ({**body_of(1), "temperature": 0.2}, "settings", None),
    ({**body_of(1), "input": body_of(1)["input"][:3]}, "fewer_items", 3),
    ({**body_of(1), "input": [SYSTEM, {"role": "user", "content": "other"}] + body_of(1)["input"][2:]},
     "agent_item", 1),
    ({**body_of(1), "input": body_of(1)["input"][:2] + [{**body_of(1)["input"][2], "arguments": "{\"a\":1}"}]
      + body_of(1)["input"][3:]}, "model_output", 2),
])
def test_each_divergence_kind_is_named(body, kind, item):
    recorded = RecordedCall(request_digest=request_digest(body_of(1)).request,
                            item_digests=request_digest(body_of(1)).items, reply=reply_of(1))
    found = locate_divergence(1, body, request_digest(body), recorded)
    assert (found.kind, found.item, found.call) == (kind, item, 1)


def test_a_restore_call_gives_each_server_the_replayed_episodes_of_its_own_scope():
    r1, r2 = EpisodeId(rollout_id="r1"), EpisodeId(rollout_id="r2")
    call = RestoreCall(checkpoint_id="c1", deadline_ts=2e9, checkpoint_dir="/x", source_checkpoint_id="c0",
                       episode_ids={"model": [r1, r2], "agent": [r2]}, replay_episode_ids=[r1])
    assert call.body_for("model").replay_episode_ids == [r1]
    assert call.body_for("agent").replay_episode_ids == [] and call.body_for("tools").episode_ids == []
    with pytest.raises(ValueError, match="replay_episode_ids names episodes outside episode_ids.*r3"):
        RestoreRequest(checkpoint_id="c1", deadline_ts=2e9, checkpoint_dir="/x", source_checkpoint_id="c0",
                       episode_ids=[r1], replay_episode_ids=[EpisodeId(rollout_id="r3")])


def test_the_agent_never_sends_the_replay_note_back_to_the_model():
    state = SimpleAgentLoopState(seed_row={"responses_create_params": {"input": [USER]}})
    state.new_outputs.append({**reply_of(0)["output"][-1], REPLAY_FIELD: {"replayed": True, "call": 0}})
    sent = model_request(state)["input"][-1]
    assert REPLAY_FIELD not in sent and "generation_token_ids" not in sent
