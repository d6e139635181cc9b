"""The in-run recovery's one owner (docs/design.md §5.12): every part a run can lose, supervised the same way.

A part (a Gym replica, the generation worker, whatever is supervised later) implements ``SupervisedPart``:
``watch`` returns its next loss (its own watch, or a failure a rollout or a snapshot reported into the same
stream), ``replace`` stops what was lost and starts a successor by a deadline, ``give_up`` hands its work to
others or stops the run, ``resume`` brings its lost rollouts back, ``settle`` waits until the first of them
went out again. ``RecoverySupervisor`` runs one loop per part in a ``TaskGroup`` it owns, so different parts
recover side by side, and applies the same rules to all of them:

- one bound (``RecoveryBound``): a part started ``max_recoveries`` times within ``window_s`` is given up;
- one rule for a start that fails or runs past its deadline (``timeout_s``): it counts as one more start and
  is tried again while the bound allows;
- one row per recovery, always written: after its first re-dispatch, or with what is known when the run ends
  (or a start fails for good) meanwhile;
- one set of per-step metrics (``RecoveryMetrics``) for every configured logger.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Protocol

from nemo_rl.algorithms.single_controller_utils.config import InRunRecoveryConfig
from nemo_rl.algorithms.single_controller_utils.recovery.bound import RecoveryBound
from nemo_rl.algorithms.single_controller_utils.recovery.metrics import RecoveryMetrics
from nemo_rl.algorithms.single_controller_utils.recovery.records import Loss, RecoveryRecord
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords

logger = logging.getLogger(__name__)


class RecoveryFailed(RuntimeError):
    """A part could not be recovered within the bounds and nothing can take its work over: the run stops
    with one ``error:`` line naming the part, why, and its log."""


class NotPlaced(RuntimeError):
    """Ray cannot place the part's successor (its node, or the resources it asks for, are gone): the part is
    given up at once."""


class SupervisedPart(Protocol):
    """One part of a run that can be lost and recovered in place (see the module docstring)."""

    name: str  # the part, as rows name it: "<shard>/replica-<i>" or "generation"
    label: str  # as the log names it: "Gym <shard>/replica-<i>", "the generation worker"
    kind: str  # its metrics label: "gym_replica" or "generation"

    async def watch(self) -> Loss: ...

    async def replace(self, loss: Loss, deadline: float) -> str: ...  # the action; ``deadline``: time.monotonic()

    async def give_up(self, loss: Loss, why: str, record: RecoveryRecord) -> None: ...

    async def resume(self, loss: Loss, record: RecoveryRecord) -> None: ...

    async def settle(self, loss: Loss, record: RecoveryRecord) -> None: ...

    def line(self, record: RecoveryRecord) -> str: ...

    def gauges(self) -> dict[str, float]: ...


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


class RecoverySupervisor:
    """Owns one supervision loop per part and every recovery's row (``run`` is a task of the controller's)."""

    def __init__(self, settings: InRunRecoveryConfig, records: RunRecords, parts: list[SupervisedPart]):
        self.settings = settings
        self.records = records
        self.parts = list(parts)
        self.metrics = RecoveryMetrics()
        self.recovering: set[str] = set()  # parts whose recovery (replace + resume) is under way
        self._tasks: asyncio.TaskGroup | None = None

    async def run(self) -> None:
        """Supervise every part until cancelled; an error of any (a part that cannot be recovered) stops the
        others and is raised. Rows still waiting for their re-dispatch are written as they are."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            for part in self.parts:
                tasks.create_task(self._supervise(part), name=f"supervise:{part.name}")

    async def _supervise(self, part: SupervisedPart) -> None:
        bound = RecoveryBound(self.settings.max_recoveries, self.settings.window_s)
        alive = True
        while alive:
            loss = await part.watch()
            alive = await self._recover(part, loss, bound)

    async def _recover(self, part: SupervisedPart, loss: Loss, bound: RecoveryBound) -> bool:
        """One recovery: replace (or give up), then bring the rollouts back; the row follows once they went
        out again. Returns whether the part is still there to supervise."""
        logger.warning("%s lost %s: %s (noticed by its %s); recovering", part.label, loss.component, loss.cause,
                       loss.noticed_by)
        record = RecoveryRecord.begin(loss)
        self.recovering.add(part.name)
        self.metrics.started(part.kind)
        handed_on = False
        try:
            alive = await self._replace(part, loss, bound, record)
            await part.resume(loss, record)
            logger.warning("%s is back (%s); its row follows once its first lost work goes out again", part.label,
                           record.action)
            self.metrics.succeeded(part.kind, record.action)
            assert self._tasks is not None
            self._tasks.create_task(self._finish(part, loss, record), name=f"recovery-row:{part.name}")
            handed_on = True
            return alive
        except BaseException:
            self.metrics.failed(part.kind)
            raise
        finally:
            self.recovering.discard(part.name)
            if not handed_on:  # the run stops meanwhile: the row says what was done
                self._write(part, record)

    async def _replace(self, part: SupervisedPart, loss: Loss, bound: RecoveryBound,
                       record: RecoveryRecord) -> bool:
        """Start a successor within ``timeout_s``; a start that fails or runs past it counts as one more and
        is tried again until the bound, then the part is given up (so is one Ray cannot place)."""
        while True:
            why = bound.exhausted()
            if why is not None:
                await self._give_up(part, loss, why, record)
                return False
            bound.note()
            self.metrics.attempt(part.kind)
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.settings.timeout_s):
                    record.action = await part.replace(loss, started + self.settings.timeout_s)
                record.seconds_to_start = round(time.monotonic() - started, 3)
                return True
            except NotPlaced as exc:
                await self._give_up(part, loss, str(exc), record)
                return False
            except Exception as exc:  # noqa: BLE001 - a start that did not come up: one more, within the bound
                failed = describe(exc) if str(exc) or not isinstance(exc, TimeoutError) else (
                    f"its start did not finish within {self.settings.timeout_s:g} s "
                    "(rollout_recovery.in_run.timeout_s)")
                record.failed_starts.append(failed)
                logger.warning("%s did not start again (%s)", part.name, failed)

    async def _give_up(self, part: SupervisedPart, loss: Loss, why: str, record: RecoveryRecord) -> None:
        """The part is given up: its work moves elsewhere (``moved``), or, with nowhere to go, the run stops
        (``given_up``; the row is still written)."""
        if record.failed_starts:
            why = f"{why}; its last start failed: {record.failed_starts[-1]}"
        record.action, record.given_up = "given_up", why
        await part.give_up(loss, why, record)
        record.action = "moved"

    async def _finish(self, part: SupervisedPart, loss: Loss, record: RecoveryRecord) -> None:
        """The row once the first lost rollout (or call) went out again, or when the run ends first."""
        try:
            await part.settle(loss, record)
        finally:
            self._write(part, record)

    def _write(self, part: SupervisedPart, record: RecoveryRecord) -> None:
        self.records.recovery(record.row())
        self.metrics.row(part.kind, record)
        print(part.line(record), file=sys.stderr, flush=True)

    # -- what the controller reads
    def step_metrics(self) -> dict[str, float]:
        """The per-step metrics row's recovery fields (docs/usage.md), with every part's gauges."""
        out = self.metrics.take(self.recovering)
        for part in self.parts:
            out.update(part.gauges())
        return out

    def counts(self) -> dict[str, int]:
        """Recoveries so far by part kind (the run's summary)."""
        return dict(self.metrics.by_kind)

    def add(self, part: SupervisedPart) -> None:
        """Supervise one more part from now on (a part started mid-run)."""
        self.parts.append(part)
        if self._tasks is not None:
            self._tasks.create_task(self._supervise(part), name=f"supervise:{part.name}")


def took(record: RecoveryRecord) -> str:
    """`` in 2.1 s`` (seconds to the first re-dispatch) for a recovery's line, or nothing."""
    return f" in {record.seconds_to_redispatch:.1f} s" if record.seconds_to_redispatch is not None else ""
