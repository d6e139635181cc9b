"""Gym deployment config: global keys plus server instances, three levels deep.

An instance is ``<name>: {<server_type>: {<implementation>: {...impl config}}}``;
every other top-level key is global. The resolved dict (ports filled in) is
what the head server publishes and what every server process reads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gym_patches.checkpoint.storage import StorageWriterSpec

ServerType = Literal["responses_api_models", "responses_api_agents", "resources_servers"]
SERVER_TYPES: tuple[str, ...] = ("responses_api_models", "responses_api_agents", "resources_servers")
SERVER_KIND: dict[str, str] = {
    "responses_api_models": "model",
    "responses_api_agents": "agent",
    "resources_servers": "resources",
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,99}$")
_IMPL = re.compile(r"^[a-z_][a-z0-9_]*$")

CONFIG_DICT_ENV = "NEMO_GYM_CONFIG_DICT"
CONFIG_PATH_ENV = "NEMO_GYM_CONFIG_PATH"
LISTEN_FD_ENV = "NEMO_GYM_LISTEN_FD"  # a listening socket the launcher bound for this server


class GymConfigError(ValueError):
    """A Gym config that cannot run; the message names the key or instance."""


class CheckpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    control_auth_token: str | None = None
    lease_grace_seconds: float = Field(default=600.0, gt=0)
    # The writer of this server's checkpoint files (None: plain files); under RL, RL sets it from
    # checkpointing.storage_writer so every process of a run writes the same way (docs/design.md §4.7).
    storage_writer: StorageWriterSpec | None = None


class HeadServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)


class ServerRef(BaseModel):
    """How one server names another (e.g. an agent's model and resources)."""

    model_config = ConfigDict(extra="forbid")

    type: ServerType
    name: str


class ServerInstanceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    server_type: ServerType
    implementation: str
    host: str = "127.0.0.1"
    port: int = 0
    config: dict[str, Any] = Field(default_factory=dict)

    @property
    def kind(self) -> str:
        return SERVER_KIND[self.server_type]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class GymGlobalConfig(BaseModel):
    """Parsed deployment config. ``raw`` keeps the dict for republishing."""

    model_config = ConfigDict(extra="forbid")

    head_server: HeadServerConfig = Field(default_factory=HeadServerConfig)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    policy_base_url: str | None = None
    policy_api_key: str = "dummy_key"
    policy_model_name: str = "policy"
    # How long a model server keeps sending a call again while the policy backend cannot be reached (refused,
    # reset, closed): a generation worker being restarted by its owner. 0: the call fails at once (502).
    policy_unreachable_retry_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    default_host: str = "127.0.0.1"
    instances: dict[str, ServerInstanceConfig] = Field(default_factory=dict)
    extra_globals: dict[str, Any] = Field(default_factory=dict)

    def instance(self, name: str) -> ServerInstanceConfig:
        try:
            return self.instances[name]
        except KeyError:
            known = ", ".join(sorted(self.instances)) or "(none)"
            raise GymConfigError(f"unknown Gym server {name!r}; configured servers: {known}") from None

    def to_dict(self) -> dict[str, Any]:
        """The three-level dict form (with resolved hosts and ports)."""
        out: dict[str, Any] = dict(self.extra_globals)
        out["head_server"] = self.head_server.model_dump()
        out["checkpoint"] = self.checkpoint.model_dump()
        out["policy_api_key"] = self.policy_api_key
        out["policy_model_name"] = self.policy_model_name
        out["policy_unreachable_retry_s"] = self.policy_unreachable_retry_s
        out["default_host"] = self.default_host
        if self.policy_base_url is not None:
            out["policy_base_url"] = self.policy_base_url
        for name, inst in self.instances.items():
            body = dict(inst.config)
            body["host"] = inst.host
            body["port"] = inst.port
            out[name] = {inst.server_type: {inst.implementation: body}}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=True)


_GLOBAL_KEYS = {
    "head_server",
    "checkpoint",
    "policy_base_url",
    "policy_api_key",
    "policy_model_name",
    "policy_unreachable_retry_s",
    "default_host",
}


def _is_instance(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SERVER_TYPES


def parse_gym_config(data: dict[str, Any]) -> GymGlobalConfig:
    """Split globals from instances and validate both, naming any bad key."""
    if not isinstance(data, dict):
        raise GymConfigError(f"Gym config must be a mapping, got {type(data).__name__}")
    globals_: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    instances: dict[str, ServerInstanceConfig] = {}
    for key, value in data.items():
        if key in _GLOBAL_KEYS:
            globals_[key] = value
        elif _is_instance(value):
            if not _NAME.match(str(key)):
                raise GymConfigError(f"Gym server name {key!r} must match {_NAME.pattern}")
            (server_type, impls), = value.items()
            if not isinstance(impls, dict) or len(impls) != 1:
                raise GymConfigError(
                    f"{key}.{server_type} must hold exactly one implementation mapping, got {impls!r}"
                )
            (impl, body), = impls.items()
            if not _IMPL.match(str(impl)):
                raise GymConfigError(f"{key}.{server_type}: implementation name {impl!r} is not valid")
            body = dict(body or {})
            host = body.pop("host", data.get("default_host", "127.0.0.1"))
            port = body.pop("port", 0)
            try:
                instances[key] = ServerInstanceConfig(
                    name=key, server_type=server_type, implementation=impl, host=host, port=port, config=body
                )
            except ValidationError as exc:
                raise GymConfigError(f"{key}.{server_type}.{impl}: {_errors(exc)}") from None
        elif isinstance(value, dict) and any(k in SERVER_TYPES for k in value):
            raise GymConfigError(
                f"{key}: a server instance must have exactly one server type key ({', '.join(SERVER_TYPES)})"
            )
        else:
            extra[key] = value
    try:
        cfg = GymGlobalConfig(**globals_, instances=instances, extra_globals=extra)
    except ValidationError as exc:
        raise GymConfigError(f"Gym config: {_errors(exc)}") from None
    if cfg.checkpoint.enabled and not cfg.checkpoint.control_auth_token:
        raise GymConfigError("checkpoint.control_auth_token is required when checkpoint.enabled is true")
    _check_refs(cfg)
    return cfg


def _check_refs(cfg: GymGlobalConfig) -> None:
    for inst in cfg.instances.values():
        for key in ("model_server", "resources_server"):
            ref = inst.config.get(key)
            if ref is None:
                continue
            try:
                parsed = ServerRef(**ref)
            except (TypeError, ValidationError) as exc:
                raise GymConfigError(f"{inst.name}.{key}: {exc}") from None
            target = cfg.instances.get(parsed.name)
            if target is None or target.server_type != parsed.type:
                raise GymConfigError(
                    f"{inst.name}.{key} refers to {parsed.type}/{parsed.name}, which is not configured"
                )


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
    )


def load_gym_config(path: str | Path | list[str | Path]) -> GymGlobalConfig:
    """Load and merge one or more Gym YAML files (later files win, shallowly per top key)."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    merged: dict[str, Any] = {}
    for p in paths:
        p = Path(p)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except FileNotFoundError:
            raise GymConfigError(f"Gym config file not found: {p}") from None
        except yaml.YAMLError as exc:
            raise GymConfigError(f"Gym config file {p} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise GymConfigError(f"Gym config file {p} must hold a mapping")
        merged.update(data)
    return parse_gym_config(merged)
