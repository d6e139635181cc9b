"""``DeliveryWindow``: at most ``size`` rollout calls sent to a replica's actor before a barrier call
behind them has come back (docs/design.md §5.4).

The barrier here is a coroutine the test controls (a stand-in for ``NemoGym.delivered``, which Ray
answers once the calls before it were taken); ``submit`` records what was sent.
"""

from __future__ import annotations

import asyncio

import pytest

from nemo_rl.environments.delivery_window import DeliveryWindow


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []  # "send i" and "barrier"
        self.release = asyncio.Event()
        self.fail_next = False

    async def barrier(self) -> None:
        self.events.append("barrier")
        await self.release.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("actor gone")

    def submit(self, i: int):
        def send() -> str:
            self.events.append(f"send {i}")
            return f"ref {i}"
        return send


async def test_at_most_size_sends_between_barriers_in_arrival_order():
    rec = Recorder()
    window = DeliveryWindow(rec.barrier, size=4)
    tasks = [asyncio.create_task(window.send(rec.submit(i))) for i in range(10)]
    await asyncio.sleep(0.01)
    assert rec.events == [f"send {i}" for i in range(4)] + ["barrier"]  # the fifth waits on the barrier
    rec.release.set()
    refs = await asyncio.gather(*tasks)
    assert refs == [f"ref {i}" for i in range(10)]
    run, longest = 0, 0
    for event in rec.events:
        run = 0 if event == "barrier" else run + 1
        longest = max(longest, run)
    assert longest <= 4 and window.barriers == 2
    assert [e for e in rec.events if e != "barrier"] == [f"send {i}" for i in range(10)]


async def test_a_failed_barrier_fails_its_caller_and_the_next_tries_again():
    rec = Recorder()
    window = DeliveryWindow(rec.barrier, size=1)
    assert await window.send(rec.submit(0)) == "ref 0"
    rec.fail_next = True
    rec.release.set()
    with pytest.raises(RuntimeError, match="actor gone"):
        await window.send(rec.submit(1))
    assert await window.send(rec.submit(2)) == "ref 2"  # its own barrier, which succeeds
    assert rec.events == ["send 0", "barrier", "barrier", "send 2"]


async def test_a_caller_cancelled_while_waiting_sends_nothing():
    rec = Recorder()
    window = DeliveryWindow(rec.barrier, size=1)
    await window.send(rec.submit(0))
    waiting = asyncio.create_task(window.send(rec.submit(1)))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    rec.release.set()
    assert await window.send(rec.submit(2)) == "ref 2"
    assert "send 1" not in rec.events


@pytest.mark.parametrize("bad", [0, -3, True, 1.5])
def test_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="size"):
        DeliveryWindow(lambda: asyncio.sleep(0), size=bad)
