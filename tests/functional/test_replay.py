"""Replay on real Gym servers: rollouts on restart-only servers declared replayable come back after a crash
with fresh sessions while the model server answers their finished calls from its record.

Real processes only: the scripted chat-completions backend (a named fake, not a policy) and two Gym
deployments on 127.0.0.1 (policy model with ``record_calls``, Workplace and python_sandbox declared
replayable, a restart-only ``plain_loop_agent`` and two ``simple_agent``), driven over HTTP with
``gym_patches.checkpoint.coordination`` and, where the model server is called directly, the ``openai``
client. The first deployment runs rollouts to a held turn, takes a staged capture and persist, and is
SIGKILLed; the second restores only the model records of the replayed rollouts (the rollout saved at its
turn also on its agent and Workplace) and runs ``/run`` again under attempt 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import aiohttp
import pytest

from gym_patches.checkpoint import coordination as co
from gym_patches.checkpoint.calls import PersistCall, PrepareCall, RestoreCall, ResumeCall
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.store import read_participant_state
from gym_patches.fakes.scripted_backend import ScriptedBackend, first_user_text
from gym_patches.launch import GymDeployment
from gym_patches.server_utils import ServerClient
from gym_patches.wire_models import REPLAY_STATS_ROUTE

openai = pytest.importorskip("openai")
from openai.types.responses import Response  # noqa: E402

pytestmark = [pytest.mark.functional, pytest.mark.timeout(120)]

TOKEN = "replay-test-token"
DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
MODEL, WORKPLACE, SANDBOX = "policy_model", "workplace", "python_sandbox"
PLAIN, SIMPLE, SANDBOX_AGENT = "plain", "simple", "sandbox_simple"
TOKEN_KEYS = ("generation_token_ids", "generation_log_probs", "prompt_token_ids", "weight_version")


def _rows(name: str) -> list[dict[str, Any]]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def _pick(rows: list[dict[str, Any]], tools: tuple[str, ...], taken: set[str]) -> dict[str, Any]:
    """A row with this tool sequence whose user text no other row (or pick) has: a backend hold on
    (user text, turn) then catches exactly one rollout."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[first_user_text(row)] = counts.get(first_user_text(row), 0) + 1
    for row in rows:
        user = first_user_text(row)
        if tuple(g["name"] for g in row["ground_truth"]) == tools and counts[user] == 1 and user not in taken:
            taken.add(user)
            return row
    raise LookupError(f"no row with tools {tools}")


_TAKEN: set[str] = set()
PLAIN_ROW = _pick(_rows("workplace_train.jsonl"), ("directory_find_email", "calendar_create_event"), _TAKEN)
SAVED_ROW = _pick(_rows("workplace_train.jsonl"), ("directory_find_email", "email_send"), _TAKEN)
DIRECT_ROW = _pick(_rows("workplace_train.jsonl"), ("directory_find_email", "tasks_create"), _TAKEN)
SANDBOX_ROW = _pick(_rows("sandbox_train.jsonl"), ("python_exec", "python_exec"), _TAKEN)
# A tool made non-deterministic on purpose: call 1's cell prints an id no fresh interpreter prints again.
NONDET_ROW = {
    **SANDBOX_ROW, "id": "replay-nondet",
    "responses_create_params": {**SANDBOX_ROW["responses_create_params"], "input": [
        SANDBOX_ROW["responses_create_params"]["input"][0],
        {"role": "user", "content": "Print n, then a fresh id, then set answer to n plus 8."}]},
    "seed": {"setup": "n = 5"}, "expected_answer": "13", "final_answer": "Done.",
    "ground_truth": [{"name": "python_exec", "arguments": {"code": "print(n)"}},
                     {"name": "python_exec", "arguments": {"code": "import uuid; print(uuid.uuid4().hex)"}},
                     {"name": "python_exec", "arguments": {"code": "answer = n + 8"}}],
}
# rollout -> (agent, row, the turn its rollout is held at when the snapshot is taken)
ROLLOUTS = {"plain-0": (PLAIN, PLAIN_ROW, 2), "sandbox-0": (SANDBOX_AGENT, SANDBOX_ROW, 2),
            "nondet-0": (SANDBOX_AGENT, NONDET_ROW, 3), "saved-0": (SIMPLE, SAVED_ROW, 2)}
