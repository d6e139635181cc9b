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

``IntakePacer`` bounds the step before the gate: reading a ``/run`` body as JSON and checking its
row costs a few milliseconds each, and a burst's calls all arrive ready in the same turn of the
loop, so without a bound one turn parses thousands of bodies (seconds) while a control request
waits for the next turn. The pacer grants at most ``per_turn`` parses per turn, first come first
served; the rest wait, unknown to the checkpoint participant (Gym has not seen them: the RL side
restarts them from their prompt, as a call still on the wire).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import AsyncIterator

# Enough to keep a resources server that seeds in milliseconds busy; few enough that a turn of the
# event loop (and a prepare waiting for the seeds in flight) stays short at thousands of runs.
DEFAULT_START_LIMIT = 64
# A body's parse and row check take 1-3 ms on this project's CPUs: 32 keep one turn's intake under
# about 100 ms, and still parse hundreds of bodies a second on an otherwise idle loop.
DEFAULT_INTAKE_PER_TURN = 32


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


class IntakePacer:
    """At most ``per_turn`` holders of ``turn()`` return per turn of the event loop, in arrival order.

    A turn's budget is reset by a callback scheduled with ``call_soon``, which runs once in the next
    turn and wakes the next ``per_turn`` waiters; it keeps rescheduling itself while anyone waits.
    """

    def __init__(self, per_turn: int = DEFAULT_INTAKE_PER_TURN):
        if isinstance(per_turn, bool) or not isinstance(per_turn, int) or per_turn < 1:
            raise ValueError(f"IntakePacer per_turn must be a positive integer, got {per_turn!r}")
        self.per_turn = per_turn
        self._granted = 0  # in the current turn
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._reset_pending = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def turn(self) -> None:
        """Return at once while this turn's budget lasts and nobody waits; else wait in line."""
        if not self._waiters and self._granted < self.per_turn:
            self._granted += 1
            self._schedule_reset()
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._schedule_reset()
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.done():
                self._waiters.remove(waiter)
            raise

    def _schedule_reset(self) -> None:
        if not self._reset_pending:
            self._reset_pending = True
            asyncio.get_running_loop().call_soon(self._reset)

    def _reset(self) -> None:
        """A new turn: its budget goes first to those waiting, oldest first."""
        self._reset_pending = False
        self._granted = 0
        while self._waiters and self._granted < self.per_turn:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled waiter is skipped, its place not charged
                waiter.set_result(None)
                self._granted += 1
        if self._waiters or self._granted:
            self._schedule_reset()
