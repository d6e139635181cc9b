"""How many ``/run`` calls of one agent start at once (docs/design.md §4.5).

Why: a replica that receives a step's thousands of ``/run`` calls at once would otherwise start
them all in the same few turns of its event loop. Starting one is per-call work (a seed request:
a new connection, the row encoded, the reply parsed; then the first model call), so one turn then
runs thousands of such steps and a checkpoint status probe or prepare waits seconds behind them.
Every seed in flight also blocks readiness, here and on the resources server, which the flood
saturates in turn. ``StartGate`` lets at most ``limit`` runs start at once; the others wait
before doing anything (a session agent reports them ``admitting``: nothing done, nothing to save),
so a turn of the loop holds at most ``limit`` starts, the control routes are served between
them, and a prepare waits for at most ``limit`` seeds. Seeds then reuse a few pooled
connections instead of opening one each.

The cost: at most ``limit`` seeds are on the wire at once, so a resources server whose seeds
take seconds starts ``limit`` per seed time.

The step before the gate, reading a ``/run`` body and checking its row, is paced like every other
data-plane request (``gym_patches.utils.pacing``): a call waiting there is unknown to the checkpoint
participant (Gym has not seen it: the RL side restarts it from its prompt, as a call still on the wire).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

# Enough to keep a resources server that seeds in milliseconds busy; few enough that a turn of the
# event loop (and a prepare waiting for the seeds in flight) stays short at thousands of runs.
DEFAULT_START_LIMIT = 64


class StartGate:
    """A FIFO bound on the runs starting at once, with counts of who is in and who waits."""

    def __init__(self, limit: int = DEFAULT_START_LIMIT):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"StartGate limit must be a positive integer, got {limit!r}")
        self.limit = limit
        self._slots = asyncio.Semaphore(limit)
        self.starting = 0  # holding a slot
        self.waiting = 0  # queued for one

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the ``limit`` slots for the body; waits (FIFO) while all are taken."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.starting += 1
        try:
            yield
        finally:
            self.starting -= 1
            self._slots.release()
