"""Restore: the newest durable trainer step, its newest usable rollout snapshot, Gym's saved episodes.

``RunRestorer.restore`` selects once (``find_restore_point``: ``RunStore.select``),
reads and validates once (``RunStore.read_step`` and ``RunStore.read``), asks Gym to install what it saved,
applies the restart rules of the ledger (docs/design.md §5.5) and returns a
``RestoredState``; the controller only assigns it. When the relaunch runs fewer
replicas of a shard, the saved episodes of the replicas that no longer run are
installed on the shard's others (``reshard.plan_restore``, §5.7).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.install import (
    InstalledEpisodes,
    SavedIn,
    install_episodes,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.reshard import replica_counts
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import (
    CONTROLLER_STATE_FILE,
    REPLICA_HOLD,
    GymCheckpointIndex,
    RestorePoint,
    RunStore,
    SnapshotContents,
    select_restore_point,
)
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.experience.rollout_recovery.restart import RestartSummary
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.utils.run_identity import record_replicas, replica_changes
from nemo_rl.utils.snapshot_store import SnapshotStoreError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreLookup:
    """A start's one lookup of what to restore (``find_restore_point``); ``point`` None: a new run.

    The runner takes it before anything starts and hands it to everything that needs it (the
    finished-run check, the policy's weights, the controller's restore), so the chosen checkpoint
    is hashed once per start."""

    point: RestorePoint | None


def find_restore_point(checkpoint_dir: Path, *, turn_level: bool, read_snapshots: bool) -> RestoreLookup:
    """The newest intact trainer step (only it is hashed) and its newest snapshot that verifies and
    holds every file this run needs; ``read_snapshots=False`` (restore_mode=trainer_checkpoint)
    leaves the snapshots unread (``RunStore.select``)."""
    return RestoreLookup(select_restore_point(checkpoint_dir, turn_level=turn_level, read_snapshots=read_snapshots))


@dataclass(frozen=True)
class RestoredState:
    """Where a restarted run continues: the controller takes these as they are."""

    step: int  # the trainer step restored (its anchor is where new snapshots go)
    ledger: RolloutRecoveryLedger
    dataloader: dict[str, Any] | None  # the dataloader's state; None: from the start
    data_plane: DataPlaneStore  # the sealed samples the snapshot held (empty without one)
    record: dict[str, Any]  # restore.json
    message: str  # one line for the console
    metrics_row: dict[str, Any] | None = None  # the restored step's metrics row (see TrainerBookkeeping)


def _without(exported: dict[str, dict[str, list[str]]], rollout_ids: set[str]) -> dict[str, dict[str, list[str]]]:
    """Gym's saved episodes, less those of ``rollout_ids`` (groups a newer trainer step trained)."""
    if not rollout_ids:
        return exported
    kept = {iid: {server: [k for k in keys if EpisodeId.from_capture_key(k).rollout_id not in rollout_ids]
                  for server, keys in by_server.items()} for iid, by_server in exported.items()}
    return {iid: by_server for iid, by_server in kept.items() if any(by_server.values())}


@dataclass(frozen=True)
class _TrainerState:
    """What the restored trainer step kept beside its weights (a fresh ledger at step 0)."""

    step: int
    ledger: RolloutRecoveryLedger
    dataloader: dict[str, Any] | None
    metrics_row: dict[str, Any] | None


def _saved_in(path: str, index: GymCheckpointIndex, saved: dict[str, dict[str, list[str]]],
              dropped: set[str]) -> SavedIn:
    """One snapshot's episodes to install, less the groups trained since (``dropped``), and which of them replay."""
    kept = _without(saved, dropped)
    keys = {k for by_server in kept.values() for ks in by_server.values() for k in ks}
    replay = {k for iid in kept for k in index.replayed_keys(iid)} & keys
    return SavedIn(path, index, kept, frozenset(replay))


def _prefix_cuts(summary: RestartSummary, gym: InstalledEpisodes) -> dict[str, int]:
    """Restored rollouts whose model call in flight was cut -> the tokens cut: their next call
    continues from them (docs/design.md §5.10)."""
    return {key: gym.cuts[key] for key in summary.restored_turn if gym.cuts.get(key)}


