"""The one way saved episodes go back into Gym: a relaunch's restore and an in-run recovery both call
``install_episodes`` (docs/design.md §5.5, §5.12).

It plans where each saved episode is installed (its own replica, or, when that replica no longer runs,
one of its shard's others: ``reshard.plan_restore``, which asks the servers whether their records are
portable only then), has the coordinator install them as ``attempt + 1``, and traces every new capture
key back to the replica that saved it, so the ledger pins each continued attempt where Gym installed it
(``RolloutRecoveryLedger.bring_back``).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.reshard import RestorePlan, plan_restore, vanished
from nemo_rl.experience.rollout_recovery.restart import RestoredEpisode

logger = logging.getLogger(__name__)

Saved = dict[str, dict[str, list[str]]]  # replica -> Gym server -> capture keys it saved


@dataclass
class InstalledEpisodes:
    """What Gym installed, keyed so the ledger, ``restore.json`` and a recovery's row can say where each went."""

    plan: RestorePlan = field(default_factory=lambda: RestorePlan({}))
    attempts: set[RestoredEpisode] = field(default_factory=set)  # (replica it ran on, rollout id, Gym's attempt)
    restored_on: dict[str, str] = field(default_factory=dict)  # new capture key -> the replica that installed it
    saved_on: dict[str, str] = field(default_factory=dict)  # new capture key -> the replica that saved it
    relocated: dict[str, str] = field(default_factory=dict)  # base rollout id -> the replica it moved to

    def add(self, iid: str, key: str) -> None:
        """Replica ``iid`` installed ``key`` (attempt + 1 of a saved episode): trace it to its saver."""
        e = EpisodeId.from_capture_key(key)
        source = self.plan.source_of(iid, saved_key(key))
        self.attempts.add((source, e.rollout_id, e.attempt))
        self.restored_on[key], self.saved_on[key] = iid, source
        if source != iid:
            self.relocated[e.rollout_id] = iid

    @property
    def saved_keys(self) -> dict[str, str]:
        """The saved capture key of every installed episode -> the replica that saved it."""
        return {saved_key(key): source for key, source in self.saved_on.items()}


def saved_key(new_key: str) -> str:
    """The capture key an installed episode (``attempt + 1``) was saved under."""
    e = EpisodeId.from_capture_key(new_key)
    return EpisodeId(rollout_id=e.rollout_id, attempt=e.attempt - 1).capture_key


async def install_episodes(coordinator: GymCheckpointCoordinator, snapshot: str, checkpoint_id: str,
                           saved: Saved, *, purpose: str = "restore", running: list[str] | None = None
                           ) -> InstalledEpisodes:
    """Gym installs ``saved`` (read from ``snapshot``) on the replicas that run now (``running``: those that
    may take episodes, default every running replica); returns what went where.

    A replica of ``saved`` that is not among them has its episodes dealt over its shard's replicas that
    are, except records its servers say are not portable (those restart from the prompt:
    ``InstalledEpisodes.plan.not_portable``). ``purpose`` names the restore's id (``restore-...``,
    ``recover-...``)."""
    installed = InstalledEpisodes()
    if not any(keys for by_server in saved.values() for keys in by_server.values()):
        return installed
    running = coordinator.instance_ids if running is None else sorted(running)
    installed.plan = plan_restore(saved, running)  # refuses a removed shard first
    gone = vanished(saved, running)
    if gone:
        shards = sorted({iid.rsplit("/replica-", 1)[0] for iid in gone})
        installed.plan = plan_restore(saved, running, await coordinator.unportable_servers(shards, running))
        for key, (source, target) in sorted(installed.plan.moved.items()):
            logger.info("rollout %s saved on %s (no longer running) continues on %s", key, source, target)
        for key, why in sorted(installed.plan.not_portable.items()):
            logger.warning("rollout %s restarts from its prompt: %s", key, why)
    new_keys = await coordinator.restore(f"{purpose}-{uuid.uuid4().hex[:12]}", snapshot, installed.plan.sources,
                                         checkpoint_id)
    for iid, keys in new_keys.items():
        for key in keys:
            installed.add(iid, key)
    return installed
