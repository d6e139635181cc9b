"""Wire models of Gym's rollout routes (model, agent, resources), one definition
used by every server and client. Items stay plain dicts where the Responses API
allows many shapes; the models validate the envelope and the fields we read."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROLLOUT_ID_FIELD = "_ng_rollout_id"
SESSION_COOKIE = "ng_session"
ROLLOUT_PREFIX = "/ng-rollout"

Item = dict[str, Any]


class ResponsesRequest(BaseModel):
    """The subset of the Responses API ``/v1/responses`` request we serve."""

    model_config = ConfigDict(extra="allow")

    input: str | list[Item]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    temperature: float | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    instructions: str | None = None
    model: str | None = None


class InputTokensDetails(BaseModel):
    model_config = ConfigDict(extra="allow")

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    model_config = ConfigDict(extra="allow")

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


ResponseStatus = Literal["completed", "incomplete", "failed", "in_progress", "cancelled", "queued"]


class ResponsesReply(BaseModel):
    """A Responses API ``response`` object. The model server fills every field the
    schema requires; readers (the agents) accept replies that omit the optional ones."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus = "completed"
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[Item]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    usage: ResponseUsage = Field(default_factory=ResponseUsage)


class TaskRow(BaseModel):
    """A dataset row as agents and resources servers read it; other fields pass through."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    responses_create_params: dict[str, Any]


class SeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    row: dict[str, Any]
    ng_rollout_id: str = Field(alias=ROLLOUT_ID_FIELD, min_length=1)


class SeedSessionReply(BaseModel):
    session_id: str


class ToolReply(BaseModel):
    output: str


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    row: dict[str, Any]
    response: dict[str, Any]


class VerifyReply(BaseModel):
    model_config = ConfigDict(extra="allow")

    reward: float


Boundary = Literal["B0", "P1", "P2"]
# "model_rejected": the model server refused the request as invalid (4xx, e.g. a prompt over the
# context length): the episode ends there and is verified as it stands, like an incomplete reply.
TerminationReason = Literal["final_answer", "max_steps", "incomplete", "model_rejected"]


class RunReply(BaseModel):
    """What an agent's ``/run`` returns to RL."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str
    reward: float
    response: dict[str, Any]
    num_model_calls: int
    termination_reason: TerminationReason
    restored_from: Boundary | None = None


def message_item(role: str, text: str) -> Item:
    return {"type": "message", "role": role, "content": text}


# -- /run errors and agent activity ----------------------------------------

RUN_ERROR_UPSTREAM_TIMEOUT = "upstream_timeout"  # 504: a Gym server the agent called did not answer in time
RUN_ERROR_UPSTREAM = "upstream_error"  # 502: a Gym server the agent called failed or answered nonsense


class RunError(BaseModel):
    """``server`` is the Gym server that failed or did not answer: the agent's model or
    resources server, or the agent itself for its own errors; None where nobody said."""

    code: str
    detail: str
    server: str | None = None


class RunErrorBody(BaseModel):
    """The error body of an agent's ``/run`` (the ``{"error": {"code", "detail"}}`` shape
    every Gym route uses, plus ``server``); RL parses it with this same model."""

    error: RunError


ACTIVITY_ROUTE = "/ng-activity/v1/runs"
REPLAY_STATS_ROUTE = "/ng-replay/v1/stats"  # a model server's replay counts (``gym_patches.checkpoint.replay``)

RunPhase = Literal["seeding", "model_call", "tool_call", "verify", "between_calls"]


class RunActivity(BaseModel):
    """What one ``/run`` in flight is doing: the call it waits on (``server``, and ``tool``
    for a tool call) and for how long; ``between_calls`` is the agent's own work (or a
    run parked by a checkpoint after its last call returned)."""

    capture_key: str
    phase: RunPhase
    server: str | None = None
    tool: str | None = None
    since_s: float = Field(ge=0)


class AgentActivity(BaseModel):
    """``GET /ng-activity/v1/runs`` of an agent: every ``/run`` it is running now."""

    agent: str
    runs: list[RunActivity] = Field(default_factory=list)
