"""The config block of each Gym server implementation, apart from the servers themselves.

Each model here is what one implementation accepts under ``<name>.<server_type>.<implementation>``. They
live outside the server packages so that a process that only checks a config (the RL driver, the
launcher) reads them without importing a server (what imports what: docs/design.md §3); the servers import
them from here.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gym_patches.config import GymConfigError, ServerInstanceConfig, ServerRef


class ServerConfigBase(BaseModel):
    """Base of every implementation's config block (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")


def parse_instance_config(model: type[ServerConfigBase], instance: ServerInstanceConfig) -> ServerConfigBase:
    """``instance``'s implementation config parsed by ``model``; errors name the full key."""
    try:
        return model(**instance.config)
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise GymConfigError(f"{instance.name}.{instance.server_type}.{instance.implementation}: {detail}") from None


class ResourcesServerConfig(ServerConfigBase):
    """Config every resources server accepts; subclasses add their own keys."""

    # tool name -> seconds to sleep before running it (tests use it to catch a call mid-flight)
    tool_delay_s: dict[str, float] = Field(default_factory=dict)
    # "A session's state is a function of the tool calls it received, and those calls act nowhere else":
    # a rollout on this server can come back by replaying its model calls into a fresh session
    # (docs/design.md §4.5). A restart-only server that declares it reports checkpoint mode ``replayed``.
    replayable: bool = Field(default=False, strict=True)

    @field_validator("tool_delay_s")
    @classmethod
    def _delays(cls, value: dict[str, float]) -> dict[str, float]:
        for name, seconds in value.items():
            if not math.isfinite(seconds) or seconds < 0:
                raise ValueError(f"tool_delay_s[{name!r}] must be a finite number >= 0, got {seconds!r}")
        return value


SANDBOX_EXEC_TIMEOUT_S = 10.0  # the sandbox interpreter's default per call


class PythonSandboxConfig(ResourcesServerConfig):
    exec_timeout_s: float = Field(default=SANDBOX_EXEC_TIMEOUT_S, gt=0, le=600)


class VLLMModelConfig(ServerConfigBase):
    return_token_id_information: bool = True  # ask for and pass through token ids + logprobs
    request_timeout_s: float = Field(default=600.0, gt=0)  # per backend call
    # Keep each episode's finished calls (request digests and replies) in its checkpoint record, so a
    # rollout on replayable restart-only servers can come back by replay (``gym_patches.checkpoint.replay``).
    # RL sets it per replica; off, a run pays nothing for it.
    record_calls: bool = Field(default=False, strict=True)


class LoopAgentConfig(ServerConfigBase):
    model_server: ServerRef
    resources_server: ServerRef
    max_steps: int = Field(default=6, ge=1, le=1000)
    # A model reply may be held across a checkpoint's prepare, and reasoning generations are long.
    model_call_timeout_s: float = Field(default=1800.0, gt=0, allow_inf_nan=False, strict=True)
    # Seed, tool calls and verify: a resources server that takes longer is taken as hung.
    resources_call_timeout_s: float = Field(default=300.0, gt=0, allow_inf_nan=False, strict=True)
    # "Given the model's replies, this agent makes the same calls": a rollout on it can come back by
    # running it again from its prompt while the model server replays its finished calls.
    replayable: bool = Field(default=False, strict=True)

    @field_validator("model_server")
    @classmethod
    def _model_ref(cls, ref: ServerRef) -> ServerRef:
        if ref.type != "responses_api_models":
            raise ValueError(f"model_server must name a responses_api_models server, not {ref.type}/{ref.name}")
        return ref

    @field_validator("resources_server")
    @classmethod
    def _resources_ref(cls, ref: ServerRef) -> ServerRef:
        if ref.type != "resources_servers":
            raise ValueError(f"resources_server must name a resources_servers server, not {ref.type}/{ref.name}")
        return ref
