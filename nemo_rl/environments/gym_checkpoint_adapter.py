"""RL's view of one Gym deployment's checkpoint participants.

``GymCheckpointAdapter`` runs ``gym_patches.checkpoint.coordination`` for one
replica; it is what the ``NemoGym`` actor calls. Results and errors are
coordination's own (``PrepareResult``, ``CoordinationError``, both picklable),
passed through unchanged: the only wrap is the controller's, which names the
replica.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_patches.checkpoint import coordination
from gym_patches.checkpoint.coordination import Participants, PrepareResult
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import RestartOnlyPolicy, StatusReply

_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RESOURCES_MODES = ("stateless", "exported", "restart_only")


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
class GymCheckpointCommitSummary:
    """What one replica wrote: per server, the capture keys it exported."""

    checkpoint_dir: str
    exported_by_server: dict[str, list[str]]
    agent_exported: list[str]  # episodes an agent saved: these continue at turn level

    def episodes_for(self, server: str) -> list[EpisodeId]:
        return [EpisodeId.from_capture_key(k) for k in self.exported_by_server.get(server, [])]


@dataclass(frozen=True)
class GymServerProbe:
    """One server's answer to a status probe: whether it answered at all, and what it said."""

    answered: bool
    detail: str  # the error if it did not answer, else its phase and blocker count
    blocker_count: int = 0
    blockers: list[str] | None = None  # the first few blocking capture keys


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
        self._participants = await coordination.discover(self._client, self._auth_token, timeout_s=timeout_s)
        return sorted(p.name for p in self._participants if _is_restart_only(p.name, p.status))

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        restart_only_policy: RestartOnlyPolicy = "block",
        policy_overrides: dict[str, RestartOnlyPolicy] | None = None,
        capture: bool = False,
    ) -> PrepareResult:
        """``policy_overrides``: per-server policies (restart-only servers no turn-level rollout uses).
        ``capture``: a staged snapshot's prepare (each server serialises its sessions; ``persist`` writes)."""
        return await coordination.prepare(
            self.participants, checkpoint_id, deadline_ts, restart_only_policy, policy_overrides=policy_overrides,
            capture=capture,
        )

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> None:
        await coordination.renew(self.participants, checkpoint_id, deadline_ts)

    async def retire(self, checkpoint_id: str, deadline_ts: float, episodes: list[EpisodeId]) -> None:
        if episodes:
            await coordination.retire(self.participants, checkpoint_id, deadline_ts, episodes)

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        root: str | Path,
        episodes: list[EpisodeId] | dict[str, list[EpisodeId]],
    ) -> GymCheckpointCommitSummary:
        """Commit ``episodes`` (one list for all servers, or per server): written inside the pause."""
        target = self.instance.checkpoint_dir(root)
        target.mkdir(parents=True, exist_ok=True)
        replies = await coordination.commit(self.participants, checkpoint_id, deadline_ts, str(target), episodes)
        return self._summary(target, {name: r.episode_ids for name, r in replies.items()}, episodes)

    async def persist(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        root: str | Path,
        episodes: dict[str, list[EpisodeId]],
    ) -> GymCheckpointCommitSummary:
        """Write each server's ``episodes`` from what its capture prepare serialised (after resume)."""
        target = self.instance.checkpoint_dir(root)
        target.mkdir(parents=True, exist_ok=True)
        replies = await coordination.persist(self.participants, checkpoint_id, deadline_ts, str(target), episodes)
        return self._summary(target, {name: r.episode_ids for name, r in replies.items()}, episodes)

    def _summary(
        self, target: Path, written: dict[str, list[str]], episodes: list[EpisodeId] | dict[str, list[EpisodeId]]
    ) -> GymCheckpointCommitSummary:
        exported: dict[str, list[str]] = {}
        for name, keys in written.items():
            scope = episodes.get(name, []) if isinstance(episodes, dict) else episodes
            outside = sorted(set(keys) - {e.capture_key for e in scope})
            if outside:
                raise RuntimeError(f"Gym server {name!r} exported episodes outside the commit scope: {outside[:5]}")
            exported[name] = sorted(keys)
        agents = {p.name for p in self.participants.by_kind("agent")}
        agent_exported = sorted({k for name in agents for k in exported.get(name, [])})
        return GymCheckpointCommitSummary(str(target), exported, agent_exported)

    async def forget(self, checkpoint_id: str, deadline_ts: float, rollout_ids: list[str]) -> int:
        """Every server drops what it keeps about these finished rollouts; returns the entries dropped."""
        if not rollout_ids:
            return 0
        replies = await coordination.forget(self.participants, checkpoint_id, deadline_ts, rollout_ids)
        return sum(reply.forgotten for reply in replies.values())

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
        replies = await coordination.restore(
            self.participants, restore_id, deadline_ts, str(self.instance.checkpoint_dir(root)), scopes,
            source_checkpoint_id,
        )
        agents = {p.name for p in self.participants.by_kind("agent")}
        return sorted({k for name, r in replies.items() if name in agents for k in r.restored})

    async def resume(self, checkpoint_id: str, deadline_ts: float, call_timeout_s: float | None = None) -> None:
        await coordination.resume(self.participants, checkpoint_id, deadline_ts, call_timeout_s=call_timeout_s)

    async def probe(self, timeout_s: float) -> dict[str, "GymServerProbe"]:
        """Each participant's answer to a status call within ``timeout_s`` (see ``coordination.probe``)."""
        out: dict[str, GymServerProbe] = {}
        for name, status in (await coordination.probe(self.participants, timeout_s)).items():
            if isinstance(status, BaseException):
                out[name] = GymServerProbe(False, str(status))
            else:
                count = status.report.blocker_count
                out[name] = GymServerProbe(True, f"phase {status.phase}, {count} blocking", count,
                                           list(status.report.blockers[:5]))
        return out
