"""The snapshotter: one attempt, read top to bottom.

gate -> prepare -> stage -> resume -> write -> publish. The stager
(``stagers.py``) decides what each step does for this run's mode; the run store
(``store.py``: ``RunStore``) makes, publishes and removes the snapshot's
directory; this module owns the order, the dispatch gate, the failure count and
the record.

A trainer step published while an attempt runs does not drop it
(docs/design.md §5.9): a snapshot paused after the publish belongs to the new step
(the stager re-anchors it), one taken before stays under its own anchor, which
pruning spares (the run store holds the newest committed snapshot for a relaunch:
``RELAUNCH``). The row names the step in ``overtaken_by``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Awaitable, Callable

from nemo_rl.algorithms.single_controller_utils.config import RolloutCheckpointConfig
from nemo_rl.algorithms.single_controller_utils.dispatch import DispatchGate, LedgerChanges
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.inputs import SnapshotInputs
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.outcome import (
    SnapshotOutcome,
    classify_failure,
    survives_publish,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import StagedSnapshot, make_stager
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import REPLICA_HOLD, GymCheckpointIndex, RunStore
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.utils.run_hooks import RunHooks

logger = logging.getLogger(__name__)
RELAUNCH = "relaunch"  # the run store's holder of the newest committed snapshot: what a relaunch restores


class RolloutSnapshotter:
    """Takes snapshots for one controller; counts consecutive failures."""

    def __init__(
        self,
        inputs: SnapshotInputs,
        coordinator: GymCheckpointCoordinator | None,
        records: RunRecords,
        settings: RolloutCheckpointConfig,
        changes: LedgerChanges,
        store: RunStore,
        hooks: RunHooks | None = None,
        recovers: Callable[[BaseException], Awaitable[bool]] | None = None,  # a loss being recovered (§5.12)
    ):
        self.inputs = inputs
        self.records = records
        self.settings = settings
        self.hooks = hooks or RunHooks()
        self.store = store  # the run's, with its writer
        self.gate = DispatchGate(changes)  # owned here; the controller reads it
        self.stager = make_stager(settings.commit_mode, inputs, self.hooks, coordinator, self.gate, changes,
                                  self.store)
        # Held for a whole attempt: pruning old trainer anchors waits for it, so a snapshot still
        # being written under an anchor (it runs past the step's end) never loses its directory; the
        # newest published snapshot is held in the store (``RELAUNCH``) before it is released.
        self.busy = asyncio.Lock()
        self.consecutive_failures = 0
        self.recovers = recovers

    async def attempt(self, requested: str | None = None, *, final: bool = False) -> "SnapshotOutcome":
        """One snapshot. The pause covers the stage only; the write and the publish follow the resume.
        The pump awaits this, so at most one snapshot is ever being written. ``final``: a stop's last
        snapshot, whose retries the stop's grace bounds: failures in a row do not raise."""
        async with self.busy:
            # Before the attempt begins (gate open, nothing held): what changed since the last snapshot goes
            # into the ledger's pause views now, so the pause takes references to them (docs/design.md §5.4).
            self.inputs.ledger.refresh_pause_views()
            begun_under = self.inputs.anchor_step()  # the capture may belong to a newer one (``stage``)
            outcome = SnapshotOutcome(f"rollout-{uuid.uuid4().hex[:12]}", self.stager.mode, self.inputs.step(),
                                      anchor_step=begun_under)
            outcome.requested = requested  # a signal asked for it (SIGUSR1, or the stop's final one)
            try:
                async with self.stager.hold(outcome.checkpoint_id) as prepared:  # gate closed, Gym prepared
                    outcome.mark("prepare")
                    staged = await self.stager.stage(prepared, outcome)
                    outcome.mark("cut")  # the record's phase name (a format: kept)
                outcome.pause_s = outcome.elapsed()  # Gym resumed, the gate open again
                outcome.mark("resume")
                await self._write_and_publish(staged, outcome)
                outcome.reason = "committed"
                self.consecutive_failures = 0
                self._note_overtaken(begun_under, outcome)
            except BaseException as exc:
                self._failed(outcome, exc, final, recovering=await self._recovering(exc))
            finally:
                if not outcome.pause_s:
                    outcome.pause_s = outcome.elapsed()
                if outcome.reason:
                    self.records.snapshot_attempt(**outcome.row())
            return outcome

    async def _write_and_publish(self, staged: StagedSnapshot, outcome: SnapshotOutcome) -> None:
        """Gym writes what it has not yet, then the controller's files are written and the directory
        is sealed and renamed off the event loop: only a complete write becomes a snapshot."""
        try:
            self.hooks.reached("persist", staged.step)  # rollouts resumed, this snapshot not written
            index = await self.stager.write(staged, outcome)
            if index is not None:
                index = index.model_copy(update={"carried": self._carried(index)})
            await asyncio.to_thread(self.store.publish, staged.snapshot, staged.capture, index, staged.checkpoint_id,
                                    lambda: self.hooks.reached("publish", staged.step))
        except BaseException:
            self.store.abort(staged.snapshot)
            raise
        outcome.committed, outcome.path = True, str(staged.snapshot.final)
        outcome.saved_on = sorted(index.exported()) if index is not None else []
        self.store.hold(RELAUNCH, staged.snapshot.final)
        for iid in index.turn_level if index is not None else ():  # it took part: its newest snapshot now
            self.store.hold(REPLICA_HOLD + iid, staged.snapshot.final)
        outcome.mark("publish")

    def _carried(self, index: GymCheckpointIndex) -> dict[str, str]:
        """Replicas left out of this snapshot -> the older one that holds their rollouts (held in the store
        until a newer snapshot saves them): a restore installs their saved episodes from there."""
        return {iid: self.store.relative(path) for iid, (path, _) in self.store.holders(REPLICA_HOLD).items()
                if iid not in index.turn_level}
        outcome.persist_s = outcome.elapsed() - outcome.pause_s

    def _note_overtaken(self, begun_under: int, outcome: SnapshotOutcome) -> None:
        """A trainer step published since the attempt began: say so in the row (the snapshot stands)."""
        now = self.inputs.anchor_step()
        if now == begun_under:
            return
        outcome.overtaken_by = now
        how = ("re-anchored to it: paused after its publish" if outcome.anchor_step == now
               else f"kept under step {outcome.anchor_step}: paused before its publish")
        logger.info("rollout snapshot %s began under trainer step %d; step %d was published meanwhile (%s)",
                    outcome.checkpoint_id, begun_under, now, how)

    async def _recovering(self, exc: BaseException) -> bool:
        """Whether a Gym failure met a loss the in-run recovery owns (asked of it, at most a moment)."""
        if self.recovers is None or not isinstance(exc, Exception) or classify_failure(exc) != "gym_unavailable":
            return False
        return await self.recovers(exc)

    def _failed(self, outcome: SnapshotOutcome, exc: BaseException, final: bool = False,
                recovering: bool = False) -> None:
        """Record the failure; raise what must stop the run (a bug, a fatal error, too many in a row)."""
        if outcome.committed:
            # Published: the snapshot stands. Record what failed after it, then let fatal errors stop the run.
            outcome.reason = "committed"
            outcome.post_publish_error = f"{type(exc).__name__}: {exc}"
            self.consecutive_failures = 0
            if survives_publish(exc):
                return
            raise exc
        outcome.failed(exc)
        if outcome.reason == "invariant_error" or not isinstance(exc, Exception):
            raise exc
        logger.warning("rollout snapshot %s failed (%s): %s", outcome.checkpoint_id, outcome.reason, exc)
        if outcome.reason == "superseded":  # not a failure: the next step's snapshots follow
            return
        if recovering:  # it met a replica being recovered, or a server its watch reports: not a failure in a row
            return
        self.consecutive_failures += 1
        limit = self.settings.max_consecutive_failures
        if self.consecutive_failures >= limit and not final:
            raise RuntimeError(
                f"{self.consecutive_failures} consecutive rollout snapshots failed "
                f"(rollout_checkpointing.max_consecutive_failures={limit}); last error: {exc}"
            ) from exc
