"""A Gym server's data-plane work is paced per turn of its event loop; its control routes are not
(``GymServer._paced``, ``ServerClient`` with a pacer; docs/design.md §4.5, "Paced turns").

Real aiohttp servers and clients on loopback, in this process's event loop; a ticker callback that
reschedules itself with ``call_soon`` counts the loop's turns (``TurnCounter``). The server under
test is a small ``GymServer`` subclass (named ``BusyServer``: one data route whose handler does a
few milliseconds of synchronous work, as a body parse or a seed does).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import time
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gym_patches.config import parse_gym_config
from gym_patches.server_utils import GymServer, ServerClient
from gym_patches.utils.pacing import TurnPacer
from tests.unit.test_turn_pacer import TurnCounter

BURST = 300


class BusyServer(GymServer):
    """A stand-in data-plane server: ``POST /work`` records the loop turn its handler started in."""

    server_type = "resources_servers"

    def __init__(self, *args: Any, turns: TurnCounter, **kw: Any):
        super().__init__(*args, **kw)
        self.turns = turns
        self.started_in: list[int] = []

    def setup_routes(self, app: web.Application) -> None:
        async def work(request: web.Request) -> web.Response:
            body = await request.json()  # read by the middleware before its turn: no suspension here
            self.started_in.append(self.turns.turn)
            time.sleep(0.001)  # a body parse's worth of CPU
            return web.json_response({"echo": body["i"]})

        async def text(_: web.Request) -> web.Response:
            return web.Response(text="not json")

        app.router.add_post("/work", work)
        app.router.add_get("/text", text)


def _config(port: int = 0) -> Any:
    return parse_gym_config({"busy": {"resources_servers": {"workplace_assistant": {"host": "127.0.0.1",
                                                                                     "port": port}}}})


@pytest.fixture
async def busy() -> AsyncIterator[tuple[BusyServer, str, TurnCounter]]:
    turns = TurnCounter()
    thresholds = gc.get_threshold()
    cfg = _config()
    server = BusyServer(cfg.instances["busy"], cfg, turns=turns)
    runner = web.AppRunner(server.build_app(), shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    turns.start()
    try:
        yield server, f"http://127.0.0.1:{port}", turns
    finally:
        turns.stop()
        await runner.cleanup()
    assert gc.get_threshold() == thresholds  # the server's young-only collection ended with it


async def test_a_burst_of_requests_starts_a_bounded_number_of_handlers_per_turn(busy):
    server, url, _ = busy
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def call(i: int) -> Any:
            async with http.post(url + "/work", json={"i": i}) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["echo"]

        echoes = await asyncio.gather(*(call(i) for i in range(BURST)))
    assert sorted(echoes) == list(range(BURST))
    per_turn = collections.Counter(server.started_in)
    # a turn runs the waiters its reset woke plus fresh grants up to the budget: at most twice it
    assert max(per_turn.values()) <= 2 * server.pacer.per_turn, per_turn.most_common(3)
    assert len(per_turn) >= BURST // (2 * server.pacer.per_turn)


async def test_health_is_answered_between_the_turns_of_a_queued_burst(busy):
    server, url, _ = busy
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def call(i: int) -> None:
            async with http.post(url + "/work", json={"i": i}) as resp:
                await resp.read()

        burst = [asyncio.create_task(call(i)) for i in range(BURST)]
        while server.pacer.waiting < server.pacer.per_turn:  # the burst is queued at the pacer
            assert not all(t.done() for t in burst), "the burst ended before it ever queued"
            await asyncio.sleep(0.001)
        async with http.get(url + "/health") as resp:
            assert resp.status == 200
        handled_at_health = len(server.started_in)
        await asyncio.gather(*burst)
    assert handled_at_health < BURST // 2, f"/health waited for {handled_at_health} of {BURST} paced handlers"


async def test_a_paced_client_decodes_replies_in_turns_of_its_own(busy):
    _, url, turns = busy
    port = int(url.rsplit(":", 1)[1])
    client = ServerClient(_config(port), pacer=TurnPacer(per_turn=1))
    returned_in: list[int] = []

    async def call(i: int) -> None:
        resp = await client.post("busy", "/work", json={"i": i})
        assert resp.status == 200 and resp.body == {"echo": i}, resp
        returned_in.append(turns.turn)

    try:
        await asyncio.gather(*(call(i) for i in range(20)))
        text = await client.get("busy", "/text")  # a body that is not JSON: kept as text, body None
        assert (text.status, text.body, text.text) == (200, None, "not json")
    finally:
        await client.close()
    per_turn = collections.Counter(returned_in)
    assert max(per_turn.values()) <= 2, per_turn.most_common(3)  # one share a turn, plus one fresh grant
