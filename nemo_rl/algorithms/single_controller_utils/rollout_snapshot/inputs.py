"""What a snapshot may read from the controller (it changes none of it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger


@dataclass
class SnapshotInputs:
    """The controller's state a snapshot reads, as live references (read only inside the pause)."""

    ledger: RolloutRecoveryLedger
    data_plane: DataPlaneStore
    dataloader: PromptDataloader
    step: Callable[[], int]  # the controller's step (trained, possibly not durable yet)
    anchor_step: Callable[[], int]  # the newest durable trainer step: the snapshot belongs to it
    anchor_dir: Callable[[], Path]  # that step's directory
    agent_servers: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # instance -> agent -> servers
    # instance -> agent -> its model server, for agents whose rollouts come back by replay (docs/design.md §4.8):
    # their model servers write their records; their agents and tools save nothing
    replay_models: dict[str, dict[str, str]] = field(default_factory=dict)
    # target_level prefix: prepares take a generation cut of the prefix-level rollouts' calls (§5.10)
    generation_cuts: bool = False
