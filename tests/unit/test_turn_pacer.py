"""``TurnPacer``: at most ``per_turn`` paced steps (a ``/run`` body's parse, a call's send or reply) per
turn of the event loop, first come first served (docs/design.md §4.5, "Paced turns").

A real event loop; a ticker callback that reschedules itself with ``call_soon`` counts its turns.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from gym_patches.utils.pacing import TurnPacer


class TurnCounter:
    """Counts turns of the running loop: its callback runs once per turn while started."""

    def __init__(self) -> None:
        self.turn = 0
        self._running = False

    def start(self) -> None:
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False

    def _tick(self) -> None:
        self.turn += 1
        if self._running:
            asyncio.get_running_loop().call_soon(self._tick)


async def test_a_burst_is_granted_a_bounded_number_per_turn_in_arrival_order():
    pacer, turns = TurnPacer(per_turn=8), TurnCounter()
    granted: list[tuple[int, int]] = []  # (caller, turn it ran in)

    async def intake(i: int) -> None:
        await pacer.turn()
        granted.append((i, turns.turn))

    turns.start()
    tasks = [asyncio.create_task(intake(i)) for i in range(100)]  # all ready in one turn
    await asyncio.gather(*tasks)
    turns.stop()

    per_turn = collections.Counter(turn for _, turn in granted)
    assert len(granted) == 100
    # A turn runs at most the budget of waiters woken for it plus fresh arrivals up to the budget.
    assert max(per_turn.values()) <= 2 * pacer.per_turn, per_turn
    assert len(per_turn) >= 100 // (2 * pacer.per_turn)  # spread over turns, not one
    assert [i for i, _ in granted] == sorted(i for i, _ in granted)  # first come, first served
    assert pacer.waiting == 0


async def test_an_idle_loop_grants_at_once_without_yielding():
    pacer = TurnPacer(per_turn=4)
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    task = asyncio.create_task(other())
    for _ in range(4):
        await pacer.turn()  # within budget: no suspension, so ``other`` has not run yet
    order.append("granted")
    await task
    assert order == ["granted", "other"]


async def test_a_cancelled_waiter_leaves_the_line_and_takes_no_share():
    pacer = TurnPacer(per_turn=1)
    granted = asyncio.create_task(pacer.turn())  # the turn's one share
    first = asyncio.create_task(pacer.turn())
    second = asyncio.create_task(pacer.turn())
    await asyncio.sleep(0)  # the three have run their first step, the next turn's reset has not
    assert granted.done() and pacer.waiting == 2
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, timeout=5)
    assert pacer.waiting == 0


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_per_turn_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="per_turn"):
        TurnPacer(per_turn=bad)
