"""A replica receiving a burst of thousands of ``/run`` calls answers its checkpoint status probe and
prepare at once while most of them have not started (``gym_patches/responses_api_agents/
admission.py``, docs/design.md §4.5).

Real aiohttp servers in this process: ``simple_agent`` with checkpointing on, in front of a
resources server whose seeds wait until the test lets them go and a model server that never
answers. Runs start through a gate (at most its limit seeding at once); a run is not started, for a
checkpoint, until its first boundary, so neither the runs waiting at the gate nor the seeds in flight
block readiness: the prepare is answered with every seed still held, and a seed that ends while
closed does not start its run's first turn. After resume, every run of the burst starts and reaches
the model.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gym_patches.config import parse_gym_config
from gym_patches.responses_api_agents.admission import DEFAULT_START_LIMIT
from gym_patches.responses_api_agents.simple_agent.app import SimpleAgent

pytestmark = [pytest.mark.functional, pytest.mark.timeout(240)]

BURST = 2000  # /run calls sent at once to one agent
TOKEN = "burst-test-token"
CONTROL = "/ng-control/v1/checkpoint"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
ROW = {"responses_create_params": {"input": "book lunch with Bo"}}


class Upstreams:
    """The agent's resources server (seeds held until ``release_seeds``) and model server (never answers)."""

    def __init__(self) -> None:
        self.release_seeds = asyncio.Event()
        self.stopping = asyncio.Event()
        self.seeds_received = 0
        self.model_calls = 0
        self.model_reached = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> "Upstreams":
        async def seed(request: web.Request) -> web.Response:
            body = await request.json()
            self.seeds_received += 1
            await self.release_seeds.wait()
            return web.json_response({"session_id": f"s-{body['_ng_rollout_id']}"})

        async def model(_: web.Request) -> web.Response:
            self.model_calls += 1
            if self.model_calls == BURST:
                self.model_reached.set()
            await self.stopping.wait()
            return web.json_response({"error": {"code": "stopping", "detail": "test over"}}, status=503)

        app = web.Application()
        app.router.add_post("/seed_session", seed)
        app.router.add_post("/ng-rollout/{key}/v1/responses", model)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        self.release_seeds.set()
        self.stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def agent_url() -> AsyncIterator[tuple[str, Upstreams]]:
    upstreams = await Upstreams().start()
    refs = {"model_server": {"type": "responses_api_models", "name": "policy_model"},
            "resources_server": {"type": "resources_servers", "name": "tools"}}
    gym = parse_gym_config({
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 600},
        "tools": {"resources_servers": {"workplace_assistant": {"host": "127.0.0.1", "port": upstreams.port}}},
        "policy_model": {"responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": upstreams.port}}},
        "agent": {"responses_api_agents": {"simple_agent": refs}},
    })
    agent = SimpleAgent(gym.instances["agent"], gym)
    runner = web.AppRunner(agent.build_app(), shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", upstreams
    finally:
        await upstreams.stop()  # first: the agent's calls to it end, so its runs end
        await runner.cleanup()


async def _status(ctl: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with ctl.get(url + CONTROL + "/status", headers=HEADERS) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _post(ctl: aiohttp.ClientSession, url: str, op: str, **fields: Any) -> dict[str, Any]:
    body = {"checkpoint_id": "burst-1", "deadline_ts": time.time() + 600, **fields}
    async with ctl.post(url + CONTROL + "/" + op, headers=HEADERS, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def _waiting_to_start(status_or_reply: dict[str, Any]) -> int:
    return len(status_or_reply["report"]["unsaved"])  # a session agent's runs not at a first boundary yet


async def test_status_and_prepare_answer_at_once_while_a_burst_is_seeding(agent_url):
    url, upstreams = agent_url
    limit = DEFAULT_START_LIMIT
    assert BURST >= 10 * limit
    runs_http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                      timeout=aiohttp.ClientTimeout(total=None))
    ctl = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def run(i: int) -> None:
        async with runs_http.post(url + "/run", json={**ROW, "_ng_rollout_id": f"burst-{i}-a0"}) as resp:
            await resp.read()

    runs = [asyncio.create_task(run(i)) for i in range(BURST)]
    try:
        # The probe: asked while the burst arrives, until the agent holds every call of it.
        while True:
            status = await _status(ctl, url)
            started = status["report"]["counts"]["sessions"]  # seeding (the gate's limit at most)
            assert started <= limit, f"{started} runs started at once, more than the gate's {limit}"
            assert upstreams.seeds_received <= limit
            if _waiting_to_start(status) == BURST:
                break
            await asyncio.sleep(0.05)
        # Every call arrived; only the gate's limit are seeding (held by the resources server), and a
        # seed in flight blocks nothing: every run of the burst is not started yet.
        assert started == limit and status["report"]["blocker_count"] == 0
        # The seeds the agent started reach the resources server (under load some are still on their way
        # when the status counts them): wait for all of them, and never for more.
        deadline = time.monotonic() + 60
        while upstreams.seeds_received < limit and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

        # The prepare: answered at once, the seeds still held; nothing of the burst is saved, nothing waits.
        reply = await _post(ctl, url, "prepare", capture=True)
        assert reply["phase"] == "prepared"
        assert reply["report"]["ready"] and reply["report"]["counts"]["at_boundary"] == 0
        assert _waiting_to_start(reply) == BURST  # reported unsaved: they restart from the prompt
        assert upstreams.seeds_received == limit and not upstreams.model_reached.is_set()
        # Seeds that end while closed do not start their runs' first turns before the resume.
        upstreams.release_seeds.set()
        await asyncio.sleep(0.3)
        assert upstreams.seeds_received == limit and not upstreams.model_reached.is_set()

        # Resume: the whole burst starts, a gate's worth at a time, and reaches the model.
        assert (await _post(ctl, url, "resume"))["phase"] == "idle"
        await upstreams.model_reached.wait()
        assert upstreams.seeds_received == BURST
        final = await _status(ctl, url)
        assert final["report"]["counts"]["awaiting_model"] == BURST and _waiting_to_start(final) == 0
    finally:
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        await runs_http.close()
        await ctl.close()
