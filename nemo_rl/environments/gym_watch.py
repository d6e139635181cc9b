"""Watching one replica's Gym server processes for the in-run recovery (docs/design.md §5.12).

``watch_servers`` returns when a server is lost: its process exited (told at once by a pidfd, the
kernel's own wait on a pid, not a poll), it has been stopped (``T``: SIGSTOP, a debugger) for
``hung_after_s``, or its ``/health`` has gone unanswered for ``hung_after_s`` (a deadlock). It runs in
the replica's ``NemoGym`` actor, whose children the servers are; the controller awaits it per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import aiohttp

from gym_patches.utils.processes import process_state

HEALTH_TIMEOUT_S = 2.0  # one /health probe; a server silent past ``hung_after_s`` of these is hung
TICK_S = 1.0  # how often a stopped state and /health are looked at (an exit is told at once)


@dataclass(frozen=True)
class ServerLoss:
    """Why the watch returned: ``cause`` is the short phrase the recovery line and row carry."""

    server: str
    cause: str  # "died (exit -9)", "stopped for 30 s", "did not answer /health for 30 s"
    kind: str  # "died" | "stopped" | "silent"
    exit_code: int | None = None

    def as_dict(self) -> dict:
        return {"server": self.server, "cause": self.cause, "kind": self.kind, "exit_code": self.exit_code}


def describe_exit(code: int | None) -> str:
    """``exit -9`` (a signal, as ``subprocess`` reports it) or ``exit 1``; the signal named when known."""
    if code is None:
        return "exit unknown"
    if code < 0:
        try:
            return f"exit {code}, {signal.Signals(-code).name}"
        except ValueError:
            return f"exit {code}"
    return f"exit {code}"


async def watch_servers(pids: dict[str, int], exit_code: Callable[[str], int | None], urls: dict[str, str],
                        hung_after_s: float) -> ServerLoss:
    """Wait until one of ``pids`` is lost (see the module docstring). ``exit_code(name)`` reaps the exited
    process (``Popen.poll``) and gives its code; ``urls`` are the servers' base URLs for ``/health``."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Queue[str] = asyncio.Queue()
    fds: dict[int, str] = {}
    try:
        for name, pid in pids.items():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                exited.put_nowait(name)  # gone already
                continue
            fds[fd] = name
            loop.add_reader(fd, exited.put_nowait, name)
        stopped_since: dict[str, float] = {}
        silent_since: dict[str, float] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as session:
            while True:
                try:
                    name = await asyncio.wait_for(exited.get(), TICK_S)
                    return ServerLoss(name, f"died ({describe_exit(exit_code(name))})", "died", exit_code(name))
                except TimeoutError:
                    pass
                now = time.monotonic()
                for name, pid in pids.items():
                    state = process_state(pid)
                    if state is not None and state[0] in ("T", "t"):
                        since = stopped_since.setdefault(name, now)
                        if now - since >= hung_after_s:
                            return ServerLoss(name, f"stopped for {now - since:.0f} s", "stopped")
                    else:
                        stopped_since.pop(name, None)
                answers = await asyncio.gather(*(_healthy(session, url) for url in urls.values()))
                now = time.monotonic()
                for name, ok in zip(urls, answers):
                    if ok or name in stopped_since:
                        silent_since.pop(name, None)
                        continue
                    since = silent_since.setdefault(name, now)
                    if now - since >= hung_after_s:
                        return ServerLoss(name, f"did not answer /health for {now - since:.0f} s", "silent")
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


@contextlib.contextmanager
def exit_futures(pids: list[int]) -> Iterator[dict[int, asyncio.Future]]:
    """A future per pid that is done once that process has exited (its pidfd readable: the kernel's own wait,
    no poll; done at once for one already gone), for use on the running loop while the block lasts."""
    loop = asyncio.get_running_loop()
    futures: dict[int, asyncio.Future] = {}
    fds = []
    try:
        for pid in pids:
            futures[pid] = loop.create_future()
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                futures[pid].set_result(None)
                continue
            fds.append(fd)
            loop.add_reader(fd, lambda f=futures[pid]: f.done() or f.set_result(None))
        yield futures
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


async def first_exit(pids: list[int], within_s: float) -> int | None:
    """The first of ``pids`` to exit within ``within_s``, or None."""
    with exit_futures(pids) as exits:
        if exits:
            await asyncio.wait(exits.values(), timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
        return next((pid for pid, f in exits.items() if f.done()), None)


async def processes_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until every process of ``pids`` (on this host) has exited; returns those still running after
    ``timeout_s``."""
    with exit_futures(pids) as exits:
        if exits:
            await asyncio.wait(exits.values(), timeout=timeout_s)
        return [pid for pid, f in exits.items() if not f.done()]


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
