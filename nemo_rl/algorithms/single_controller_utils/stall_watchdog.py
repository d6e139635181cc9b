"""``async_rl.stall_watchdog``: notice when no rollout progresses, and say what is stuck.

Progress is any ledger transition (a rollout sealed, failed or refused) or any
Gym call that began since the last look (a model reply or tool result that came
back lets the agent start its next call). Every ``interval_s`` while rollouts
are in flight the watchdog asks every agent of every replica what its runs are
doing (``GET /ng-activity/v1/runs``, short timeout). When nothing progressed for
``stall_timeout_s`` it reports the stuck calls grouped by replica, phase and the
server waited on, e.g. ``16 rollouts in a tool call to 'workplace_assistant' on
nemo_gym/replica-0 (oldest 240 s)``, and agents that did not answer; then it
warns (once per ``stall_timeout_s``) or stops the run (``stall_action: abort``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Mapping

from gym_patches.activity import summary_lines
from nemo_rl.algorithms.single_controller_utils.config import StallWatchdogConfig

logger = logging.getLogger(__name__)
# Replica -> agent -> its activity (``AgentActivity``), or why it did not answer (a string).
ActivityReport = Mapping[str, Mapping[str, Any]]
_SHOWN_KEYS = 5


class RolloutStallError(RuntimeError):
    """No rollout progressed for ``async_rl.stall_watchdog.stall_timeout_s`` (``stall_action: abort``)."""


def latest_call_start(report: ActivityReport, now: float) -> float | None:
    """When the most recent Gym call of any run began (on ``now``'s clock), or None without runs."""
    starts = [now - run.since_s for agents in report.values() for activity in agents.values()
              if not isinstance(activity, str) for run in activity.runs]
    return max(starts) if starts else None


def describe_stall(report: ActivityReport, stalled_for_s: float) -> str:
    """What is stuck, for a person: per replica, the agents that did not answer and the runs
    grouped by phase and the server they wait on (``gym_patches.activity.summary_lines``)."""
    parts = [f"{iid}: {line}" for iid, agents in sorted(report.items())
             for line in summary_lines(agents, max_keys=_SHOWN_KEYS)]
    what = "; ".join(parts) if parts else "no Gym agent reports a run in flight"
    return f"no rollout progressed for {stalled_for_s:.0f} s: {what}"


class StallWatchdog:
    """Owned by the controller's task group: ``run`` loops until cancelled, or raises on a stall."""

    def __init__(
        self,
        settings: StallWatchdogConfig,
        *,
        in_flight: Callable[[], int],
        transitions: Callable[[], int],
        activity: Callable[[], Awaitable[ActivityReport]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self._in_flight = in_flight
        self._transitions = transitions
        self._activity = activity
        self._clock = clock
        self.stalls_reported = 0

    async def run(self) -> None:
        settings = self.settings
        last_progress = self._clock()
        seen = self._transitions()
        newest_call: float | None = None
        warned_at: float | None = None
        while True:
            await asyncio.sleep(settings.interval_s)
            now = self._clock()
            if not self._in_flight():
                last_progress, seen, newest_call, warned_at = now, self._transitions(), None, None
                continue
            report = await self._activity()
            now = self._clock()
            count = self._transitions()
            started = latest_call_start(report, now)
            # A call that began after the newest one seen (beyond rounding of since_s) is progress.
            moved = started is not None and (newest_call is None or started > newest_call + 0.5)
            if count != seen or moved:
                last_progress, seen, warned_at = now, count, None
                newest_call = started if started is not None else newest_call
                continue
            stalled_for = now - last_progress
            if stalled_for < settings.stall_timeout_s:
                continue
            message = describe_stall(report, stalled_for)
            if settings.stall_action == "abort":
                raise RolloutStallError(f"{message} (async_rl.stall_watchdog.stall_action=abort)")
            if warned_at is None or now - warned_at >= settings.stall_timeout_s:
                warned_at = now
                self.stalls_reported += 1
                logger.warning("%s (async_rl.stall_watchdog.stall_action=warn: the run goes on)", message)
