"""Episode identity shared by agents, the model gate, resources servers and RL.

A rollout keeps its ``rollout_id`` for life; every restore from a checkpoint
runs it again under the next ``attempt``. The capture key is the one string
that travels on the wire (``_ng_rollout_id``, ``/ng-rollout/<key>/``).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_ATTEMPT_SUFFIX = re.compile(r"^(?P<base>.+)-a(?P<attempt>[1-9][0-9]*)$")
_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
MAX_ATTEMPT = 1_000_000


class EpisodeId(BaseModel):
    """One attempt of one rollout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rollout_id: str = Field(min_length=1, max_length=200)
    attempt: int = Field(default=0, ge=0, le=MAX_ATTEMPT)

    @field_validator("rollout_id")
    @classmethod
    def _check_rollout_id(cls, value: str) -> str:
        problem = _rollout_id_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.attempt)

    @classmethod
    def from_capture_key(cls, key: str) -> "EpisodeId":
        match = _ATTEMPT_SUFFIX.match(key)
        if match:
            return cls(rollout_id=match["base"], attempt=int(match["attempt"]))
        return cls(rollout_id=key, attempt=0)

    def __str__(self) -> str:  # logs and error messages show the wire form
        return self.capture_key


def _rollout_id_problem(value: str) -> str | None:
    if not _ROLLOUT_ID.match(value):
        return f"rollout_id {value!r} must match {_ROLLOUT_ID.pattern}"
    if _ATTEMPT_SUFFIX.match(value):
        return f"rollout_id {value!r} may not end in '-a<N>' (reserved for attempts)"
    return None


def checked_capture_key(value: object) -> str | None:
    """The capture key of ``value`` if it is exactly the dump of a valid ``EpisodeId``
    (``{"rollout_id": str, "attempt": int}``), else None. The model's rules without building
    one: a capture checks thousands of records while every rollout is held."""
    if type(value) is not dict or len(value) != 2:
        return None
    rollout_id, attempt = value.get("rollout_id"), value.get("attempt")
    if type(rollout_id) is not str or type(attempt) is not int or not 0 <= attempt <= MAX_ATTEMPT:
        return None
    if _rollout_id_problem(rollout_id):
        return None
    return capture_key(rollout_id, attempt)


def capture_key(rollout_id: str, attempt: int = 0) -> str:
    """``rollout_id`` for attempt 0, else ``f"{rollout_id}-a{attempt}"``."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def next_attempt(episode: EpisodeId) -> EpisodeId:
    """The attempt a checkpointed episode continues under after a restore."""
    return EpisodeId(rollout_id=episode.rollout_id, attempt=episode.attempt + 1)
