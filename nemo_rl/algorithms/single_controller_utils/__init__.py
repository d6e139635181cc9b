"""Helpers of the single-controller GRPO driver (config loading and validation)."""

from nemo_rl.algorithms.single_controller_utils.config import (
    ConfigError,
    MasterConfig,
    RolloutCheckpointConfig,
    RolloutRecoveryConfig,
    load_config,
)

__all__ = [
    "ConfigError",
    "MasterConfig",
    "RolloutCheckpointConfig",
    "RolloutRecoveryConfig",
    "load_config",
]
