"""Gym servers that hang (SIGSTOP) are detected and named, with real processes.

A deployment of the policy model (in front of the scripted backend), the
Workplace resources server and both agents, each agent with 2 s call timeouts.
A stopped resources or model server: the activity route shows the run waiting
on it with a growing ``since_s``, ``/run`` answers 504 ``upstream_timeout``
naming it about 2 s after the call began, and after SIGCONT the deployment
works again. A stopped agent: ``fetch_activity`` says it gave no reply within
its timeout, while the other agent answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest

from gym_patches.activity import fetch_activity, summary_lines
from gym_patches.config import parse_gym_config
from gym_patches.launch import GymDeployment
from gym_patches.server_utils import ServerClient
from gym_patches.fakes.scripted_backend import ScriptedBackend, first_user_text
from gym_patches.utils.processes import free_port, process_state
from gym_patches.wire_models import ACTIVITY_ROUTE, AgentActivity, RunActivity, RunErrorBody

pytestmark = [pytest.mark.functional, pytest.mark.timeout(90)]

TOKEN = "stalls-test-token"
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "workplace_train.jsonl"
CALL_TIMEOUT_S = 2.0
AGENTS = ("simple", "plain")


def _rows() -> list[dict[str, Any]]:
    """Workplace rows with distinct user texts (the backend's plan key); max_output_tokens raised
    because the scripted backend counts reply bytes as tokens."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line]
    users = [first_user_text(r) for r in rows]
    out = [r for r, u in zip(rows, users) if users.count(u) == 1 and r.get("ground_truth")]
    for r in out:
        r["responses_create_params"]["max_output_tokens"] = 1024
    return out


ROWS = _rows()


def gym_config(base_url: str) -> dict[str, Any]:
    refs = {"model_server": {"type": "responses_api_models", "name": "policy_model"},
            "resources_server": {"type": "resources_servers", "name": "workplace"},
            "model_call_timeout_s": CALL_TIMEOUT_S, "resources_call_timeout_s": CALL_TIMEOUT_S}
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 60},
        "policy_base_url": base_url,
        "policy_model": {"responses_api_models": {"vllm_model": {"request_timeout_s": 30}}},
        "workplace": {"resources_servers": {"workplace_assistant": {}}},
        "simple": {"responses_api_agents": {"simple_agent": refs}},
        "plain": {"responses_api_agents": {"plain_loop_agent": refs}},
    }


@pytest.fixture(scope="module")
def backend() -> Iterator[ScriptedBackend]:
    with ScriptedBackend().start() as b:
        b.plans_from_rows(ROWS)
        yield b


@pytest.fixture(scope="module")
def dep(backend: ScriptedBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymDeployment]:
    with GymDeployment.start(gym_config(backend.base_url), log_dir=tmp_path_factory.mktemp("logs")) as d:
        yield d


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP a process and wait until it is stopped: the kernel delivers the signal asynchronously
    (every thread of the process must stop), so ``/proc`` may still say ``R`` just after ``kill``."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while (state := process_state(pid)) is not None and state[0] not in ("T", "t"):
        assert time.monotonic() < deadline, f"process {pid} still {state[0]!r} {timeout_s} s after SIGSTOP"
        time.sleep(0.01)


@contextmanager
def stopped(dep: GymDeployment, name: str) -> Iterator[float]:
    """SIGSTOP one server; SIGCONT it on the way out, whatever happened. Yields the stop time."""
    pid = dep.pid(name)
    try:
        sigstop(pid)
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)


async def run(http: aiohttp.ClientSession, dep: GymDeployment, agent: str, row: dict[str, Any],
              key: str) -> tuple[int, Any]:
    async with http.post(dep.url(agent) + "/run", json={**row, "_ng_rollout_id": key}) as resp:
        return resp.status, await resp.json()