def _snapshot_fields(snap: SnapshotContents, ledger: RolloutRecoveryLedger, dropped_groups: list[str],
                     summary: RestartSummary, gym: InstalledEpisodes, prefix: dict[str, int]) -> dict[str, Any]:
    """``restore.json``'s fields for a restored snapshot, in their order."""
    return dict(
        snapshot=str(snap.path),
        snapshot_anchor_step=snap.state.anchor,
        snapshot_step=snap.state.step,
        dropped_trained_groups=len(dropped_groups),  # the restored step trained them after the snapshot
        retrained_groups=len(ledger.complete_groups()),  # taken by the trainer after the anchor: trained again
        restored_turn=len([k for k in summary.restored_turn if k not in gym.replayed]),
        restored_replay=len(gym.replayed),  # continued by replay: fresh sessions, recorded calls played back
        restored_prefix=len(prefix),
        prefix_tokens=sum(prefix.values()),
        restored_prefix_tokens=prefix,
        restarted_from_prompt=len(summary.restarted_from_prompt),
        kept_siblings=len(summary.kept_siblings),
        redone_groups=len(summary.redone_groups),
        restored_rollout_ids=summary.restored_turn,
        replayed_rollout_ids=sorted(gym.replayed),
        restored_instances={key: gym.restored_on[key] for key in summary.restored_turn},
        moved_rollouts={key: {"from": gym.saved_on[key], "to": gym.restored_on[key]}
                        for key in summary.restored_turn if gym.saved_on[key] != gym.restored_on[key]},
        not_portable_rollouts=gym.not_portable,  # a vanished replica's, restarted from the prompt
        carried_snapshots=dict(snap.gym.carried) if snap.gym is not None else {},  # replicas it left out
        restarted_rollout_ids=summary.restarted_from_prompt,
        kept_rollout_ids=summary.kept_siblings,
    )


def _snapshot_message(snap: SnapshotContents, step: int, record: dict[str, Any], gym: InstalledEpisodes) -> str:
    """The console's one line for a restored snapshot (and the replicas it moved off, if any)."""
    message = (f"Restored rollout snapshot {snap.path.name} (under step {snap.state.anchor}) at step {step}: "
               f"{record['retrained_groups']} complete groups to train, {record['restored_turn']} continue at "
               f"turn level, " + (f"{record['restored_replay']} by replay, " if record['restored_replay'] else "")
               + f"{record['restarted_from_prompt']} restart from the prompt, {record['kept_siblings']} sealed kept.")
    if record["moved_rollouts"] or gym.not_portable:
        message += (f" {len(record['moved_rollouts'])} saved on replicas that no longer run continue on their "
                    f"shard's others ({len(gym.not_portable)} restart from the prompt: records not portable).")
    return message


