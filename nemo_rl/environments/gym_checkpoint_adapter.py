"""RL's view of one Gym deployment's checkpoint participants.

``GymCheckpointAdapter`` finds the participants of one replica and runs each
typed checkpoint request (``gym_patches.checkpoint.calls``) over them with
``coordination.call``; the ``NemoGym`` actor's one ``checkpoint`` entry calls
it. It adds only what is RL's: the replica's checkpoint directory exists before
a write, a write stays inside the scope it was given, and replies become what
the snapshot keeps (``GymCheckpointCommitSummary``, restored agent keys,
``GymServerProbe``). Errors are coordination's own (``CoordinationError``,
picklable), passed through unchanged: the only wrap is the controller's, which
names the replica.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_patches.checkpoint import coordination
from gym_patches.checkpoint.calls import (
    CommitCall,
    ForgetCall,
    GymCall,
    PersistCall,
    PrepareCall,
    ProbeCall,
    RestoreCall,
)
from gym_patches.checkpoint.coordination import Participants, PrepareResult
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import RESTART_ONLY_MODES, StatusReply

_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RESOURCES_MODES = ("stateless", "exported", "restart_only", "replayed")


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
    cut_tokens: dict[str, int] = field(default_factory=dict)  # of those, the ones with a generation cut -> tokens
    cut_failed: int = 0  # calls in flight whose cut could not be completed (they regenerate at turn level)
    cut_error: str | None = None  # ... and why, naming the server

    def episodes_for(self, server: str) -> list[EpisodeId]:
        return [EpisodeId.from_capture_key(k) for k in self.exported_by_server.get(server, [])]


@dataclass(frozen=True)
class GymServerProbe:
    """One server's answer to a status probe: whether it answered at all, and what it said."""

    answered: bool
    detail: str  # the error if it did not answer, else its phase and blocker count
    blocker_count: int = 0
    blockers: list[str] | None = None  # the first few blocking capture keys
    records_portable: bool = True  # its status: its records can be installed on another replica (§5.7)
    busy: bool = False  # did not answer, but its process kept computing meanwhile: busy, not hung (§5.8)


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
        return mode in RESTART_ONLY_MODES
    return False


# What the actor's ``checkpoint`` entry answers, per request: a ``PrepareResult`` (prepare), a
# ``GymCheckpointCommitSummary`` (commit, persist), the agents' new capture keys (restore), the entries
# dropped (forget), server -> ``GymServerProbe`` (probe), None (renew, retire, resume).
GymCheckpointReply = PrepareResult | GymCheckpointCommitSummary | list[str] | int | dict[str, GymServerProbe] | None


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

    async def checkpoint(self, request: GymCall) -> GymCheckpointReply:
        """Run ``request`` over this replica's servers and answer in RL's terms (``GymCheckpointReply``)."""
        unknown = sorted(request.servers_named() - set(self.participants.names))
        if unknown:
            raise RuntimeError(f"{self.instance.instance_id}: {request.route} names Gym servers this deployment "
                               f"does not have: {unknown}")
        replies = await coordination.call(self.participants, request)
        match request:
            case CommitCall() | PersistCall():
                return self._write_summary(request, replies)
            case RestoreCall():
                return self._restored_keys(request, replies)
            case ForgetCall():
                return sum(reply.forgotten for reply in replies.values())
            case ProbeCall():
                return {name: _probe(status) for name, status in replies.items()}
            case PrepareCall():
                return replies
            case _:  # renew, retire, resume: nothing to keep
                return None

    def _write_summary(self, request: CommitCall | PersistCall, replies: dict[str, Any]) -> GymCheckpointCommitSummary:
        """A commit's or persist's replies as one summary: what each server wrote, the generation cuts,
        and the cuts that failed (named per server). Split out of ``checkpoint`` to keep it a dispatch."""
        cuts = {k: n for r in replies.values() for k, n in r.cut_tokens.items()}
        summary = self._summary(request, {name: r.episode_ids for name, r in replies.items()}, cuts)
        errors = [f"{name}: {r.cut_error}" for name, r in sorted(replies.items()) if getattr(r, "cut_error", None)]
        return dataclasses.replace(summary, cut_failed=sum(getattr(r, "cut_failed", 0) for r in replies.values()),
                                   cut_error="; ".join(errors) or None)

    def _restored_keys(self, request: RestoreCall, replies: dict[str, Any]) -> list[str]:
        """The capture keys RL continues: those the agents restored (at their turn), and those a model server
        installed for replay (``request.replay_episode_ids``: their agents start them fresh, docs/design.md
        §4.8); other servers' keys are theirs alone. Split out of ``checkpoint`` to keep it a dispatch."""
        agents = {p.name for p in self.participants.by_kind("agent")}
        models = {p.name for p in self.participants.by_kind("model")}
        replayed = {e.capture_key for e in request.replay_episode_ids}
        keys = {k for name, r in replies.items() if name in agents for k in r.restored}
        keys |= {k for name, r in replies.items() if name in models for k in r.restored
                 if _previous(k) in replayed}
        return sorted(keys)

    def _summary(self, request: CommitCall | PersistCall, written: dict[str, list[str]],
                 cuts: dict[str, int]) -> GymCheckpointCommitSummary:
        """What each server wrote, refusing a write outside the scope it was given."""
        exported: dict[str, list[str]] = {}
        for name, keys in written.items():
            scope = request.scope_for(name)
            outside = [] if scope is None else sorted(set(keys) - {e.capture_key for e in scope})
            if outside:
                raise RuntimeError(f"Gym server {name!r} exported episodes outside the commit scope: {outside[:5]}")
            exported[name] = sorted(keys)
        agents = {p.name for p in self.participants.by_kind("agent")}
        agent_exported = sorted({k for name in agents for k in exported.get(name, [])})
        written = {k for keys in exported.values() for k in keys}  # the agents' saves, and records for replay
        return GymCheckpointCommitSummary(request.checkpoint_dir, exported, agent_exported,
                                          {k: n for k, n in sorted(cuts.items()) if k in written})


def _previous(capture_key: str) -> str:
    """The capture key an installed attempt (``attempt + 1``) was saved under."""
    e = EpisodeId.from_capture_key(capture_key)
    return EpisodeId(rollout_id=e.rollout_id, attempt=e.attempt - 1).capture_key


def _probe(status: StatusReply | BaseException) -> GymServerProbe:
    if isinstance(status, BaseException):
        return GymServerProbe(False, str(status))
    count = status.report.blocker_count
    return GymServerProbe(True, f"phase {status.phase}, {count} blocking", count, list(status.report.blockers[:5]),
                          status.records_portable)
