"""Wire models of the checkpoint control routes (one definition, server and client).

Requests forbid extra fields so a typo is an error, not a silent default.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gym_patches.checkpoint.cuts import CutSummary
from gym_patches.checkpoint.identity import EpisodeId

CHECKPOINT_ROUTE_PREFIX = "/ng-control/v1/checkpoint"
CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_EPISODES_PER_REQUEST = 100_000
MAX_REPORTED_BLOCKERS = 100
# How long an agent keeps saying a /run ended (``PrepareReport.ended``): longer than a reply takes to
# reach the caller, shorter than a step's worth of rollouts.
ENDED_WINDOW_S = 10.0

ParticipantKind = Literal["model", "agent", "resources"]
Phase = Literal["idle", "preparing", "prepared", "committed", "restored"]
RestartOnlyPolicy = Literal["block", "best_effort"]
# ``replayed``: restart-only, but its session state is a function of the tool calls it received and those
# calls act nowhere else, so a rollout on it comes back by replay (``gym_patches.checkpoint.replay``).
ResourcesCheckpointMode = Literal["stateless", "exported", "restart_only", "replayed"]
RESTART_ONLY_MODES: frozenset[str] = frozenset({"restart_only", "replayed"})

# Gym prepares callers' callees first: the model holds replies before agents park.
PREPARE_ORDER: tuple[ParticipantKind, ...] = ("model", "agent", "resources")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckpointRequest(_Request):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    deadline_ts: float

    @field_validator("deadline_ts")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError("deadline_ts must be a finite absolute epoch time in seconds")
        return value


class PrepareRequest(CheckpointRequest):
    restart_only_policy: RestartOnlyPolicy = "block"
    # True (a staged snapshot): on becoming prepared, serialise every exportable session in memory;
    # ``persist`` writes the commit scope's records from that copy after resume. No ``commit`` follows.
    capture: bool = False
    # True (``target_level: prefix``): the model server also takes a generation cut of the calls in
    # flight as it closes admission (``gym_patches.checkpoint.cuts``); other kinds ignore it.
    cut: bool = False
    # With ``cut``: the rollout ids (every attempt) whose calls are cut, those at prefix level; the
    # model server cuts no other call (docs/design.md §5.10). None (older callers): every call in flight.
    cut_rollouts: list[str] | None = Field(default=None, max_length=MAX_EPISODES_PER_REQUEST)

    @model_validator(mode="after")
    def _cut_rollouts_need_cut(self) -> "PrepareRequest":
        if self.cut_rollouts is not None and not self.cut:
            raise ValueError("cut_rollouts is given without cut: set cut=true or leave cut_rollouts out")
        return self


class RenewRequest(CheckpointRequest):
    pass


class ResumeRequest(CheckpointRequest):
    pass


class RetireRequest(CheckpointRequest):
    episode_ids: list[EpisodeId] = Field(min_length=1, max_length=MAX_EPISODES_PER_REQUEST)


class ForgetRequest(CheckpointRequest):
    """Drop everything kept about these finished rollouts (every attempt): RL never sends them again."""

    rollout_ids: list[str] = Field(min_length=1, max_length=MAX_EPISODES_PER_REQUEST)


class CommitRequest(CheckpointRequest):
    checkpoint_dir: str = Field(min_length=1, max_length=4096)
    # None = every episode the participant can export.
    episode_ids: list[EpisodeId] | None = Field(default=None, max_length=MAX_EPISODES_PER_REQUEST)


class PersistRequest(CheckpointRequest):
    """Write the records of ``episode_ids`` from the copy a ``capture`` prepare took; allowed after
    resume (the id stays persistable). An episode the copy has no record of is left out."""

    checkpoint_dir: str = Field(min_length=1, max_length=4096)
    episode_ids: list[EpisodeId] = Field(max_length=MAX_EPISODES_PER_REQUEST)


class RestoreRequest(CheckpointRequest):
    checkpoint_dir: str = Field(min_length=1, max_length=4096)
    episode_ids: list[EpisodeId] = Field(max_length=MAX_EPISODES_PER_REQUEST)
    source_checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    # More checkpoint dirs to read records from: other replicas' of the same shard, whose episodes
    # continue here because their replica no longer runs (elastic restore, docs/design.md §5.7). Each asked
    # episode's record must be in exactly one of ``checkpoint_dir`` and these.
    source_dirs: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(default_factory=list,
                                                                                   max_length=1024)
    # Episodes of ``episode_ids`` whose agent starts again from the prompt (their restart-only servers are
    # replayable): only a model server installs them, its record's calls queued for replay
    # (``gym_patches.checkpoint.replay``); an agent or resources server refuses them.
    replay_episode_ids: list[EpisodeId] = Field(default_factory=list, max_length=MAX_EPISODES_PER_REQUEST)

    @model_validator(mode="after")
    def _replay_in_scope(self) -> "RestoreRequest":
        scope = self.episode_ids
        named = ({e for episodes in scope.values() for e in episodes} if isinstance(scope, dict)
                 else set(scope))
        outside = sorted(e.capture_key for e in self.replay_episode_ids if e not in named)
        if outside:
            raise ValueError(f"replay_episode_ids names episodes outside episode_ids: {outside[:10]}")
        return self


class PrepareReport(BaseModel):
    """Readiness of one participant: what blocks a consistent snapshot, what cannot be saved."""

    ready: bool
    blockers: list[str] = Field(default_factory=list)  # capture keys, capped
    blocker_count: int = 0
    unsaved: list[str] = Field(default_factory=list)  # capture keys, never capped
    counts: dict[str, int] = Field(default_factory=dict)
    # In a prepared reply, an agent's: capture keys of the /runs it answered in the last
    # ``ENDED_WINDOW_S``, whose replies may still be on their way to the caller; None: the server does
    # not say (docs/design.md §5.4).
    ended: list[str] | None = None

    @classmethod
    def build(
        cls, blockers: list[str], unsaved: list[str] | None = None, counts: dict[str, int] | None = None
    ) -> "PrepareReport":
        ordered = sorted(set(blockers))
        return cls(
            ready=not ordered,
            blockers=ordered[:MAX_REPORTED_BLOCKERS],
            blocker_count=len(ordered),
            unsaved=sorted(set(unsaved or [])),
            counts=dict(counts or {}),
        )


class StatusReply(BaseModel):
    """``GET status``; ``status_extra()`` fields sit at top level."""

    model_config = ConfigDict(extra="allow")

    kind: ParticipantKind
    instance: str
    phase: Phase
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    report: PrepareReport
    # False: this server's records hold something only its own process can use, so an episode it
    # saved cannot continue on another replica of its shard (docs/design.md §5.7, portable records).
    records_portable: bool = True


class PrepareReply(BaseModel):
    phase: Phase
    report: PrepareReport
    captured: list[str] | None = None  # a ``capture`` prepare that is prepared: capture keys of the copy
    captured_bytes: int = 0  # about the JSON size of that in-memory copy, held until ``persist`` writes it
    cut: CutSummary | None = None  # a model server asked for a cut: what it took


class RenewReply(BaseModel):
    lease_expires_at: float | None


class RetireReply(BaseModel):
    retired: list[str]


class ForgetReply(BaseModel):
    forgotten: int  # entries dropped (retired marks, delivery counts, session records)


class ParticipantManifest(BaseModel):
    """Write-once description of one participant's records file (docs/design.md §4.7)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    kind: ParticipantKind
    instance: str
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    records_file: str = Field(pattern=r"^records-[0-9a-f]{64}\.jsonl$")
    records_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    record_count: int = Field(ge=0)


class CommitReply(BaseModel):
    phase: Literal["committed"]
    manifest: ParticipantManifest
    episode_ids: list[str]  # capture keys actually exported
    cut_tokens: dict[str, int] = Field(default_factory=dict)  # as PersistReply's


class PersistReply(BaseModel):
    manifest: ParticipantManifest
    episode_ids: list[str]  # capture keys actually written
    cut_tokens: dict[str, int] = Field(default_factory=dict)  # written records with a generation cut: its tokens
    cut_failed: int = Field(default=0, ge=0)  # calls in flight whose cut could not be completed (turn level)
    cut_error: str | None = None  # ... and why


class RestoreReply(BaseModel):
    phase: Literal["restored"]
    source_checkpoint_id: str
    restored: list[str]  # next-attempt capture keys now installed


class ResumeReply(BaseModel):
    phase: Literal["idle"]
    idempotent: bool


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
