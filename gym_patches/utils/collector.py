"""Keeping Python's cyclic garbage collector out of a snapshot's pause.

A full collection walks every tracked object; in a process holding a run's
ledger, samples and imported libraries that is 100-200 ms, and it lands
wherever allocation happens to trip it, also inside the few milliseconds
rollouts are held. Reference counting still frees almost everything while
the collector is held off; the held window is short and always released.

A Gym server holding thousands of rollouts has a heap that keeps growing while
a step's runs are admitted, and Python starts a full collection each time the
old generation has grown by a quarter: 0.2-1 s each in a replica holding 8,192
rollouts, a dozen of them while a step is admitted, and almost nothing found
(the rollouts' state is acyclic, freed by reference counting). A prepare that
arrives meanwhile waits for it. So a Gym server's automatic collection stays
young (``young_collections_only``: cycles that die young, most of them, are
still found at once) and ``FullCollections`` runs the full walk on a timer,
never while the collector is held (docs/design.md §4.5, "Paced turns").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import Iterator

from gym_patches.utils.cancellation import outlast_cancellation

logger = logging.getLogger(__name__)

# A generation-2 threshold no run reaches: automatic collection never walks the old generation.
_NEVER = 2**31 - 1
# Often enough that cyclic garbage which outlived the young generations is freed within minutes; rare
# enough that the walk (up to about a second at 8,192 rollouts in flight) is a small share of the loop.
DEFAULT_FULL_COLLECTION_INTERVAL_S = 120.0


class CollectorHold:
    """Holds off cyclic collection between ``hold()`` and ``release()`` (idempotent, never nested)."""

    def __init__(self) -> None:
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def hold(self) -> None:
        if not self._held and gc.isenabled():
            gc.disable()
            self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            gc.enable()


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """``with collector_held():`` no cyclic collection inside, restored on any exit."""
    hold = CollectorHold()
    hold.hold()
    try:
        yield
    finally:
        hold.release()


def freeze_startup_objects() -> None:
    """Move everything alive now (imports, the model, config) out of every later collection's walk."""
    gc.collect()
    gc.freeze()


_young_only_holders: list[tuple[int, int, int]] = []  # the thresholds before the first holder


def young_collections_only() -> None:
    """Automatic collection walks generations 0 and 1 only; a full walk runs when called for. Undone
    by the matching ``restore_collections`` (counted: several servers may share a test process)."""
    thresholds = gc.get_threshold()
    if not _young_only_holders:
        gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
    _young_only_holders.append(thresholds)


def restore_collections() -> None:
    """The last holder gone, automatic collection walks every generation again, as before the first."""
    if _young_only_holders:
        thresholds = _young_only_holders.pop()
        if not _young_only_holders:
            gc.set_threshold(*thresholds)


class FullCollections:
    """Runs ``gc.collect()`` every ``interval_s`` on the running loop, skipping a round while the
    collector is held (``CollectorHold``: rollouts are held right now). Owned by its server:
    ``start()`` on startup, ``stop()`` on cleanup."""

    def __init__(self, interval_s: float = DEFAULT_FULL_COLLECTION_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"FullCollections interval_s must be positive, got {interval_s!r}")
        self.interval_s = interval_s
        self.runs = 0  # full collections done
        self.skipped = 0  # rounds skipped while held
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="full gc collections")

    async def stop(self) -> None:
        """Cancel the loop and wait until it has ended; a cancellation of the caller meanwhile is raised
        once it has (never swallowed: ``utils.cancellation``)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await outlast_cancellation(task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.collect_now()

    def collect_now(self) -> bool:
        """One full collection unless the collector is held; whether it ran."""
        if not gc.isenabled():
            self.skipped += 1
            return False
        started = time.perf_counter()
        found = gc.collect()
        self.runs += 1
        logger.debug("full collection: %d objects in %.3f s", found, time.perf_counter() - started)
        return True
