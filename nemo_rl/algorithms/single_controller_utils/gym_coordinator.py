"""Checkpoint calls across every Gym replica, under one deadline.

``GymCheckpointCoordinator.prepared()`` is the scope of one snapshot: prepare
all replicas, keep their leases renewed, and always resume them on the way out
(also on error or cancellation) so Gym is never left closed by us.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable

import ray

from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import MAX_EPISODES_PER_REQUEST, RestartOnlyPolicy
from gym_patches.checkpoint.coordination import CoordinationError, PrepareResult
from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointCommitSummary
from nemo_rl.environments.nemo_gym import GymReplicaLost, NemoGymShardSet

logger = logging.getLogger(__name__)
_MAX_REPLY_GRACE_S = 5.0


class GymCheckpointNotReady(RuntimeError):
    """Some replica did not prepare by the deadline; ``blockers[instance][server]`` = keys."""

    def __init__(self, blockers: dict[str, dict[str, list[str]]]):
        self.blockers = blockers
        parts = []
        for iid, servers in sorted(blockers.items()):
            for server, keys in sorted(servers.items()):
                shown = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
                parts.append(f"{server!r} on {iid} ({len(keys)} blocking: {shown})")
        super().__init__("Gym not ready for a checkpoint: " + "; ".join(parts))

    @property
    def blocking_servers(self) -> list[str]:
        return sorted({s for servers in self.blockers.values() for s in servers})

    def __reduce__(self):
        return (GymCheckpointNotReady, (self.blockers,))


class GymCheckpointOperationError(RuntimeError):
    """An operation failed on some replicas; ``failures[instance]`` = the error as Gym raised it.

    The one wrap between Gym and the controller: it names the operation and
    each replica; each error inside names its server.
    """

    def __init__(self, operation: str, failures: dict[str, BaseException]):
        self.operation, self.failures = operation, failures
        super().__init__(
            f"Gym checkpoint {operation} failed on "
            + "; ".join(f"{iid}: {exc}" for iid, exc in sorted(failures.items()))
        )


def is_transient_gym_checkpoint_failure(exc: BaseException) -> bool:
    """Not-ready and unreachable Gym are retried at the next interval; anything else is a bug."""
    if isinstance(exc, GymCheckpointNotReady):
        return True
    if isinstance(exc, GymCheckpointOperationError):
        return all(isinstance(e, CoordinationError) for e in exc.failures.values())
    return False


def _unwrap(exc: BaseException) -> BaseException:
    """The error a replica raised, without Ray's task-error wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@dataclass
class PreparedGym:
    """What a successful prepare gives the snapshot: every replica's ``PrepareResult``."""

    checkpoint_id: str
    deadline_ts: float
    results: dict[str, PrepareResult]

    def unsaved_keys(self, instance_id: str) -> set[str]:
        return self.results[instance_id].unsaved_keys()


