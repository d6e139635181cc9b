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

While a prepare waits for some work to reach a boundary, that work must not queue behind the burst
that is starting new work: a task may *claim* its pacing (``claim_pacing``) with a test of whether
it blocks a prepare now. A claimed waiter that blocks is served before every unclaimed one, and the
owner of the test calls ``promote()`` when the answer may have changed for those already waiting
(an agent closing its admission). The per-turn bound holds for both lines together. And while a
checkpoint is in progress on the server (``hold()`` to ``release()``, by its control plane), the
unclaimed line gets only ``held_per_turn`` steps per turn: turns stay short, so the prepare's own
awaits, each a turn, come round quickly, and the rest of the work still moves.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from dataclasses import dataclass
from typing import Callable

# A paced step (a body parse, a request's encoding and send, a reply's decoding) takes 1-3 ms on this
# project's CPUs, a seed's handler up to about 10: 8 keep a busy turn within tens of milliseconds. At
# 8,192 rollouts on one replica, 6 and 16 gave the same burst pauses within noise, and so did 4 once a
# prepare's work went first (measured while choosing it: git history of docs/benchmarks.md; §1c
# there has the current burst figures).
DEFAULT_PER_TURN = 8
# Unclaimed steps per turn while a checkpoint is in progress: never none (work a prepare does not
# wait for may still be work a prepare elsewhere waits for), never many.
DEFAULT_HELD_PER_TURN = 1


# A task's test of whether its paced steps block a prepare now (None: they never do). Task-scoped:
# a task inherits its creator's claim, and setting one affects only the task that sets it and those
# it starts afterwards.
_claim: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("gym_pacing_claim", default=None)


def claim_pacing(blocks_prepare: Callable[[], bool]) -> None:
    """The current task's paced steps go first while ``blocks_prepare()`` says they hold up a prepare."""
    _claim.set(blocks_prepare)


@dataclass(eq=False, slots=True)
class _Waiter:
    future: asyncio.Future[None]
    claim: Callable[[], bool] | None


class TurnPacer:
    """At most ``per_turn`` holders of ``turn()`` return per turn of the event loop: those whose
    claim says they block a prepare first, then the rest, each line in arrival order.

    A turn's budget is reset by a callback scheduled with ``call_soon``, which runs once in the next
    turn and wakes the next ``per_turn`` waiters; it keeps rescheduling itself while anyone waits.
    """

    def __init__(self, per_turn: int = DEFAULT_PER_TURN, held_per_turn: int = DEFAULT_HELD_PER_TURN):
        for name, value in (("per_turn", per_turn), ("held_per_turn", held_per_turn)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TurnPacer {name} must be a positive integer, got {value!r}")
        self.per_turn = per_turn
        self.held_per_turn = min(held_per_turn, per_turn)
        self._held = 0  # holds taken and not released (a checkpoint in progress)
        self._granted = 0  # in the current turn
        self._first: collections.deque[_Waiter] = collections.deque()  # blocking a prepare
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._reset_pending = False

    @property
    def waiting(self) -> int:
        return len(self._first) + len(self._waiters)

    @property
    def held(self) -> bool:
        return self._held > 0

    def hold(self) -> None:
        """A checkpoint is in progress: unclaimed steps get ``held_per_turn`` per turn until ``release()``."""
        self._held += 1

    def release(self) -> None:
        """Undo one ``hold()``; the last one restores the full budget (a release without a hold is a no-op)."""
        self._held = max(0, self._held - 1)

    async def turn(self) -> None:
        """Return at once while this turn's budget lasts and nobody waits; else wait in line."""
        claim = _claim.get()
        first = claim is not None and claim()
        budget = self.per_turn if first or not self._held else self.held_per_turn
        if not self._first and not self._waiters and self._granted < budget:
            self._granted += 1
            self._schedule_reset()
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), claim)
        (self._first if first else self._waiters).append(waiter)
        self._schedule_reset()
        await waiter.future  # a cancelled waiter stays in its line, done, and is skipped there

    def promote(self) -> int:
        """Move the waiters whose claim now says they block a prepare to the front line, in their
        order; returns how many moved. One pass over the waiting line."""
        rest: collections.deque[_Waiter] = collections.deque()
        moved = 0
        for waiter in self._waiters:
            if waiter.future.done():
                continue
            if waiter.claim is not None and waiter.claim():
                self._first.append(waiter)
                moved += 1
            else:
                rest.append(waiter)
        self._waiters = rest
        return moved

    def _schedule_reset(self) -> None:
        if not self._reset_pending:
            self._reset_pending = True
            asyncio.get_running_loop().call_soon(self._reset)

    def _reset(self) -> None:
        """A new turn: its budget goes first to those waiting, the front line first, oldest first."""
        self._reset_pending = False
        self._granted = 0
        rest = self.held_per_turn if self._held else self.per_turn
        for line, budget in ((self._first, self.per_turn), (self._waiters, rest)):
            granted = 0
            while line and granted < budget and self._granted < self.per_turn:
                waiter = line.popleft()
                if not waiter.future.done():  # a cancelled waiter is skipped, its place not charged
                    waiter.future.set_result(None)
                    granted += 1
                    self._granted += 1
        if self._first or self._waiters or self._granted:
            self._schedule_reset()
