"""The one way saved episodes go back into Gym: a relaunch's restore and an in-run recovery both call
``install_episodes`` (docs/design.md §5.5, §5.12).

What comes back, per replica, is what the newest committed snapshot that saved that replica's rollouts
holds: for a relaunch the newest snapshot, and for a replica it left out the older one it carries
(``GymCheckpointIndex.carried``); for an in-run recovery the snapshot the run store holds for the replica.
So each install takes one or more ``SavedIn`` (a snapshot, its Gym index, and the episodes to install from
it), plans where each episode goes (its own replica, or, when that replica no longer runs, one of its
shard's others: ``reshard.plan_restore``, which asks the servers whether their records are portable only
then), has the coordinator install them as ``attempt + 1``, and traces every new capture key back to the
replica that saved it, so the ledger pins each continued attempt where Gym installed it
(``RolloutRecoveryLedger.bring_back``).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.reshard import RestorePlan, plan_restore, vanished
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import GymCheckpointIndex
from nemo_rl.experience.rollout_recovery.restart import RestoredEpisode

logger = logging.getLogger(__name__)

Saved = dict[str, dict[str, list[str]]]  # replica -> Gym server -> capture keys it saved


@dataclass(frozen=True)
class SavedIn:
    """Episodes to install from one snapshot (its path and Gym index); ``replay``: those of them installed for
    replay (their model record only: the agent starts them fresh and the tools rebuild their state, §4.8)."""

    snapshot: str
    index: GymCheckpointIndex
    saved: Saved
    replay: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return any(keys for by_server in self.saved.values() for keys in by_server.values())


@dataclass
class InstalledEpisodes:
    """What Gym installed, keyed so the ledger, ``restore.json`` and a recovery's row can say where each went."""

    plans: list[RestorePlan] = field(default_factory=list)
    attempts: set[RestoredEpisode] = field(default_factory=set)  # (replica it ran on, rollout id, Gym's attempt)
    restored_on: dict[str, str] = field(default_factory=dict)  # new capture key -> the replica that installed it
    saved_on: dict[str, str] = field(default_factory=dict)  # new capture key -> the replica that saved it
    relocated: dict[str, str] = field(default_factory=dict)  # base rollout id -> the replica it moved to
    cuts: dict[str, int] = field(default_factory=dict)  # new capture key -> tokens of its generation cut (§5.10)
    snapshots: dict[str, str] = field(default_factory=dict)  # new capture key -> the snapshot it came from
    replayed: set[str] = field(default_factory=set)  # new capture keys that continue by replay (§4.8)

    def add(self, plan: RestorePlan, item: SavedIn, iid: str, key: str) -> None:
        """Replica ``iid`` installed ``key`` (attempt + 1 of a saved episode): trace it to its saver."""
        e = EpisodeId.from_capture_key(key)
        source = plan.source_of(iid, saved_key(key))
        self.attempts.add((source, e.rollout_id, e.attempt))
        self.restored_on[key], self.saved_on[key], self.snapshots[key] = iid, source, item.snapshot
        self.cuts[key] = item.index.cut_of(source, saved_key(key))
        if saved_key(key) in item.replay:
            self.replayed.add(key)
        if source != iid:
            self.relocated[e.rollout_id] = iid

    @property
    def saved_keys(self) -> dict[str, str]:
        """The saved capture key of every installed episode -> the replica that saved it."""
        return {saved_key(key): source for key, source in self.saved_on.items()}

    @property
    def not_portable(self) -> dict[str, str]:
        """Episodes of replicas that no longer run whose records may not move (key -> why): from the prompt."""
        return {key: why for plan in self.plans for key, why in plan.not_portable.items()}


def saved_key(new_key: str) -> str:
    """The capture key an installed episode (``attempt + 1``) was saved under."""
    e = EpisodeId.from_capture_key(new_key)
    return EpisodeId(rollout_id=e.rollout_id, attempt=e.attempt - 1).capture_key


async def install_episodes(coordinator: GymCheckpointCoordinator, sources: list[SavedIn], *,
                           purpose: str = "restore", running: list[str] | None = None) -> InstalledEpisodes:
    """Gym installs every source's episodes on the replicas that may take them (``running``, default every
    running replica); returns what went where.

    A replica of a source that is not among them has its episodes dealt over its shard's replicas that are,
    except records its servers say are not portable (those restart from the prompt:
    ``InstalledEpisodes.not_portable``). One restore call per source snapshot (each has its own checkpoint
    id); ``purpose`` names the restores' ids (``restore-...``, ``recover-...``)."""
    installed = InstalledEpisodes()
    running = coordinator.instance_ids if running is None else sorted(running)
    for item in sources:
        if not item:
            continue
        plan = plan_restore(item.saved, running)  # refuses a removed shard first
        gone = vanished(item.saved, running)
        if gone:
            shards = sorted({iid.rsplit("/replica-", 1)[0] for iid in gone})
            plan = plan_restore(item.saved, running, await coordinator.unportable_servers(shards, running))
            for key, (source, target) in sorted(plan.moved.items()):
                logger.info("rollout %s saved on %s (no longer running) continues on %s", key, source, target)
            for key, why in sorted(plan.not_portable.items()):
                logger.warning("rollout %s restarts from its prompt: %s", key, why)
        installed.plans.append(plan)
        new_keys = await coordinator.restore(f"{purpose}-{uuid.uuid4().hex[:12]}", item.snapshot, plan.sources,
                                             item.index.checkpoint_id, item.replay)
        for iid, keys in new_keys.items():
            for key in keys:
                installed.add(plan, item, iid, key)
    return installed