class GymCheckpointCoordinator:
    def __init__(self, shard_set: NemoGymShardSet, prepare_timeout_s: float, restart_only_policy: RestartOnlyPolicy):
        self.shard_set = shard_set
        self.prepare_timeout_s = prepare_timeout_s
        self.policy = restart_only_policy

    @property
    def instance_ids(self) -> list[str]:
        return sorted(self.shard_set.checkpoint_handles)

    async def _collect(self, operation: str, calls: dict[str, Awaitable[Any]], deadline_ts: float) -> dict[str, Any]:
        """Await every replica until the deadline plus a short grace; name the failures."""
        grace = min(self.prepare_timeout_s, _MAX_REPLY_GRACE_S)
        timeout = max(0.1, deadline_ts - time.time() + grace)
        tasks = {iid: asyncio.ensure_future(c) for iid, c in calls.items()}
        try:
            done, pending = await asyncio.wait(tasks.values(), timeout=timeout)
        except BaseException:  # cancelled: no replica call is left behind unobserved
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            raise
        failures: dict[str, BaseException] = {}
        out: dict[str, Any] = {}
        for iid, task in tasks.items():
            if task in pending:
                task.cancel()
                failures[iid] = TimeoutError(f"{operation} on {iid} did not answer within {timeout:.1f}s")
            elif task.exception() is not None:
                failures[iid] = _unwrap(task.exception())
            else:
                out[iid] = task.result()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for iid, exc in sorted(failures.items()):
            if isinstance(exc, ray.exceptions.RayActorError):
                raise GymReplicaLost(iid, exc, self.shard_set.placement.get(iid)) from None
        if failures:
            raise GymCheckpointOperationError(operation, failures)
        return out

    def _handles(self) -> dict[str, Any]:
        return self.shard_set.checkpoint_handles

    async def retire(self, checkpoint_id: str, episodes: dict[str, list[EpisodeId]]) -> None:
        deadline = time.time() + self.prepare_timeout_s
        calls = {
            iid: self._handles()[iid].checkpoint_retire.remote(checkpoint_id, deadline, eps)
            for iid, eps in episodes.items()
            if eps
        }
        if calls:
            await self._collect("retire", calls, deadline)

    @contextlib.asynccontextmanager
    async def prepared(self, checkpoint_id: str, *, capture: bool = False) -> AsyncIterator[PreparedGym]:
        """Prepare every replica (``capture``: each server serialises its sessions as it becomes
        prepared, for ``persist`` after resume); resume all of them on exit, whatever happened."""
        deadline = time.time() + self.prepare_timeout_s
        renewer: asyncio.Task | None = None
        try:
            results = await self._collect(
                "prepare",
                {
                    iid: h.checkpoint_prepare.remote(
                        checkpoint_id, deadline, self.policy, self.shard_set.prepare_policy_overrides.get(iid), capture
                    )
                    for iid, h in self._handles().items()
                },
                deadline,
            )
            not_ready = {iid: r.blockers for iid, r in results.items() if not r.prepared}
            if not_ready:
                raise GymCheckpointNotReady(not_ready)
            renewer = asyncio.create_task(self._renew_until_stopped(checkpoint_id), name=f"gym-renew:{checkpoint_id}")
            yield PreparedGym(checkpoint_id, deadline, results)
        finally:
            if renewer is not None:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
            await self.resume(checkpoint_id)

    async def _renew_until_stopped(self, checkpoint_id: str) -> None:
        period = max(0.05, min(self.prepare_timeout_s / 3, 10.0))
        while True:
            await asyncio.sleep(period)
            deadline = time.time() + self.prepare_timeout_s
            try:
                await self._collect(
                    "renew",
                    {iid: h.checkpoint_renew.remote(checkpoint_id, deadline) for iid, h in self._handles().items()},
                    deadline,
                )
            except GymCheckpointOperationError as exc:
                logger.warning("lease renewal for %s failed: %s", checkpoint_id, exc)

    async def commit(
        self, prepared: PreparedGym, root: str, scope: dict[str, dict[str, list[EpisodeId]]]
    ) -> dict[str, GymCheckpointCommitSummary]:
        """Each replica's servers write only their own episodes, ``scope[iid][server]``, inside the pause."""
        deadline = time.time() + self.prepare_timeout_s
        return await self._collect(
            "commit",
            {
                iid: h.checkpoint_commit.remote(prepared.checkpoint_id, deadline, root, scope.get(iid, {}))
                for iid, h in self._handles().items()
            },
            deadline,
        )

    async def forget(self, rollout_ids: list[str]) -> int:
        """Every replica drops what its servers keep about these finished rollouts (chunked)."""
        total = 0
        for start in range(0, len(rollout_ids), MAX_EPISODES_PER_REQUEST):
            chunk = rollout_ids[start:start + MAX_EPISODES_PER_REQUEST]
            deadline = time.time() + self.prepare_timeout_s
            cid = f"forget-{uuid.uuid4().hex[:12]}"
            done = await self._collect(
                "forget", {iid: h.checkpoint_forget.remote(cid, deadline, chunk) for iid, h in self._handles().items()},
                deadline,
            )
            total += sum(done.values())
        return total

    async def persist(
        self, checkpoint_id: str, root: str, scope: dict[str, dict[str, list[EpisodeId]]]
    ) -> dict[str, GymCheckpointCommitSummary]:
        """Each replica's servers write ``scope[iid][server]`` from what their capture prepare
        serialised (Gym is already resumed)."""
        deadline = time.time() + self.prepare_timeout_s
        return await self._collect(
            "persist",
            {iid: h.checkpoint_persist.remote(checkpoint_id, deadline, root, scope.get(iid, {}))
             for iid, h in self._handles().items()},
            deadline,
        )

    async def resume(self, checkpoint_id: str) -> None:
        deadline = time.time() + self.prepare_timeout_s
        try:
            await self._collect(
                "resume",
                {iid: h.checkpoint_resume.remote(checkpoint_id, deadline) for iid, h in self._handles().items()},
                deadline,
            )
        except GymCheckpointOperationError as exc:
            # The lease reopens a server we could not reach; report, don't mask the caller's error.
            logger.error("resume of %s failed (Gym reopens itself when the lease expires): %s", checkpoint_id, exc)

    async def restore(
        self, restore_id: str, root: str, exported: dict[str, dict[str, list[str]]], source_checkpoint_id: str
    ) -> dict[str, list[str]]:
        """Restore every replica that saved something; returns new agent keys per instance."""
        deadline = time.time() + self.prepare_timeout_s
        unknown = sorted(set(exported) - set(self._handles()))
        if unknown:
            raise RuntimeError(f"snapshot names Gym instances that are not running: {unknown}")
        try:
            return await self._collect(
                "restore",
                {
                    iid: self._handles()[iid].checkpoint_restore.remote(
                        restore_id, deadline, root, by_server, source_checkpoint_id
                    )
                    for iid, by_server in exported.items()
                },
                deadline,
            )
        finally:
            await self.resume(restore_id)
