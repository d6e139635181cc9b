"""In-run recovery as one component (docs/design.md §5.12): the controller holds one recovery object and
never branches on it. ``build_recovery`` gives ``InRunRecovery`` (a ``RecoverySupervisor`` over every Gym
replica and the generation worker) or, with ``rollout_recovery.in_run.enabled=false``, ``NullRecovery``,
under which a lost replica stops the run and a dead server's rollouts fail as infrastructure errors."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymCheckpointCoordinator
from nemo_rl.algorithms.single_controller_utils.recovery.generation_worker import GenerationWorkerPart
from nemo_rl.algorithms.single_controller_utils.recovery.gym_replica import GymReplicaPart, RecoveryHost
from nemo_rl.algorithms.single_controller_utils.recovery.records import Loss, RecoveryRecord
from nemo_rl.algorithms.single_controller_utils.recovery.supervisor import RecoveryFailed, RecoverySupervisor
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.outcome import failed_replicas
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.environments.nemo_gym import GymReplicaLost, GymRolloutError, NemoGymShardSet
from nemo_rl.utils.run_hooks import RunHooks

__all__ = ["InRunRecovery", "NullRecovery", "RecoveryFailed", "RecoveryHost", "RecoveryRecord", "build_recovery"]


class NullRecovery:
    """``rollout_recovery.in_run.enabled=false``: nothing is supervised; a lost replica stops the run
    (``GymReplicaLost``) and a dead server's rollouts fail as infrastructure errors."""

    def __init__(self, shard_set: NemoGymShardSet):
        self.shard_set = shard_set

    async def run(self) -> None:
        return None

    def actor_lost(self, instance: str, handle: Any, exc: BaseException) -> None:
        raise GymReplicaLost(instance, exc, self.shard_set.placement.get(instance)) from None

    def claims(self, instance: str, handle: Any, exc: GymRolloutError) -> bool:
        return False

    def dispatched(self, rollout_id: str) -> None: ...

    def went_to_prompt(self, rollout_id: str) -> None: ...

    async def recovers(self, exc: BaseException) -> bool:
        return False

    def step_metrics(self) -> dict[str, float]:
        return {}

    def counts(self) -> dict[str, int]:
        return {}


class InRunRecovery:
    """What the controller tells the recovery and reads of it; the supervisor does the work."""

    def __init__(self, supervisor: RecoverySupervisor, replicas: dict[str, GymReplicaPart],
                 generation: GenerationWorkerPart | None):
        self.supervisor = supervisor
        self.replicas = replicas
        self.generation = generation

    async def run(self) -> None:
        await self.supervisor.run()

    def actor_lost(self, instance: str, handle: Any, exc: BaseException) -> None:
        """A rollout met the replica's dead actor: the recovery takes its attempt over, with the replica's others."""
        self._report(instance, Loss(instance, "replica", "its Ray actor died", "rollout", handle))

    def claims(self, instance: str, handle: Any, exc: GymRolloutError) -> bool:
        """Whether a rollout's infrastructure failure is the recovery's (a server of its replica died, or
        the replica is being recovered), not the rollout's: its attempt comes back with the recovery."""
        part = self.replicas.get(instance)
        if part is None:
            return False
        if exc.code == "server_dead":
            self._report(instance, Loss(instance, exc.server, exc.detail or "died", "rollout", handle))
            return True
        return part.lost is not None

    def _report(self, instance: str, loss: Loss) -> None:
        part = self.replicas.get(instance)
        if part is not None:
            part.report(loss)

    def on_snapshot_lost(self, instance: str, why: str) -> None:
        """A snapshot's call met the replica's dead actor (the coordinator's ``on_lost``)."""
        part = self.replicas.get(instance)
        if part is not None:
            part.report(Loss(instance, "replica", why, "snapshot", part.incarnation()))

    def dispatched(self, rollout_id: str) -> None:
        for part in self.replicas.values():
            part.dispatched(rollout_id)

    def went_to_prompt(self, rollout_id: str) -> None:
        if self.generation is not None:
            self.generation.went_to_prompt(rollout_id)

    async def recovers(self, exc: BaseException) -> bool:
        """Whether a snapshot that failed on Gym met a loss this recovery owns, so it is not a failure in a row
        (``max_consecutive_failures``): a replica it names is being recovered, or one has a server that has exited
        or is stopped now. Its watch reports that server (an exit at once, a stop after ``hung_after_s``), so a
        snapshot that met it first, or several while a stopped server waits out the bound, does not stop the run."""
        named = [self.replicas[iid] for iid in failed_replicas(exc) if iid in self.replicas]
        if any(part.lost is not None for part in named):
            return True
        failing = await asyncio.gather(*(part.failing_servers() for part in named))
        return any(failing)

    def step_metrics(self) -> dict[str, float]:
        return self.supervisor.step_metrics()

    def counts(self) -> dict[str, int]:
        return self.supervisor.counts()


def build_recovery(config: MasterConfig, shard_set: NemoGymShardSet, coordinator: GymCheckpointCoordinator | None,
                   generation: Any, trainer: Any, store: RunStore, records: RunRecords, host: RecoveryHost,
                   hooks: RunHooks) -> InRunRecovery | NullRecovery:
    """The run's recovery object: every Gym replica is supervised, and the generation worker when the backend
    can restart it (the scripted test backend has no worker)."""
    settings = config.rollout_recovery.in_run
    if not settings.enabled:
        return NullRecovery(shard_set)
    replicas = {iid: GymReplicaPart(iid, settings, shard_set, coordinator, store, host,
                                    Path(config.logger.log_dir), hooks)
                for iid in shard_set.checkpoint_handles}
    worker = GenerationWorkerPart(settings, generation, trainer) if hasattr(generation, "restart") else None
    recovery = InRunRecovery(RecoverySupervisor(settings, records, [*replicas.values(), *([worker] if worker else [])]),
                             replicas, worker)
    if coordinator is not None:
        coordinator.on_lost = recovery.on_snapshot_lost
    return recovery