async def activity(http: aiohttp.ClientSession, dep: GymDeployment, agent: str) -> AgentActivity:
    async with http.get(dep.url(agent) + ACTIVITY_ROUTE, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        assert resp.status == 200
        return AgentActivity.model_validate(await resp.json())


async def wait_for_phase(http: aiohttp.ClientSession, dep: GymDeployment, agent: str, key: str, phase: str,
                         timeout_s: float = 5.0) -> RunActivity:
    deadline = time.monotonic() + timeout_s
    while True:
        runs = {r.capture_key: r for r in (await activity(http, dep, agent)).runs}
        if key in runs and runs[key].phase == phase:
            return runs[key]
        assert time.monotonic() < deadline, (phase, runs)
        await asyncio.sleep(0.02)


async def assert_growing(http: aiohttp.ClientSession, dep: GymDeployment, agent: str, first: RunActivity) -> None:
    await asyncio.sleep(0.4)
    again = {r.capture_key: r for r in (await activity(http, dep, agent)).runs}[first.capture_key]
    assert (again.phase, again.server, again.tool) == (first.phase, first.server, first.tool)
    assert again.since_s >= first.since_s + 0.35, (first, again)


def assert_timed_out(status: int, body: Any, agent: str, server: str, route: str, setting: str) -> None:
    assert status == 504, body
    error = RunErrorBody.model_validate(body).error
    assert error.code == "upstream_timeout" and error.server == server, error
    assert error.detail == (f"{agent}: Gym server {server!r} did not answer POST {route} within "
                            f"{CALL_TIMEOUT_S:g}s ({setting})"), error.detail


async def assert_works_again(http: aiohttp.ClientSession, dep: GymDeployment, agent: str, row: dict[str, Any],
                             key: str) -> None:
    status, reply = await run(http, dep, agent, row, key)
    assert status == 200 and reply["reward"] == 1.0, reply
    assert (await activity(http, dep, agent)).runs == []  # nothing of the failed run is left on the board


@pytest.mark.parametrize("agent", AGENTS)
async def test_a_stopped_resources_server_fails_the_tool_call_naming_it(dep, backend, http, agent):
    row, key = ROWS[AGENTS.index(agent)], f"stall-tool-{agent}"
    user = first_user_text(row)
    backend.hold(user, 0)
    task = asyncio.create_task(run(http, dep, agent, row, key))
    try:
        await asyncio.to_thread(backend.wait_for_held, user, 0)  # seeded; its first reply asks for a tool
        waiting = await wait_for_phase(http, dep, agent, key, "model_call")
        assert waiting.server == "policy_model"
        with stopped(dep, "workplace"):
            backend.release(user, 0)
            released = time.monotonic()
            in_tool = await wait_for_phase(http, dep, agent, key, "tool_call")
            assert in_tool.server == "workplace" and in_tool.tool == row["ground_truth"][0]["name"], in_tool
            await assert_growing(http, dep, agent, in_tool)
            status, body = await asyncio.wait_for(task, CALL_TIMEOUT_S + 5)
            answered_after = time.monotonic() - released
        print(f"\n{agent}: stopped resources server, /run answered {answered_after:.2f}s after the tool call "
              f"began (resources_call_timeout_s={CALL_TIMEOUT_S:g}): {body['error']['detail']}")
        route = "/" + row["ground_truth"][0]["name"]
        assert_timed_out(status, body, agent, "workplace", route, "resources_call_timeout_s")
        assert CALL_TIMEOUT_S - 0.1 <= answered_after <= CALL_TIMEOUT_S + 1.5
    finally:
        backend.release(user, 0)
        if not task.done():
            task.cancel()
    await assert_works_again(http, dep, agent, ROWS[2 + AGENTS.index(agent)], f"stall-tool-after-{agent}")


async def test_a_resources_server_stopped_before_the_run_fails_its_seed(dep, http):
    agent, row, key = "plain", ROWS[4], "stall-seed"
    with stopped(dep, "workplace") as stop:
        task = asyncio.create_task(run(http, dep, agent, row, key))
        seeding = await wait_for_phase(http, dep, agent, key, "seeding")
        assert seeding.server == "workplace" and seeding.tool is None
        await assert_growing(http, dep, agent, seeding)
        status, body = await asyncio.wait_for(task, CALL_TIMEOUT_S + 5)
        answered_after = time.monotonic() - stop
    print(f"\nresources server stopped before /run: answered {answered_after:.2f}s after the stop")
    assert_timed_out(status, body, agent, "workplace", "/seed_session", "resources_call_timeout_s")
    assert answered_after <= CALL_TIMEOUT_S + 1.5
    await assert_works_again(http, dep, agent, ROWS[5], "stall-seed-after")


@pytest.mark.parametrize("agent", AGENTS)
async def test_a_stopped_model_server_fails_the_model_call_naming_it(dep, http, agent):
    row, key = ROWS[6 + AGENTS.index(agent)], f"stall-model-{agent}"
    with stopped(dep, "policy_model") as stop:
        task = asyncio.create_task(run(http, dep, agent, row, key))
        waiting = await wait_for_phase(http, dep, agent, key, "model_call")
        assert waiting.server == "policy_model" and waiting.tool is None
        await assert_growing(http, dep, agent, waiting)
        status, body = await asyncio.wait_for(task, CALL_TIMEOUT_S + 5)
        answered_after = time.monotonic() - stop
    print(f"\n{agent}: stopped model server, /run answered {answered_after:.2f}s after the stop: "
          f"{body['error']['detail']}")
    assert_timed_out(status, body, agent, "policy_model", f"/ng-rollout/{key}/v1/responses", "model_call_timeout_s")
    assert answered_after <= CALL_TIMEOUT_S + 1.5
    await assert_works_again(http, dep, agent, ROWS[8 + AGENTS.index(agent)], f"stall-model-after-{agent}")


async def test_a_stopped_agent_is_named_by_fetch_activity(dep, backend, http):
    row, key = ROWS[10], "stall-agent-busy"
    user = first_user_text(row)
    backend.hold(user, 0)  # a run in flight on the agent that still answers
    task = asyncio.create_task(run(http, dep, "simple", row, key))
    client = ServerClient(dep.config)
    try:
        await asyncio.to_thread(backend.wait_for_held, user, 0)
        with stopped(dep, "plain"):
            started = time.monotonic()
            got = await fetch_activity(client, ["plain", "simple"], timeout_s=1.0)
            took = time.monotonic() - started
        print(f"\nstopped agent: fetch_activity answered in {took:.2f}s: {got['plain']!r}")
        assert got["plain"] == "no reply within 1s"
        assert 0.9 <= took <= 2.0
        simple = got["simple"]
        assert isinstance(simple, AgentActivity) and simple.agent == "simple"
        assert [(r.capture_key, r.phase, r.server) for r in simple.runs] == [(key, "model_call", "policy_model")]
        lines = summary_lines(got, max_keys=3)
        assert lines[0] == "agent 'plain' did not answer: no reply within 1s"
        assert lines[1].startswith(f"1 rollout in a model call to 'policy_model' (oldest ") and lines[1].endswith(
            f" s): {key}"), lines
        # the agent answers again once it runs
        again = await fetch_activity(client, ["plain"], timeout_s=5.0)
        assert again["plain"] == AgentActivity(agent="plain", runs=[])
    finally:
        backend.release(user, 0)
        await client.close()
    status, reply = await asyncio.wait_for(task, 15)
    assert status == 200 and reply["reward"] == 1.0, reply


async def test_fetch_activity_names_agents_that_are_not_there(dep):
    port = free_port()  # nothing listens here
    cfg = parse_gym_config({"gone": {"responses_api_agents": {"plain_loop_agent": {"host": "127.0.0.1", "port": port}}},
                            "simple": {"responses_api_agents": {"simple_agent": {
                                "host": "127.0.0.1", "port": dep.config.instances["simple"].port}}}})
    client = ServerClient(cfg)
    try:
        got = await fetch_activity(client, ["gone", "simple", "nobody"], timeout_s=2.0)
    finally:
        await client.close()
    assert got["gone"].startswith(f"unreachable: Cannot connect to host 127.0.0.1:{port} "), got["gone"]
    print(f"\nfetch_activity of an agent with nobody on its port: {got['gone']!r}")
    assert got["nobody"].startswith("not a configured Gym server: unknown Gym server 'nobody'"), got["nobody"]
    assert isinstance(got["simple"], AgentActivity)
