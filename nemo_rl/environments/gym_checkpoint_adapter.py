"""RL's view of one Gym deployment's checkpoint participants.

``GymCheckpointAdapter`` wraps ``gym_patches.checkpoint.coordination`` for one
replica; it is what the ``NemoGym`` actor calls. Replies are turned into small
picklable summaries so they can cross Ray.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_patches.checkpoint import coordination
from gym_patches.checkpoint.coordination import CoordinationError, Participants
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import RestartOnlyPolicy, StatusReply

_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RESOURCES_MODES = ("stateless", "exported", "restart_only")


class GymCheckpointUnavailable(RuntimeError):
    """A picklable stand-in for Gym's ``CoordinationError`` (names the server)."""

    def __init__(self, message: str, *, server: str | None = None, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.server, self.code, self.status = server, code, status

    def __reduce__(self):  # keep keyword fields across Ray
        return (_rebuild_unavailable, (str(self), self.server, self.code, self.status))


def _rebuild_unavailable(message: str, server: str | None, code: str | None, status: int | None):
    return GymCheckpointUnavailable(message, server=server, code=code, status=status)


class GymStatusError(ValueError):
    """A Gym server's status reply cannot be classified; names the server."""


@dataclass(frozen=True)
class GymCheckpointInstance:
    """One Gym deployment: ``<shard>/replica-<i>``."""

    shard_name: str
    replica_index: int

    def __post_init__(self) -> None:
        if not _SAFE_COMPONENT.match(self.shard_name):
            raise ValueError(f"Gym shard name {self.shard_name!r} is not a safe path component")
        if self.replica_index < 0:
            raise ValueError(f"replica index must be >= 0, got {self.replica_index}")

    @property
    def instance_id(self) -> str:
        return f"{self.shard_name}/replica-{self.replica_index}"

    def checkpoint_dir(self, root: str | Path) -> Path:
        return Path(root) / "gym-instances" / self.shard_name / f"replica-{self.replica_index}"


@dataclass(frozen=True)
class GymCheckpointPrepareSummary:
    prepared: bool
    blockers: dict[str, list[str]] = field(default_factory=dict)
    unsaved: dict[str, list[str]] = field(default_factory=dict)

    def unsaved_keys(self) -> set[str]:
        return {k for keys in self.unsaved.values() for k in keys}


@dataclass(frozen=True)
class GymCheckpointCommitSummary:
    """What one replica wrote: per server, the capture keys it exported."""

    checkpoint_dir: str
    exported_by_server: dict[str, list[str]]
    agent_exported: list[str]  # episodes an agent saved: these continue at turn level

    def episodes_for(self, server: str) -> list[EpisodeId]:
        return [EpisodeId.from_capture_key(k) for k in self.exported_by_server.get(server, [])]


def _is_restart_only(name: str, status: StatusReply) -> bool:
    """``{"restart_only": true}`` (agents) or ``{"mode": "restart_only"}`` (resources)."""
    extra = status.model_extra or {}
    if status.kind == "agent":
        flag = extra.get("restart_only")
        if not isinstance(flag, bool):
            raise GymStatusError(
                f"Gym agent {name!r}: status has no boolean 'restart_only' field (got {flag!r}); "
                "is it running the checkpoint-patched Gym?"
            )
        return flag
    if status.kind == "resources":
        mode = extra.get("mode")
        if mode not in RESOURCES_MODES:
            raise GymStatusError(
                f"Gym resources server {name!r}: unknown checkpoint mode {mode!r} (expected one of {RESOURCES_MODES})"
            )
        return mode == "restart_only"
    return False


def _unavailable(exc: CoordinationError) -> GymCheckpointUnavailable:
    return GymCheckpointUnavailable(str(exc), server=exc.server, code=exc.code, status=exc.status)


class GymCheckpointAdapter:
    """Checkpoint calls for one Gym deployment (one replica of one shard)."""

    def __init__(self, instance: GymCheckpointInstance, client: Any, auth_token: str):
        self.instance = instance
        self._client = client
        self._auth_token = auth_token
        self._participants: Participants | None = None

    @property
    def participants(self) -> Participants:
        if self._participants is None:
            raise RuntimeError(f"{self.instance.instance_id}: discover() has not run")
        return self._participants

    async def discover(self, timeout_s: float = 30.0) -> list[str]:
        """Find the participants; return the names of the restart-only ones."""
        try:
            self._participants = await coordination.discover(self._client, self._auth_token, timeout_s=timeout_s)
        except CoordinationError as exc:
            raise _unavailable(exc) from None
        return sorted(p.name for p in self._participants if _is_restart_only(p.name, p.status))

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        restart_only_policy: RestartOnlyPolicy = "block",
        policy_overrides: dict[str, RestartOnlyPolicy] | None = None,
    ) -> GymCheckpointPrepareSummary:
        """``policy_overrides``: per-server policies (restart-only servers no turn-level rollout uses)."""
        try:
            result = await coordination.prepare(
                self.participants, checkpoint_id, deadline_ts, restart_only_policy, policy_overrides=policy_overrides
            )
        except CoordinationError as exc:
            raise _unavailable(exc) from None
        return GymCheckpointPrepareSummary(result.prepared, dict(result.blockers), dict(result.unsaved))

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> None:
        try:
            await coordination.renew(self.participants, checkpoint_id, deadline_ts)
        except CoordinationError as exc:
            raise _unavailable(exc) from None

    async def retire(self, checkpoint_id: str, deadline_ts: float, episodes: list[EpisodeId]) -> None:
        if not episodes:
            return
        try:
            await coordination.retire(self.participants, checkpoint_id, deadline_ts, episodes)
        except CoordinationError as exc:
            raise _unavailable(exc) from None

    async def commit(
        self, checkpoint_id: str, deadline_ts: float, root: str | Path, episodes: list[EpisodeId]
    ) -> GymCheckpointCommitSummary:
        target = self.instance.checkpoint_dir(root)
        target.mkdir(parents=True, exist_ok=True)
        try:
            replies = await coordination.commit(self.participants, checkpoint_id, deadline_ts, str(target), episodes)
        except CoordinationError as exc:
            raise _unavailable(exc) from None
        wanted = {e.capture_key for e in episodes}
        exported: dict[str, list[str]] = {}
        for name, reply in replies.items():
            outside = sorted(set(reply.episode_ids) - wanted)
            if outside:
                raise RuntimeError(f"Gym server {name!r} exported episodes outside the commit scope: {outside[:5]}")
            exported[name] = sorted(reply.episode_ids)
        agents = {p.name for p in self.participants.by_kind("agent")}
        agent_exported = sorted({k for name in agents for k in exported.get(name, [])})
        return GymCheckpointCommitSummary(str(target), exported, agent_exported)

    async def restore(
        self,
        restore_id: str,
        deadline_ts: float,
        root: str | Path,
        exported_by_server: dict[str, list[str]],
        source_checkpoint_id: str,
    ) -> list[str]:
        """Install what each server exported; return the agents' new capture keys."""
        scopes = {name: [EpisodeId.from_capture_key(k) for k in keys] for name, keys in exported_by_server.items()}
        unknown = sorted(set(scopes) - set(self.participants.names))
        if unknown:
            raise RuntimeError(
                f"{self.instance.instance_id}: checkpoint names Gym servers this deployment does not have: {unknown}"
            )
        try:
            replies = await coordination.restore(
                self.participants,
                restore_id,
                deadline_ts,
                str(self.instance.checkpoint_dir(root)),
                scopes,
                source_checkpoint_id,
            )
        except CoordinationError as exc:
            raise _unavailable(exc) from None
        agents = {p.name for p in self.participants.by_kind("agent")}
        return sorted({k for name, r in replies.items() if name in agents for k in r.restored})

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> None:
        try:
            await coordination.resume(self.participants, checkpoint_id, deadline_ts)
        except CoordinationError as exc:
            raise _unavailable(exc) from None
