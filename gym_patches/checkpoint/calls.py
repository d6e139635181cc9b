"""One typed request per checkpoint verb, for a whole Gym deployment (docs/design.md §4.6).

Each ``*Call`` *is* the wire request its servers get (it subclasses that model in
``wire``), plus only what the caller of a deployment needs on top: a scope per
server, per-server policies, a per-call timeout. ``body_for(server)`` is the one
place a call becomes one server's HTTP body, and it copies every field of the wire
model, so a field added to a wire request travels from whoever builds the call to
the server that reads it with no other edit on the way (RL's coordinator, the Ray
actor and the coordination library only pass the call along).
"""

from __future__ import annotations

from typing import Any, ClassVar, Self, Union

from pydantic import BaseModel, ConfigDict, Field

from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import (
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    ForgetReply,
    ForgetRequest,
    PersistReply,
    PersistRequest,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestartOnlyPolicy,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    StatusReply,
)

# One scope for every server, or server -> its own scope (a server left out gets an empty one).
Scope = Union[list[EpisodeId], dict[str, list[EpisodeId]]]


class _Call:
    """What every call says about itself: its route, its reply model and the wire body per server."""

    route: ClassVar[str]
    reply: ClassVar[type[BaseModel]]
    wire: ClassVar[type[CheckpointRequest] | None] = None  # None: a GET without a body
    # The field whose mapping keys are server names (checked against the participants), if any.
    per_server_field: ClassVar[str | None] = None

    def body_for(self, server: str) -> CheckpointRequest:
        """``server``'s HTTP body: every field of the wire model, as this call holds it."""
        return _body(self, self.wire)

    def servers_named(self) -> set[str]:
        """Servers this call names by key (each must be a participant of the deployment)."""
        value = getattr(self, self.per_server_field) if self.per_server_field else None
        return set(value) if isinstance(value, dict) else set()

    def replace(self, **fields: Any) -> Self:
        """A copy with ``fields`` changed, validated like a new call (``model_copy`` would not check)."""
        return type(self).model_validate({**dict(self), **fields})  # type: ignore[attr-defined]


def _body(call: Any, wire: type[CheckpointRequest] | None, **per_server: Any) -> CheckpointRequest:
    if wire is None:
        raise TypeError(f"{type(call).__name__} has no request body")
    return wire.model_validate({name: getattr(call, name) for name in wire.model_fields} | per_server)


class _ScopedCall(_Call):
    """A call whose ``episode_ids`` is one scope for every server or server -> its own."""

    per_server_field: ClassVar[str] = "episode_ids"

    def scope_for(self, server: str) -> list[EpisodeId] | None:
        """``server``'s episodes: its own list (empty if the mapping leaves it out), or the shared one."""
        scope = self.episode_ids  # type: ignore[attr-defined]
        return scope.get(server, []) if isinstance(scope, dict) else scope

    def body_for(self, server: str) -> CheckpointRequest:
        return _body(self, self.wire, episode_ids=self.scope_for(server))


class PrepareCall(PrepareRequest, _Call):
    """Prepare stage by stage; ``policy_overrides`` gives some servers their own policy (e.g.
    ``best_effort`` for a restart-only server whose rollouts are not kept at turn level)."""

    route: ClassVar[str] = "prepare"
    reply: ClassVar[type[BaseModel]] = PrepareReply
    wire: ClassVar[type[CheckpointRequest]] = PrepareRequest
    per_server_field: ClassVar[str] = "policy_overrides"

    policy_overrides: dict[str, RestartOnlyPolicy] | None = None

    def body_for(self, server: str) -> CheckpointRequest:
        policy = (self.policy_overrides or {}).get(server, self.restart_only_policy)
        return _body(self, PrepareRequest, restart_only_policy=policy)


class RenewCall(RenewRequest, _Call):
    """Push every server's lease past the new deadline."""

    route: ClassVar[str] = "renew"
    reply: ClassVar[type[BaseModel]] = RenewReply
    wire: ClassVar[type[CheckpointRequest]] = RenewRequest


class RetireCall(RetireRequest, _Call):
    """Retire attempts, agents first. ``best_effort``: try every stage, raise all failures at the
    end (else the first failing stage raises and later ones are not asked)."""

    route: ClassVar[str] = "retire"
    reply: ClassVar[type[BaseModel]] = RetireReply
    wire: ClassVar[type[CheckpointRequest]] = RetireRequest

    best_effort: bool = False


class ForgetCall(ForgetRequest, _Call):
    """Every server drops what it keeps about these finished rollouts (while idle)."""

    route: ClassVar[str] = "forget"
    reply: ClassVar[type[BaseModel]] = ForgetReply
    wire: ClassVar[type[CheckpointRequest]] = ForgetRequest


class CommitCall(CommitRequest, _ScopedCall):
    """Every server writes its episodes' records inside the pause. ``episode_ids``: one scope for
    all, server -> scope, or None (all each can export)."""

    route: ClassVar[str] = "commit"
    reply: ClassVar[type[BaseModel]] = CommitReply
    wire: ClassVar[type[CheckpointRequest]] = CommitRequest

    episode_ids: Scope | None = None  # type: ignore[assignment]


class PersistCall(PersistRequest, _ScopedCall):
    """Every server writes its scope from the copy its ``capture`` prepare of this id took
    (after resume is fine); scopes as for ``CommitCall``, but never None."""

    route: ClassVar[str] = "persist"
    reply: ClassVar[type[BaseModel]] = PersistReply
    wire: ClassVar[type[CheckpointRequest]] = PersistRequest

    episode_ids: Scope  # type: ignore[assignment]


class RestoreCall(RestoreRequest, _ScopedCall):
    """Install saved episodes everywhere at once (undone on failure); scopes as for ``PersistCall``.
    ``replay_episode_ids`` is one list for the deployment: each server gets those in its own scope (a
    replayed episode is in the model server's scope only, so its agent and tools start it fresh)."""

    route: ClassVar[str] = "restore"
    reply: ClassVar[type[BaseModel]] = RestoreReply
    wire: ClassVar[type[CheckpointRequest]] = RestoreRequest

    episode_ids: Scope  # type: ignore[assignment]

    def body_for(self, server: str) -> CheckpointRequest:
        scope = self.scope_for(server) or []
        mine = set(scope)
        return _body(self, self.wire, episode_ids=scope,
                     replay_episode_ids=[e for e in self.replay_episode_ids if e in mine])


class ResumeCall(ResumeRequest, _Call):
    """Reopen every server, all at once. ``call_timeout_s`` bounds each server's call, so a hung
    server fails its own resume quickly and the caller learns of it."""

    route: ClassVar[str] = "resume"
    reply: ClassVar[type[BaseModel]] = ResumeReply
    wire: ClassVar[type[CheckpointRequest]] = ResumeRequest

    call_timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class ProbeCall(BaseModel, _Call):
    """Every server's status within ``timeout_s``: tells a slow server from one that does not answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    route: ClassVar[str] = "status"
    reply: ClassVar[type[BaseModel]] = StatusReply

    timeout_s: float = Field(gt=0, allow_inf_nan=False)


GymCall = Union[PrepareCall, RenewCall, RetireCall, ForgetCall, CommitCall, PersistCall, RestoreCall, ResumeCall,
                ProbeCall]
