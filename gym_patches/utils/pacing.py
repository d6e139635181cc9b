"""A bound on how much data-plane work one turn of a Gym server's event loop runs (docs/design.md §4.5,
"Paced turns").

Why: a checkpoint request (a status probe, a prepare) is served between turns of the server's event
loop, and each of its awaits costs it one turn. A replica admitting a step's thousands of ``/run``
calls has thousands of steps ready at once (bodies to parse, seeds and model requests to encode,
replies to decode), and an unbounded turn runs them all: one turn then takes seconds, and a prepare
that needs a few turns waits several times that. ``TurnPacer`` lets at most ``per_turn`` paced steps
run per turn, in arrival order; the rest wait in a queue that costs nothing per turn, so a turn stays
at ``per_turn`` steps however long the queue, and the control routes, which are not paced, are served
between them. A loop with spare time grants at once: pacing costs a busy loop one turn of latency per
paced step and no throughput (the loop is busy either way).
"""

from __future__ import annotations

import asyncio
import collections

# A paced step (a body parse, a request's encoding and send, a reply's decoding) takes 1-3 ms on this
# project's CPUs, a seed's handler up to about 10: 8 keep a busy turn within tens of milliseconds. At
# 8,192 rollouts on one replica, 6 and 16 gave the same burst pauses within noise (docs/benchmarks.md).
DEFAULT_PER_TURN = 8


class TurnPacer:
    """At most ``per_turn`` holders of ``turn()`` return per turn of the event loop, in arrival order.

    A turn's budget is reset by a callback scheduled with ``call_soon``, which runs once in the next
    turn and wakes the next ``per_turn`` waiters; it keeps rescheduling itself while anyone waits.
    """

    def __init__(self, per_turn: int = DEFAULT_PER_TURN):
        if isinstance(per_turn, bool) or not isinstance(per_turn, int) or per_turn < 1:
            raise ValueError(f"TurnPacer per_turn must be a positive integer, got {per_turn!r}")
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
