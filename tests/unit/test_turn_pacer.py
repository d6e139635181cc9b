"""``TurnPacer``: at most ``per_turn`` paced steps (a ``/run`` body's parse, a call's send or reply) per
turn of the event loop, first come first served (docs/design.md §4.5, "Paced turns").

A real event loop; a ticker callback that reschedules itself with ``call_soon`` counts its turns.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from gym_patches.utils.pacing import TurnPacer, claim_pacing


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


# -- claims: work that blocks a prepare goes first ----------------------------


async def test_a_claim_that_blocks_now_is_served_before_earlier_unclaimed_waiters():
    pacer, turns = TurnPacer(per_turn=4), TurnCounter()
    granted: list[str] = []

    async def step(name: str, blocks: bool | None) -> None:
        if blocks is not None:
            claim_pacing(lambda: blocks)  # task-scoped: only this task's steps carry it
        await pacer.turn()
        granted.append(name)

    turns.start()
    burst = [asyncio.create_task(step(f"b{i}", None)) for i in range(40)]
    claimed = [asyncio.create_task(step("blocks", True)), asyncio.create_task(step("free", False))]
    await asyncio.gather(*burst, *claimed)
    turns.stop()

    assert granted.index("blocks") < 2 * pacer.per_turn  # jumped the 30-odd still waiting
    assert granted.index("free") == len(granted) - 1  # a claim that does not block waits its turn
    assert pacer.waiting == 0


async def test_promote_moves_waiters_whose_claim_now_blocks_in_their_order():
    pacer = TurnPacer(per_turn=2)
    blocking = {"x": False, "y": False}
    granted: list[str] = []

    async def step(name: str) -> None:
        if name in blocking:
            claim_pacing(lambda: blocking[name])
        await pacer.turn()
        granted.append(name)

    tasks = [asyncio.create_task(step(n)) for n in ["a", "b", "c", "x", "d", "y", "e", "f"]]
    await asyncio.sleep(0)  # all have run their first step: a, b granted, the rest in line
    assert pacer.waiting == 6
    tasks[2].cancel()  # c leaves; promote skips it
    blocking["x"] = blocking["y"] = True
    assert pacer.promote() == 2
    assert pacer.promote() == 0  # already in front
    await asyncio.gather(*tasks, return_exceptions=True)
    assert granted == ["a", "b", "x", "y", "d", "e", "f"]


async def test_the_per_turn_bound_holds_over_both_lines():
    pacer, turns = TurnPacer(per_turn=3), TurnCounter()
    ran_in: list[int] = []

    async def step(blocks: bool) -> None:
        claim_pacing(lambda: blocks)
        await pacer.turn()
        ran_in.append(turns.turn)

    turns.start()
    await asyncio.gather(*(asyncio.create_task(step(i % 2 == 0)) for i in range(60)))
    turns.stop()
    assert max(collections.Counter(ran_in).values()) <= 2 * pacer.per_turn


async def test_while_held_unclaimed_steps_get_one_per_turn_and_claimed_ones_the_full_budget():
    pacer, turns = TurnPacer(per_turn=4, held_per_turn=1), TurnCounter()
    ran: list[tuple[str, int]] = []

    async def step(kind: str) -> None:
        if kind == "blocks":
            claim_pacing(lambda: True)
        await pacer.turn()
        ran.append((kind, turns.turn))

    pacer.hold()
    turns.start()
    await asyncio.gather(*(asyncio.create_task(step("rest")) for _ in range(6)),
                         *(asyncio.create_task(step("blocks")) for _ in range(8)))
    per_turn = collections.Counter(turn for kind, turn in ran if kind == "rest")
    assert max(per_turn.values()) == 1 and len(per_turn) == 6  # still moving, one a turn
    blocks_turns = collections.Counter(turn for kind, turn in ran if kind == "blocks")
    assert max(blocks_turns.values()) >= 3  # the front line is not held back

    pacer.release()
    ran.clear()
    await asyncio.gather(*(asyncio.create_task(step("rest")) for _ in range(12)))
    turns.stop()
    assert max(collections.Counter(turn for _, turn in ran).values()) >= 3  # the full budget again
    assert not pacer.held


def test_holds_nest_and_a_stray_release_is_harmless():
    pacer = TurnPacer()
    pacer.release()
    assert not pacer.held
    pacer.hold()
    pacer.hold()
    pacer.release()
    assert pacer.held
    pacer.release()
    assert not pacer.held


def test_held_per_turn_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="held_per_turn"):
        TurnPacer(held_per_turn=0)
