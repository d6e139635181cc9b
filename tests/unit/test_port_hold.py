"""The policy URL's port is kept between choosing it and the generation worker serving it: while the
driver holds it, only a server that asks for ``reuse_port`` can bind it, and that server gets every
connection (a real aiohttp server on loopback)."""

from __future__ import annotations

import socket

import aiohttp
import pytest
from aiohttp import web

from gym_patches.utils.processes import PortHold, port_is_free
from nemo_rl.models.generation.http_front import serve_openai_routes


async def _ok(_: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _serve(port: int, reuse_port: bool):
    return serve_openai_routes("127.0.0.1", port, chat=_ok, models=_ok, health=_ok, reuse_port=reuse_port)


def test_a_held_port_refuses_any_other_bind_until_released():
    hold = PortHold()
    try:
        assert not port_is_free(hold.port)  # a server binding as usual (SO_REUSEADDR) fails
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", hold.port))
    finally:
        hold.release()
    hold.release()  # idempotent
    assert not hold.held and port_is_free(hold.port)


async def test_the_worker_binds_the_held_port_and_gets_every_connection():
    hold = PortHold()
    try:
        with pytest.raises(OSError):  # without reuse_port the hold keeps it out too
            await _serve(hold.port, reuse_port=False)
        runner, url = await _serve(hold.port, reuse_port=True)
        try:
            assert url == f"http://127.0.0.1:{hold.port}/v1"
            async with aiohttp.ClientSession() as http:
                for _ in range(20):  # the hold does not listen: no connection lands on it
                    async with http.get(f"http://127.0.0.1:{hold.port}/health",
                                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        assert resp.status == 200
            hold.release()
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{hold.port}/health") as resp:
                    assert resp.status == 200  # the server keeps its port after the hold goes
        finally:
            await runner.cleanup()
    finally:
        hold.release()
    assert port_is_free(hold.port)
