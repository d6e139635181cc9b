"""The lease of the active checkpoint, and the task that reopens the server once it runs out.

A controller that dies must not leave Gym closed: every call of a checkpoint extends its lease to
``deadline_ts + grace`` (never shortening it), and the watcher calls ``on_expiry`` once the clock
passes it. Resume clears it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Awaitable, Callable

from gym_patches.checkpoint.control.scope import TASK_NAME_PREFIX
from gym_patches.utils.cancellation import outlast_cancellation

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # the watcher looks again at least this often (the clock may be a test's)


class Lease:
    def __init__(self, grace_seconds: float, clock: Callable[[], float]):
        if not math.isfinite(grace_seconds) or grace_seconds < 0:
            raise ValueError(f"lease_grace_seconds must be finite and >= 0, got {grace_seconds!r}")
        self.grace = float(grace_seconds)
        self.clock = clock
        self.expires_at: float | None = None
        self.changed = asyncio.Event()

    def extend(self, deadline_ts: float) -> None:
        lease = deadline_ts + self.grace
        if self.expires_at is None or lease > self.expires_at:
            self.expires_at = lease
            self.changed.set()

    def clear(self) -> None:
        self.expires_at = None
        self.changed.set()

    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= self.clock()


class LeaseWatcher:
    """One task per server, from startup to stop: waits for the lease to run out, then calls
    ``on_expiry`` (which re-checks under the control plane's lock). A failing ``on_expiry`` is
    logged and tried again a second later."""

    def __init__(self, lease: Lease, on_expiry: Callable[[], Awaitable[None]], instance: str):
        self._lease = lease
        self._on_expiry = on_expiry
        self._instance = instance
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if not self.running:
            self._task = asyncio.create_task(self._watch(), name=f"{TASK_NAME_PREFIX}lease:{self._instance}")

    async def stop(self) -> None:
        """Cancel the watcher and wait until it has ended. Its own cancellation is what was asked for; a
        cancellation of the caller is raised once the watcher has ended (never swallowed)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await outlast_cancellation(task)

    async def _watch(self) -> None:
        lease = self._lease
        while True:
            lease.changed.clear()
            expires = lease.expires_at
            if expires is None:
                await lease.changed.wait()
                continue
            delay = expires - lease.clock()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(lease.changed.wait(), timeout=min(delay, _POLL_S))
                continue
            try:
                await self._on_expiry()
            except Exception:
                logger.exception("checkpoint control %s: reopening after lease expiry failed", self._instance)
                await asyncio.sleep(_POLL_S)
