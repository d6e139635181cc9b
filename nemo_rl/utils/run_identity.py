"""What makes a checkpoint directory belong to one run (``run_identity.json``).

Resuming from a directory another run wrote would mix two runs' prompt groups,
weights or Gym topologies without a word. The first start records the run's
identity (training data digest, model, group size, Gym topology); every later
start compares and refuses, before Ray or any Gym server starts, naming each
difference, unless ``checkpointing.allow_different_run`` is true.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from nemo_rl.utils.snapshot_store import list_trainer_steps, write_json_atomic

logger = logging.getLogger(__name__)
IDENTITY_FILE = "run_identity.json"


class RunIdentityError(ValueError):
    """The checkpoint directory holds another run; the message names what differs."""


class RunIdentity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    train_data_sha256: str
    model_name: str
    num_generations_per_prompt: int
    gym_topology: dict[str, dict[str, object]]  # shard -> {replicas, agents}

    @classmethod
    def of(cls, config: MasterConfig) -> "RunIdentity":
        from nemo_rl.algorithms.single_controller_utils.setup import shard_agents

        data = Path(config.data.train_data_path)
        return cls(
            train_data_sha256=hashlib.sha256(data.read_bytes()).hexdigest(),
            model_name=config.policy.model_name,
            num_generations_per_prompt=config.grpo.num_generations_per_prompt,
            gym_topology={
                shard.name: {"replicas": shard.replicas, "agents": agents}
                for shard, agents in shard_agents(config)
            },
        )

    def differences(self, other: "RunIdentity") -> list[str]:
        out = []
        if self.train_data_sha256 != other.train_data_sha256:
            out.append(f"other training data (sha256 {other.train_data_sha256[:12]}..., "
                       f"this run's {self.train_data_sha256[:12]}...)")
        if self.model_name != other.model_name:
            out.append(f"another model (policy.model_name {other.model_name!r}, this run's {self.model_name!r})")
        if self.num_generations_per_prompt != other.num_generations_per_prompt:
            out.append(f"another group size (grpo.num_generations_per_prompt {other.num_generations_per_prompt}, "
                       f"this run's {self.num_generations_per_prompt})")
        if self.gym_topology != other.gym_topology:
            out.append(f"another Gym topology ({json.dumps(other.gym_topology, sort_keys=True)}, this run's "
                       f"{json.dumps(self.gym_topology, sort_keys=True)})")
        return out


def check_run_identity(config: MasterConfig) -> None:
    """Refuse a checkpoint directory that another run wrote (call before anything starts)."""
    if not config.checkpointing.enabled:
        return
    root = Path(config.checkpointing.checkpoint_dir)
    path = root / IDENTITY_FILE
    if not path.exists():
        if list_trainer_steps(root):
            logger.warning("%s has checkpoints but no %s (an older version wrote them); this run's identity "
                           "is recorded", root, IDENTITY_FILE)
            record_run_identity(config)
        return
    try:
        theirs = RunIdentity.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError) as exc:
        raise RunIdentityError(f"{path}: cannot read the run identity ({exc})") from None
    differs = RunIdentity.of(config).differences(theirs)
    if not differs:
        return
    message = (f"{root} holds checkpoints of a different run: {'; '.join(differs)}. Use another "
               "checkpointing.checkpoint_dir, or set checkpointing.allow_different_run=true to resume anyway")
    if not config.checkpointing.allow_different_run:
        raise RunIdentityError(message)
    logger.warning("%s (checkpointing.allow_different_run=true: resuming anyway; the directory now records this "
                   "run)", message)
    record_run_identity(config)


def record_run_identity(config: MasterConfig) -> None:
    """Write this run's identity into its checkpoint directory (a new run, or an allowed takeover)."""
    root = Path(config.checkpointing.checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / IDENTITY_FILE, RunIdentity.of(config).model_dump(mode="json"))
