"""Gym replicas being reopened in the background after they left a snapshot.

A replica that left a snapshot, or whose resume failed, is resumed by a task while the run goes on
and sits snapshots out until that task ends (docs/design.md §5.8, "No stale checkpoint left
active"). This object owns those tasks: it reads how each finished one ended and logs an error
instead of dropping it, and ``aclose`` cancels and awaits the rest when the run ends.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nemo_rl.algorithms.single_controller_utils.prepare_rounds import finished_error

logger = logging.getLogger(__name__)


@dataclass
class _Reopening:
    iid: str
    task: asyncio.Task
    why: str  # why the replica left: the reason it sits snapshots out while this runs


class Reopenings:
    def __init__(self) -> None:
        self._tasks: list[_Reopening] = []

    def adopt(self, iid: str, task: asyncio.Task, why: str) -> None:
        """Own ``task``, which reopens ``iid`` (it left for ``why``)."""
        self._tasks.append(_Reopening(iid, task, why))

    def running(self) -> dict[str, str]:
        """Replica -> why it left, for each still being reopened; the finished ones are reaped first."""
        for done in [r for r in self._tasks if r.task.done()]:
            self._tasks.remove(done)
            self._report(done)
        return {r.iid: r.why for r in self._tasks}

    async def wait(self, timeout_s: float) -> None:
        """Until every replica being reopened now is reopened, or ``timeout_s`` passed (a stop's final
        snapshot retries once they are back, docs/design.md §5.11)."""
        tasks = [r.task for r in self._tasks if not r.task.done()]
        if tasks and timeout_s > 0:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def aclose(self) -> None:
        """Stop reopening (the run is ending; the replicas' leases reopen them) and read each end."""
        tasks, self._tasks = self._tasks, []
        for reopening in tasks:
            reopening.task.cancel()
        await asyncio.gather(*(r.task for r in tasks), return_exceptions=True)
        for reopening in tasks:
            self._report(reopening)

    @staticmethod
    def _report(reopening: _Reopening) -> None:
        """A failed resume call is logged by ``resume`` itself and retried before the next prepare;
        what reaches here is an error of the task (a lost actor, a bug): logged, naming the replica."""
        exc = finished_error(reopening.task)
        if exc is not None:
            logger.error("reopening %s after it left a snapshot failed (%s): %s: %s", reopening.iid,
                         reopening.why, type(exc).__name__, exc)