REPLAYED = ("plain-0", "sandbox-0", "nondet-0")  # on a replayable restart-only server
RESTART_ONLY = (PLAIN, SANDBOX)


def _refs(resources: str) -> dict[str, Any]:
    return {"model_server": {"type": "responses_api_models", "name": MODEL},
            "resources_server": {"type": "resources_servers", "name": resources}, "replayable": True}


def config(base_url: str) -> dict[str, Any]:
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 60},
        "policy_base_url": base_url,
        MODEL: {"responses_api_models": {"vllm_model": {"request_timeout_s": 30, "record_calls": True}}},
        WORKPLACE: {"resources_servers": {"workplace_assistant": {"replayable": True}}},
        SANDBOX: {"resources_servers": {"python_sandbox": {"replayable": True}}},
        PLAIN: {"responses_api_agents": {"plain_loop_agent": _refs(WORKPLACE)}},
        SIMPLE: {"responses_api_agents": {"simple_agent": _refs(WORKPLACE)}},
        SANDBOX_AGENT: {"responses_api_agents": {"simple_agent": _refs(SANDBOX)}},
    }


@pytest.fixture(scope="module")
def backend() -> Iterator[ScriptedBackend]:
    with ScriptedBackend().start() as b:
        b.plans_from_rows([row for _, row, _ in ROLLOUTS.values()] + [DIRECT_ROW])
        b.configure(respect_max_tokens=False)  # fake tokens are bytes: rows' max_output_tokens would cut tool calls
        yield b


@contextlib.asynccontextmanager
async def deployment(backend: ScriptedBackend, logs: Path) -> AsyncIterator[tuple[GymDeployment, co.Participants,
                                                                                  aiohttp.ClientSession]]:
    with GymDeployment.start(config(backend.base_url), log_dir=logs) as dep:
        client = await ServerClient.load_from_global_config(dep.head_url)
        try:
            parts = await co.discover(client, TOKEN, timeout_s=10)
            async with aiohttp.ClientSession() as http:
                yield dep, parts, http
        finally:
            await client.close()


async def run(http: aiohttp.ClientSession, dep: GymDeployment, agent: str, row: dict[str, Any],
              key: str) -> tuple[int, Any]:
    async with http.post(dep.url(agent) + "/run", json={**row, "_ng_rollout_id": key}) as resp:
        return resp.status, await resp.json()


