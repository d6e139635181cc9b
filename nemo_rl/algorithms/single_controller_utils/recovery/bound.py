"""The one bound on recoveries (docs/design.md §5.12): a part recovered ``max_recoveries`` times within
``window_s`` is given up at its next loss; every start that does not come up counts as one more."""

from __future__ import annotations

import collections
import time


class RecoveryBound:
    """A sliding window of one part's recovery starts."""

    def __init__(self, max_recoveries: int, window_s: float):
        self.max_recoveries, self.window_s = max_recoveries, window_s
        self._starts: collections.deque[float] = collections.deque()

    def note(self) -> None:
        """A start of this part (a recovery, or a retry of a start that did not come up)."""
        self._starts.append(time.monotonic())

    def exhausted(self) -> str | None:
        """Why the part is given up now, or None while another start is allowed."""
        now = time.monotonic()
        while self._starts and now - self._starts[0] > self.window_s:
            self._starts.popleft()
        if len(self._starts) < self.max_recoveries:
            return None
        return (f"recovered {len(self._starts)} times within {self.window_s:g} s "
                f"(rollout_recovery.in_run.max_recoveries={self.max_recoveries})")
