"""How many ``run_rollout`` calls are on their way to one Gym replica's actor (docs/design.md §5.4).

Why: Ray hands a caller's calls to an actor in the order they were made, and an actor whose event
loop is busy sending thousands of ``/run`` calls takes each new call in a few milliseconds. A step
that dispatches 8,192 rollouts at once therefore queues a snapshot's prepare behind every rollout
not yet taken: measured, the first prepare of such a step reached the actor 18 s after it was sent
(docs/benchmarks.md §1e). ``DeliveryWindow`` sends at most ``size`` rollout calls to a replica
before a cheap call behind them (``NemoGym.delivered``) has come back, so a checkpoint call waits
behind at most ``size`` of them. Rollouts in flight are not bounded: a delivered call runs as long
as its episode does; only the queue in front of the actor is.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")

# At a few ms per call taken by a busy actor, 64 keep a prepare's wait behind rollouts near 0.2 s;
# the barrier costs one round trip per 64 rollouts.
DEFAULT_DELIVERY_WINDOW = 64


class DeliveryWindow:
    """At most ``size`` calls sent since the last barrier came back; callers pass in arrival order."""

    def __init__(self, barrier: Callable[[], Awaitable[Any]], size: int = DEFAULT_DELIVERY_WINDOW):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"DeliveryWindow size must be a positive integer, got {size!r}")
        self.size = size
        self._barrier = barrier
        self._sent = 0  # since the last barrier returned
        self._turn = asyncio.Lock()  # FIFO: one sender (or the barrier it waits on) at a time
        self.barriers = 0

    async def send(self, submit: Callable[[], T]) -> T:
        """Call ``submit`` (which sends, without waiting for the result) once the window has room.

        A barrier that fails (the actor is gone) raises to the caller whose turn it was; the next
        caller tries its own. A caller cancelled while waiting sends nothing."""
        async with self._turn:
            if self._sent >= self.size:
                await self._barrier()  # every call sent before it has been taken by the actor
                self.barriers += 1
                self._sent = 0
            self._sent += 1
            return submit()