def direct_calls(base_url: str, key: str, backend_turns: int = 2) -> list[dict[str, Any]]:
    """Two calls of one episode straight to the model server with the ``openai`` client (each reply checked
    strictly with its ``Response`` type); the raw replies."""
    client = openai.OpenAI(base_url=f"{base_url}/ng-rollout/{key}/v1", api_key="unused", max_retries=0)
    params = DIRECT_ROW["responses_create_params"]
    items: list[Any] = list(params["input"])
    replies = []
    try:
        for _ in range(backend_turns):
            raw = client.responses.with_raw_response.create(
                model="policy", input=items, tools=params["tools"], temperature=params["temperature"])
            body = json.loads(raw.http_response.text)
            Response.model_validate(body)
            replies.append(body)
            call = body["output"][-1]
            items += [{k: v for k, v in call.items() if k not in TOKEN_KEYS + ("replay",)},
                      {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    finally:
        client.close()
    return replies


def token_items(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a /run reply that carry a model call's tokens, in call order."""
    return [i for i in reply["response"]["output"] if "generation_token_ids" in i]


def backend_turns(backend: ScriptedBackend, row: dict[str, Any], since: int) -> list[int]:
    return [c["turn"] for c in backend.calls(first_user_text(row))[since:]]


async def crash_after_a_staged_snapshot(backend: ScriptedBackend, tmp_path: Path, ckpt: Path) -> dict[str, Any]:
    """The first deployment: every rollout held at its turn, a staged capture + persist through the control
    routes, then SIGKILL of every server. What it saved, as the files hold it."""
    async with deployment(backend, tmp_path / "logs-1") as (dep, parts, http):
        for key, (agent, row, turn) in ROLLOUTS.items():
            backend.hold(first_user_text(row), turn)
        runs = [asyncio.create_task(run(http, dep, agent, row, key)) for key, (agent, row, _) in ROLLOUTS.items()]
        for key, (_, row, turn) in ROLLOUTS.items():
            await asyncio.to_thread(backend.wait_for_held, first_user_text(row), turn)
        direct = await asyncio.to_thread(direct_calls, dep.url(MODEL), "direct-0")

        prepared = await co.call(parts, PrepareCall(
            checkpoint_id="snap-1", deadline_ts=time.time() + 15, capture=True,
            policy_overrides={server: "best_effort" for server in RESTART_ONLY}))
        assert prepared.prepared, prepared
        assert prepared.unsaved == {PLAIN: ["plain-0"], SANDBOX: ["nondet-0", "sandbox-0"]}
        assert prepared.captured_keys("model") == set(ROLLOUTS) | {"direct-0"}
        await co.call(parts, ResumeCall(checkpoint_id="snap-1", deadline_ts=time.time() + 15))
        ep = EpisodeId.from_capture_key
        scopes = {MODEL: [ep(k) for k in (*ROLLOUTS, "direct-0")], SIMPLE: [ep("saved-0")],
                  WORKPLACE: [ep("saved-0")],
                  SANDBOX_AGENT: [ep("sandbox-0"), ep("nondet-0")]}  # only as evidence of what it got
        persisted = await co.call(parts, PersistCall(checkpoint_id="snap-1", deadline_ts=time.time() + 15,
                                                     checkpoint_dir=str(ckpt), episode_ids=scopes))
        assert sorted(persisted[MODEL].episode_ids) == sorted([*ROLLOUTS, "direct-0"])
        for server in dep.servers:  # the crash
            dep.kill_server(server.name)
        await asyncio.gather(*runs, return_exceptions=True)
    for _, row, turn in ROLLOUTS.values():
        backend.release(first_user_text(row), turn)
    _, models = read_participant_state(ckpt, "model", MODEL, "snap-1")
    _, agents = read_participant_state(ckpt, "agent", SANDBOX_AGENT, "snap-1")
    return {"model": {r["episode_id"]["rollout_id"]: r for r in models},
            "agent": {r["episode_id"]["rollout_id"]: r for r in agents}, "direct": direct}


async def test_rollouts_on_replayable_servers_come_back_by_replay_and_a_nondeterministic_tool_diverges(
    backend: ScriptedBackend, tmp_path: Path
):
    ckpt = tmp_path / "ckpt"
    saved = await crash_after_a_staged_snapshot(backend, tmp_path, ckpt)
    model_records = saved["model"]
    assert {k: (r["delivered_calls"], len(r["calls"])) for k, r in model_records.items()} == {
        "plain-0": (2, 2), "sandbox-0": (2, 2), "nondet-0": (3, 3), "saved-0": (2, 2), "direct-0": (2, 2)}
    seen = {row_key: len(backend.calls(first_user_text(row))) for row_key, (_, row, _) in ROLLOUTS.items()}
    direct_seen = len(backend.calls(first_user_text(DIRECT_ROW)))

    async with deployment(backend, tmp_path / "logs-2") as (dep, parts, http):
        statuses = {name: (await co.call(parts, co.ProbeCall(timeout_s=5)))[name] for name in parts.names}
        extra = {name: s.model_extra for name, s in statuses.items()}
        assert (extra[PLAIN]["restart_only"], extra[PLAIN]["replayable"]) == (True, True)
        assert (extra[SANDBOX]["mode"], extra[SANDBOX]["replayable"]) == ("replayed", True)
        assert (extra[WORKPLACE]["mode"], extra[WORKPLACE]["replayable"]) == ("exported", True)
        assert dep.server(SANDBOX).checkpoint_mode == "replayed" and dep.server(PLAIN).checkpoint_mode == "replayed"
        assert extra[MODEL]["replay"]["recording"] is True

        ep = EpisodeId.from_capture_key
        restored = await co.call(parts, RestoreCall(
            checkpoint_id="restore-1", deadline_ts=time.time() + 15, checkpoint_dir=str(ckpt),
            source_checkpoint_id="snap-1",
            episode_ids={MODEL: [ep(k) for k in (*ROLLOUTS, "direct-0")], SIMPLE: [ep("saved-0")],
                         WORKPLACE: [ep("saved-0")]},
            replay_episode_ids=[ep(k) for k in (*REPLAYED, "direct-0")]))
        assert sorted(restored[MODEL].restored) == sorted(f"{k}-a1" for k in (*ROLLOUTS, "direct-0"))
        assert restored[PLAIN].restored == [] and restored[SANDBOX].restored == []
        await co.call(parts, ResumeCall(checkpoint_id="restore-1", deadline_ts=time.time() + 15))

        # the model server called directly, as the openai client sees it: both calls replayed
        again = await asyncio.to_thread(direct_calls, dep.url(MODEL), "direct-0-a1")
        assert len(backend.calls(first_user_text(DIRECT_ROW))) == direct_seen
        for n, (first, second) in enumerate(zip(saved["direct"], again)):
            assert second["output"][-1].pop("replay") == {"replayed": True, "call": n}
            assert second == first

        replies = dict(zip(ROLLOUTS, await asyncio.gather(*(
            run(http, dep, agent, row, f"{key}-a1") for key, (agent, row, _) in ROLLOUTS.items()))))
        async with http.get(dep.url(MODEL) + REPLAY_STATS_ROUTE) as resp:
            report = await resp.json()

    for key, (status, reply) in replies.items():
        assert status == 200, (key, reply)
        assert reply["reward"] == 1.0, (key, reply)  # the tools rebuilt the state nobody saved
    assert replies["saved-0"][1]["restored_from"] == "B0"
    assert all(replies[k][1]["restored_from"] is None for k in REPLAYED)  # started from the prompt

    # Only the calls not finished before the crash reached the backend again.
    assert {key: backend_turns(backend, row, seen[key]) for key, (_, row, _) in ROLLOUTS.items()} == {
        "plain-0": [2], "sandbox-0": [2], "nondet-0": [2, 3], "saved-0": [2]}

    notes = {key: [i.get("replay") for i in token_items(reply)] for key, (_, reply) in replies.items()}
    divergence = {"call": 2, "item": 5, "kind": "tool_output", "item_type": "function_call_output",
                  "tool": "python_exec"}
    assert notes == {
        "plain-0": [{"replayed": True, "call": 0}, {"replayed": True, "call": 1}, {"replayed": False, "call": 2}],
        "sandbox-0": [{"replayed": True, "call": 0}, {"replayed": True, "call": 1}, {"replayed": False, "call": 2}],
        "nondet-0": [{"replayed": True, "call": 0}, {"replayed": True, "call": 1},
                     {"replayed": False, "call": 2, "divergence": divergence}, None],
        "saved-0": [None, None, None],
    }
    # Replayed replies are the first attempt's: its ids, token ids and logprobs (as the agent that got them
    # saved them, and as the model recorded them).
    for key in REPLAYED:
        got = token_items(replies[key][1])
        for n, call in enumerate(model_records[key]["calls"][:2]):
            first = call["reply"]["output"][-1]
            assert {k: got[n][k] for k in ("id", *TOKEN_KEYS)} == {k: first[k] for k in ("id", *TOKEN_KEYS)}
        if key in saved["agent"]:
            received = [i for i in saved["agent"][key]["state"]["new_outputs"] if "generation_token_ids" in i]
            assert [(i["id"], i["generation_token_ids"]) for i in received[:2]] == \
                [(i["id"], i["generation_token_ids"]) for i in got[:2]]

    stats = report["stats"]
    assert (stats["episodes_replayed"], stats["calls_replayed"], stats["divergences"],
            stats["calls_live_after_divergence"], stats["queued_calls"]) == (4, 8, 1, 2, 0)
    assert report["divergences"] == [{"capture_key": "nondet-0-a1", **divergence}]
