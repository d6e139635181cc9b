"""``watch_servers`` (the in-run recovery's watch, docs/design.md §5.12) on real processes: an exit is told
at once with its code, a process stopped (SIGSTOP) or a server silent to ``/health`` past the bound is
lost, and a healthy one is never reported."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest
from aiohttp import web

from nemo_rl.environments.gym_watch import watch_servers

pytestmark = pytest.mark.functional


async def _health_server(healthy: dict) -> tuple[web.AppRunner, str]:
    async def health(_):
        if not healthy["ok"]:
            await asyncio.sleep(10)  # answers nothing in time
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


async def test_an_exit_is_told_at_once_with_its_code():
    healthy = {"ok": True}
    runner, url = await _health_server(healthy)
    procs = {"a": _sleeper(), "b": _sleeper()}
    try:
        watch = asyncio.create_task(watch_servers({n: p.pid for n, p in procs.items()}, lambda n: procs[n].poll(),
                                                  {"a": url}, hung_after_s=30))
        await asyncio.sleep(1.5)
        assert not watch.done()  # both alive and answering: nothing to report
        t0 = time.monotonic()
        procs["b"].kill()
        loss = await asyncio.wait_for(watch, 5)
        assert time.monotonic() - t0 < 0.5  # a pidfd, not a poll of seconds
        assert (loss.server, loss.kind, loss.exit_code) == ("b", "died", -9)
        assert loss.cause == "died (exit -9, SIGKILL)"
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        await runner.cleanup()


async def test_a_stopped_process_is_lost_after_the_bound():
    proc = _sleeper()
    try:
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        loss = await asyncio.wait_for(watch_servers({"s": proc.pid}, lambda n: proc.poll(), {}, hung_after_s=2), 10)
        assert loss.kind == "stopped" and loss.server == "s" and loss.cause.startswith("stopped for ")
        assert 2 <= time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()


async def test_a_server_silent_to_health_is_lost_after_the_bound():
    healthy = {"ok": False}
    runner, url = await _health_server(healthy)
    proc = _sleeper()
    try:
        loss = await asyncio.wait_for(watch_servers({"s": proc.pid}, lambda n: proc.poll(), {"s": url},
                                                    hung_after_s=3), 15)
        assert loss.kind == "silent" and loss.cause.startswith("did not answer /health for ")
    finally:
        proc.kill()
        proc.wait()
        await runner.cleanup()


async def test_first_exit_and_processes_gone_follow_real_exits():
    """The pidfd waits a replacement uses: ``first_exit`` names the first process to exit (None while none
    does), ``processes_gone`` returns once every process has exited, and names those still running when its
    bound passes."""
    from nemo_rl.environments.gym_watch import first_exit, processes_gone

    a, b = _sleeper(), _sleeper()
    try:
        assert await first_exit([a.pid, b.pid], 0.2) is None
        assert await processes_gone([a.pid, b.pid], 0.2) == [a.pid, b.pid]
        b.kill()
        assert await first_exit([a.pid, b.pid], 5.0) == b.pid
        a.kill()
        assert await processes_gone([a.pid, b.pid], 5.0) == []
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()
