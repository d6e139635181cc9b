"""Who may ask a Gym replica for checkpoint work right now: a snapshot's pause, or an in-run recovery that
installs saved episodes there (docs/design.md §5.12).

Gym installs saved episodes only into idle servers, and a snapshot's pause holds its replicas prepared, so
the two must not overlap on one replica; they may on different replicas. A snapshot takes the guards of
the replicas it prepares for its pause (it passes over a replica whose guard a recovery holds); a recovery
that moves a given-up replica's rollouts to the shard's others waits for their guards. One lock per
replica, taken in name order, so two holders never wait on each other.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Iterable


class ReplicaGuards:
    """One ``asyncio.Lock`` per replica, made on first use (on the loop that uses it)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, iid: str) -> asyncio.Lock:
        return self._locks.setdefault(iid, asyncio.Lock())

    def free(self, iids: Iterable[str]) -> list[str]:
        """Those of ``iids`` nobody holds now."""
        return [iid for iid in iids if not self._lock(iid).locked()]

    @contextlib.asynccontextmanager
    async def hold(self, iids: Iterable[str]) -> AsyncIterator[None]:
        """Hold every guard of ``iids`` (waiting for each in name order), released on the way out."""
        held: list[asyncio.Lock] = []
        try:
            for iid in sorted(set(iids)):
                lock = self._lock(iid)
                await lock.acquire()
                held.append(lock)
            yield
        finally:
            for lock in reversed(held):
                lock.release()
