"""Snapshot coverage: the share of a run's wall time in which a crash would lose little.

A moment is covered when no rollout is in flight, or when the newest snapshot a
restore could use was taken at most two snapshot intervals earlier: a crash then
restores every rollout in flight from it (those started after it restart from
their prompt, having run less than two intervals). The run's start (or restore)
counts as a snapshot: nothing had run before it. Uncovered are the moments
rollouts are in flight while snapshots are skipped, failing, or gone with a
pruned anchor. Time is integrated exactly between events (dispatch, rollout
end, publish, prune), so no sampler runs.
"""

from __future__ import annotations

import math
import time
from typing import Callable


class SnapshotCoverage:
    def __init__(self, interval_s: float | None, clock: Callable[[], float] = time.monotonic):
        self.window_s = 2.0 * interval_s if interval_s else 0.0  # 0: snapshots are off, nothing is covered
        self.clock = clock
        self.started = self.last = clock()
        self.busy = False
        self.taken_at = self.started  # when the newest usable snapshot was taken (the start: nothing to lose)
        self.taken_anchor: int | None = None
        self.uncovered_s = 0.0

    def _advance(self) -> None:
        now = self.clock()
        if self.busy:
            stale_from = max(self.last, self.taken_at + self.window_s)
            self.uncovered_s += max(0.0, now - stale_from)
        self.last = now

    def in_flight(self, count: int) -> None:
        """The number of rollouts in flight changed to ``count``."""
        if self.busy != (count > 0):
            self._advance()
            self.busy = count > 0

    def committed(self, taken_at: float, anchor_step: int) -> None:
        """A snapshot taken at ``taken_at`` (this clock) under ``anchor_step`` was published: usable from now."""
        self._advance()
        if taken_at > self.taken_at:
            self.taken_at, self.taken_anchor = taken_at, anchor_step

    def pruned(self, kept: Callable[[int], bool]) -> None:
        """Trainer anchors were pruned; ``kept(step)`` says whether one is still on disk."""
        if self.taken_anchor is not None and not kept(self.taken_anchor):
            self._advance()
            self.taken_at, self.taken_anchor = -math.inf, None

    def share(self) -> float:
        """Covered share of the wall time so far (1.0 at the start)."""
        self._advance()
        total = self.last - self.started
        return round(1.0 - self.uncovered_s / total, 4) if total > 0 else 1.0
