"""Wake-ups instead of polling: ledger changes and the dispatch gate.

The controller's dispatch loop and the snapshot's drain wait on one
``asyncio.Condition``: every ledger transition (seal, fail, refuse) and every
reopening of the gate notifies it, and each waiter re-checks its own predicate.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable


class LedgerChanges:
    """Notified after each ledger transition; waiters wait for a predicate over the ledger."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.count = 0  # ledger transitions so far: the stall watchdog's measure of progress

    async def notify(self, *, transition: bool = True) -> None:
        """Wake the waiters; ``transition=False`` for a wake-up that is not a ledger transition."""
        if transition:
            self.count += 1
        async with self._cond:
            self._cond.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> None:
        """Return once ``predicate()`` holds; TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            async with self._cond:
                await self._cond.wait_for(predicate)


class DispatchGate:
    """Whether new rollouts may go to Gym. The snapshotter owns it; the controller only reads it."""

    def __init__(self, changes: LedgerChanges):
        self._open = True
        self._changes = changes

    @property
    def is_open(self) -> bool:
        return self._open

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """Closed for the body (a snapshot); reopened and waiters woken on the way out, whatever happened."""
        self._open = False
        try:
            yield
        finally:
            self._open = True
            await self._changes.notify(transition=False)