class RunRestorer:
    """Restores one run directory; ``load_trainer(anchor)`` loads the trainer and returns its bookkeeping."""

    def __init__(
        self,
        checkpoint_dir: Path,
        *,
        read_snapshots: bool,  # rollout_checkpointing.restore_mode == "latest"
        coordinator: GymCheckpointCoordinator | None,  # None: ledger-only snapshots (no Gym index)
        max_attempts_per_sibling: int,
        load_trainer: Callable[[Path], Awaitable[dict[str, Any]]],
        hooks: RunHooks,
        store: RunStore,  # the run's, with its writer
    ):
        self.checkpoint_dir = checkpoint_dir
        self.store = store
        self.read_snapshots = read_snapshots
        self.coordinator = coordinator
        self.max_attempts = max_attempts_per_sibling
        self.load_trainer = load_trainer
        self.hooks = hooks

    def _ledger(self, state: dict[str, Any] | None) -> RolloutRecoveryLedger:
        """A saved ledger under this run's retry budget (the config may have changed since)."""
        ledger = RolloutRecoveryLedger(self.max_attempts)
        if state is not None:
            ledger.load_state_dict(state)
            ledger.max_attempts_per_sibling = self.max_attempts
        return ledger

    def _record_replicas(self, record: dict[str, Any]) -> None:
        """``resharded`` (shard -> {from, to}) in ``restore.json``, and the new counts in the run identity."""
        if self.coordinator is None:
            return
        now = replica_counts(self.coordinator.instance_ids)
        record["resharded"] = replica_changes(self.checkpoint_dir, now)
        if record["resharded"]:
            record_replicas(self.checkpoint_dir, now)

    async def restore(self, lookup: RestoreLookup | None = None) -> RestoredState | None:
        """None: nothing to restore (a new run). ``lookup``: the start's lookup, if the runner took it.

        The plan, step by step: select; load the trainer; without a snapshot, restart what was in
        flight from its prompt; else read the snapshot, drop what the trainer step trained since, let
        Gym install its saved episodes (resharded onto the replicas that run now), apply the ledger's
        restart rules and record it all in ``restore.json``."""
        turn_level = self.coordinator is not None
        point = self._select(lookup, turn_level)
        if point is None:
            return None
        trainer = await self._load_trainer(point)
        record = self._first_record(point)
        if point.snapshot.path is None:
            return self._from_trainer_only(point, trainer, record)
        snap = self._read_snapshot(point.snapshot.path, turn_level, trainer.step)
        ledger, dropped_groups, dropped = self._adopt_snapshot_ledger(snap, trainer)
        sources = self._sources(snap, ledger, set(dropped))
        gym = await self._restore_gym(sources)
        self.hooks.reached("restore")  # Gym restored, the ledger not applied
        summary = ledger.bring_back(gym.attempts, gym.relocated)
        snap.data_plane.discard(summary.discarded_rollout_ids)
        prefix = _prefix_cuts(summary, gym)
        record.update(_snapshot_fields(snap, ledger, dropped_groups, summary, gym, prefix))
        message = _snapshot_message(snap, trainer.step, record, gym)
        self._record_replicas(record)
        self._hold(sources)
        return RestoredState(trainer.step, ledger, snap.state.dataloader, snap.data_plane, record, message,
                             trainer.metrics_row)

    def _select(self, lookup: RestoreLookup | None, turn_level: bool) -> RestorePoint | None:
        """The start's restore point (selected here when the runner did not); the trainer steps it
        skipped are logged first, before anything loads, so a skipped step shows before a failing load."""
        if lookup is None:
            lookup = RestoreLookup(self.store.select(turn_level=turn_level, read_snapshots=self.read_snapshots))
        point = lookup.point
        if point is not None:
            for path, why in point.skipped:
                logger.warning("skipping trainer checkpoint %s: %s", path, why)
        return point

    async def _load_trainer(self, point: RestorePoint) -> _TrainerState:
        """The trainer's weights and optimizer are loaded and its bookkeeping read; step 0 (snapshots
        but no trainer step yet) loads nothing and starts from a fresh ledger."""
        if point.step <= 0:
            return _TrainerState(0, self._ledger(None), None, None)
        kept = self.store.read_step(point.anchor, await self.load_trainer(point.anchor))
        return _TrainerState(kept.step, self._ledger(kept.ledger), kept.dataloader, kept.metrics_row)

    def _first_record(self, point: RestorePoint) -> dict[str, Any]:
        """``restore.json`` before any snapshot is applied (the fields a trainer-only restore writes
        too, in their order); the skipped snapshots are logged as they are recorded."""
        selection = point.snapshot
        for path, why in selection.skipped:
            logger.warning("skipping rollout snapshot %s: %s", path, why)
        return {
            "trainer_step": point.step,
            "snapshot": None,
            "skipped_snapshots": [{"path": str(p), "reason": r} for p, r in selection.skipped],
            "skipped_trainer_steps": [{"path": str(p), "reason": r} for p, r in point.skipped],
            "restored_turn": 0,
            "restored_replay": 0,
            "restored_prefix": 0,
            "prefix_tokens": 0,
            "restarted_from_prompt": 0,
            "kept_siblings": 0,
        }

    def _from_trainer_only(self, point: RestorePoint, trainer: _TrainerState,
                           record: dict[str, Any]) -> RestoredState:
        """No snapshot to read (none valid, or restore_mode=trainer_checkpoint): anything the trainer
        state still counts as in flight restarts from its prompt."""
        summary = trainer.ledger.bring_back(set())
        why = ("rollout_checkpointing.restore_mode=trainer_checkpoint: rollout snapshots are not read"
               if not self.read_snapshots else "no valid rollout snapshot")
        record.update(restarted_from_prompt=len(summary.restarted_from_prompt),
                      kept_siblings=len(summary.kept_siblings), snapshot_reason=why)
        self._record_replicas(record)
        return RestoredState(trainer.step, trainer.ledger, trainer.dataloader, DataPlaneStore(), record,
                             f"Resuming from trainer checkpoint step {point.step} ({why}).", trainer.metrics_row)

    def _read_snapshot(self, path: Path, turn_level: bool, step: int) -> SnapshotContents:
        """The selected snapshot, read and validated; one taken under a newer trainer step than the one
        restored is refused (its ledger would count groups this trainer never saw)."""
        snap = self.store.read(path, turn_level)
        if snap.state.anchor > step:
            raise SnapshotStoreError(f"{snap.path / CONTROLLER_STATE_FILE}: snapshot belongs to trainer step "
                                     f"{snap.state.anchor}, newer than the restored step {step}")
        return snap

    def _adopt_snapshot_ledger(self, snap: SnapshotContents,
                               trainer: _TrainerState) -> tuple[RolloutRecoveryLedger, list[str], list[str]]:
        """The snapshot's ledger, less the groups the restored trainer step trained since (a snapshot
        under an older anchor); their sealed samples leave the data plane. Returns the ledger, the
        dropped group ids and their Gym rollout ids (every attempt)."""
        trained = trainer.ledger.trained_positions  # the trainer step's: what it trained is done
        ledger = self._ledger(snap.state.ledger)
        dropped_groups, dropped = ledger.adopt_trained(trained)
        snap.data_plane.discard(s.rollout_id for g in dropped_groups for s in snap.data_plane.group_samples(g))
        return ledger, dropped_groups, dropped

    def _sources(self, snap: SnapshotContents, ledger: RolloutRecoveryLedger, dropped: set[str]) -> list[SavedIn]:
        """Where each replica's saved episodes come from: the snapshot itself, and for a replica it left out
        the older snapshot it carries (each verified; only episodes the ledger still has live there, at the
        same attempt). Episodes of groups the restored step trained since are left out (``dropped``)."""
        if snap.gym is None:
            return []
        sources = [_saved_in(str(snap.path), snap.gym, snap.gym.exported(), dropped)]
        for iid, relative in sorted(snap.gym.carried.items()):
            try:
                index = self.store.read_carried(relative)
            except (SnapshotStoreError, OSError) as exc:
                logger.warning("%s's rollouts restart from their prompt: the snapshot that holds them, %s, "
                               "cannot be read (%s)", iid, relative, exc)
                continue
            live = set(ledger.live_on(iid))
            saved = {server: [k for k in keys if k in live] for server, keys in index.exported().get(iid, {}).items()}
            sources.append(_saved_in(str(self.checkpoint_dir / relative), index, {iid: saved}, dropped))
        return sources

    def _hold(self, sources: list[SavedIn]) -> None:
        """The run store holds, for each replica, the snapshot its episodes came from: until a new snapshot
        saves that replica, a recovery of it (or the next relaunch, through ``carried``) installs from there."""
        for item in sources:
            for iid in item.index.turn_level if item is sources[0] else item.saved:
                self.store.hold(REPLICA_HOLD + iid, item.snapshot)

    async def _restore_gym(self, sources: list[SavedIn]) -> InstalledEpisodes:
        """Gym installs the saved episodes on the replicas that run now (``install.install_episodes``, the
        path an in-run recovery takes too)."""
        if not any(sources):
            return InstalledEpisodes()
        assert self.coordinator is not None
        return await install_episodes(self.coordinator, sources)
