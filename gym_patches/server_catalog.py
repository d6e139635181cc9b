"""What a process that only checks a Gym config may know about each server implementation, without
importing it: its config model and its checkpoint mode, as a config declares it (``replayable``;
docs/design.md §3, §5.2).

The RL driver (its config check and ``--check``) and the launcher call ``check_servers``; only a Gym
server process imports its implementation (``server_main.server_class``). Each implementation's
``SERVER`` class must agree with its entry here (``tests/unit/test_server_catalog.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gym_patches.config import GymConfigError, GymGlobalConfig, ServerInstanceConfig
from gym_patches.server_configs import (
    LoopAgentConfig,
    PythonSandboxConfig,
    ResourcesServerConfig,
    ServerConfigBase,
    VLLMModelConfig,
    parse_instance_config,
)

# The implementation's own label, and what a config's ``replayable: true`` makes of it: a restart-only
# server whose rollouts come back by replay is ``replayed``; a saving one says ``saves, replayable``.
CheckpointMode = Literal["saves", "restart-only", "stateless", "replayed", "saves, replayable"]


@dataclass(frozen=True)
class ServerSpec:
    config_model: type[ServerConfigBase]
    checkpoint_mode: CheckpointMode  # the implementation's label (its ``checkpoint_mode_label()``)


@dataclass(frozen=True)
class DeclaredCheckpoint:
    """One configured server's checkpoint mode as its config declares it: its label (the launcher's
    table), whether it is restart-only, and whether its rollouts can come back by replay (declared with
    ``replayable: true``, or by nature: ``stateless``)."""

    mode: CheckpointMode
    restart_only: bool
    replayable: bool


CATALOG: dict[tuple[str, str], ServerSpec] = {
    ("resources_servers", "workplace_assistant"): ServerSpec(ResourcesServerConfig, "saves"),
    ("resources_servers", "arithmetic_verifier"): ServerSpec(ResourcesServerConfig, "stateless"),
    ("resources_servers", "python_sandbox"): ServerSpec(PythonSandboxConfig, "restart-only"),
    ("responses_api_agents", "simple_agent"): ServerSpec(LoopAgentConfig, "saves"),
    ("responses_api_agents", "plain_loop_agent"): ServerSpec(LoopAgentConfig, "restart-only"),
    ("responses_api_models", "vllm_model"): ServerSpec(VLLMModelConfig, "saves"),
}


def spec_of(server_type: str, implementation: str) -> ServerSpec:
    """The entry of one implementation (``GymConfigError`` naming it when there is none)."""
    spec = CATALOG.get((server_type, implementation))
    if spec is None:
        raise GymConfigError(f"no Gym server implementation {server_type}/{implementation} "
                             f"(module gym_patches.{server_type}.{implementation}.app)")
    return spec


def declared_checkpoint(instance: ServerInstanceConfig) -> DeclaredCheckpoint:
    """Validate one server's implementation config (errors name the key); its checkpoint mode as declared."""
    spec = spec_of(instance.server_type, instance.implementation)
    parsed = parse_instance_config(spec.config_model, instance)
    declared = getattr(parsed, "replayable", False) is True
    base = spec.checkpoint_mode
    if base == "restart-only":
        return DeclaredCheckpoint("replayed" if declared else base, True, declared)
    if base == "saves" and declared:
        return DeclaredCheckpoint("saves, replayable", False, True)
    return DeclaredCheckpoint(base, False, base == "stateless")


def check_instance(instance: ServerInstanceConfig) -> CheckpointMode:
    """Validate one server's implementation config (errors name the key); its checkpoint mode label."""
    return declared_checkpoint(instance).mode


def check_servers(config: GymGlobalConfig) -> dict[str, CheckpointMode]:
    """Every server of a parsed Gym config validated; server name -> its checkpoint mode label."""
    return {name: check_instance(instance) for name, instance in config.instances.items()}


def replay_agents(config: GymGlobalConfig) -> dict[str, str]:
    """Agent -> its model server, for each agent whose rollouts come back by replay (docs/design.md §4.8):
    the agent and the resources server it calls are each declared replayable (or stateless), and at least
    one of them is restart-only (a rollout on saving servers alone continues at its turn, which is better).
    The one rule, from the config alone: the RL driver applies it before anything starts, the launcher too."""
    out: dict[str, str] = {}
    for name, instance in config.instances.items():
        if instance.server_type != "responses_api_agents":
            continue
        resources = (instance.config.get("resources_server") or {}).get("name")
        model = (instance.config.get("model_server") or {}).get("name")
        servers = [declared_checkpoint(instance)]
        if resources and resources in config.instances:
            servers.append(declared_checkpoint(config.instances[resources]))
        if model and all(s.replayable for s in servers) and any(s.restart_only for s in servers):
            out[name] = model
    return out


def with_call_records(raw: dict, config: GymGlobalConfig) -> dict:
    """``raw`` (a deployment's config dict) with ``record_calls: true`` on the model server of every agent
    whose rollouts come back by replay: a model server records its calls only where replay needs them."""
    out = dict(raw)
    for model in sorted(set(replay_agents(config).values())):
        entry = dict(out[model])
        kind = entry[config.instances[model].server_type] = dict(entry[config.instances[model].server_type])
        impl = config.instances[model].implementation
        kind[impl] = {**(kind.get(impl) or {}), "record_calls": True}
        out[model] = entry
    return out
