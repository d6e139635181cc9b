"""Keeping Python's cyclic garbage collector out of a snapshot's pause.

A full collection walks every tracked object; in a process holding a run's
ledger, samples and imported libraries that is 100-200 ms, and it lands
wherever allocation happens to trip it, also inside the few milliseconds
rollouts are held. Reference counting still frees almost everything while
the collector is held off; the held window is short and always released.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


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
