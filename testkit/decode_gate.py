"""A torch generation worker whose decoding the caller meters out, step by step (a named test seam).

A benchmark or test that must see calls still decoding at some event (two snapshots, a crash read)
cannot make them "long enough": a fast machine finishes them first, a slow one makes the test long.
``GatedGenerationServer`` is the real ``GenerationServer`` with one addition: before each decode step
the decode thread takes one step of credit, and waits while there is none. The caller grants credit
(``grant``), learns when the thread is waiting (``wait_held``) and lets it run freely (``open``), so the
order of events is fixed by the caller, whatever the machine's speed. Nothing else differs: batches,
the cut routes and refits are the product's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import ray

from nemo_rl.models.generation.worker import GenerationServer

__all__ = ["GatedGenerationServer", "GatedGenerationWorker"]


class GatedGenerationServer(GenerationServer):
    """``GenerationServer`` whose decode steps are metered: each step costs one credit (``None``: open)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gate = threading.Condition()
        self._credit: int | None = 0  # closed from the start: the caller grants the first steps
        self._waiting = False

    def _between_steps(self) -> None:
        with self._gate:
            while self._credit is not None and self._credit <= 0:
                self._waiting = True
                self._gate.notify_all()
                self._gate.wait()
            self._waiting = False
            if self._credit is not None:
                self._credit -= 1
        super()._between_steps()

    async def grant(self, steps: int) -> None:
        """Let the decode thread take ``steps`` more steps (then it waits again)."""
        with self._gate:
            self._credit = (self._credit or 0) + int(steps)
            self._gate.notify_all()

    async def open(self) -> None:
        """No more metering: every step runs (the calls in flight decode to their end)."""
        with self._gate:
            self._credit = None
            self._gate.notify_all()

    async def close_gate(self) -> None:
        """Meter again from zero credit: the decode thread stops at its next step boundary."""
        with self._gate:
            self._credit = 0

    async def wait_held(self, timeout_s: float = 120.0) -> bool:
        """Wait until the decode thread is waiting for credit with none left (True), or ``timeout_s`` passed
        (False: it is between batches, or decoding). Polls: the wait is on another thread's condition."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._gate:
                if self._waiting and self._credit is not None and self._credit <= 0:
                    return True
            await asyncio.sleep(0.005)
        return False

    async def credit(self) -> int | None:
        with self._gate:
            return self._credit


GatedGenerationWorker = ray.remote(GatedGenerationServer)
