"""A run's identity from its config, checked against and recorded in its checkpoint directory
(``run_identity.json``: the file and its comparison are ``nemo_rl.utils.run_identity``; docs/design.md §5.7
for why replica counts are not identity)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import holds_trainer_steps
from nemo_rl.utils.run_identity import RunIdentity, check_identity, record_identity


def identity_of(config: MasterConfig) -> RunIdentity:
    """Training data digest, model, group size, and each Gym shard's replicas and agents."""
    from nemo_rl.algorithms.single_controller_utils.setup import shard_agents

    data = Path(config.data.train_data_path)
    return RunIdentity(
        train_data_sha256=hashlib.sha256(data.read_bytes()).hexdigest(),
        model_name=config.policy.model_name,
        num_generations_per_prompt=config.grpo.num_generations_per_prompt,
        gym_topology={
            shard.name: {"replicas": shard.replicas, "agents": agents}
            for shard, agents in shard_agents(config)
        },
    )


def check_run_identity(config: MasterConfig) -> None:
    """Refuse a checkpoint directory that another run wrote (call before anything starts)."""
    if config.checkpointing.enabled:
        root = Path(config.checkpointing.checkpoint_dir)
        check_identity(root, lambda: identity_of(config), config.checkpointing.allow_different_run,
                       lambda: holds_trainer_steps(root))


def record_run_identity(config: MasterConfig) -> None:
    """Write this run's identity into its checkpoint directory (a new run, or an allowed takeover)."""
    record_identity(Path(config.checkpointing.checkpoint_dir), identity_of(config))
