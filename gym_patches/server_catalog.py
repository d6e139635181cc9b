"""What a process that only checks a Gym config may know about each server implementation, without
importing it: its config model and its checkpoint mode (docs/design.md §3, §5.2).

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

CheckpointMode = Literal["saves", "restart-only", "stateless"]


@dataclass(frozen=True)
class ServerSpec:
    config_model: type[ServerConfigBase]
    checkpoint_mode: CheckpointMode  # the launcher's and ``--check``'s label


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


def check_instance(instance: ServerInstanceConfig) -> CheckpointMode:
    """Validate one server's implementation config (errors name the key); its checkpoint mode."""
    spec = spec_of(instance.server_type, instance.implementation)
    parse_instance_config(spec.config_model, instance)
    return spec.checkpoint_mode


def check_servers(config: GymGlobalConfig) -> dict[str, CheckpointMode]:
    """Every server of a parsed Gym config validated; server name -> its checkpoint mode."""
    return {name: check_instance(instance) for name, instance in config.instances.items()}
