"""A test trainer that records every batch it is given (no model, no gradients).

RL-level tests plug it in to check that each prompt group is trained exactly
once across crashes: its checkpoint holds the batches of its lineage, and
``trained_batches.jsonl`` in the log dir keeps every call, including ones a
crash later rolled back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nemo_rl.experience.sample import RolloutSample
from nemo_rl.utils.snapshot_store import write_json_atomic
from nemo_rl.utils.write_errors import naming_write

STATE_FILE = "recording_trainer.json"


class RecordingTrainer:
    def __init__(self, log_dir: str | Path):
        self.log_path = Path(log_dir) / "trained_batches.jsonl"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.weight_version = 0
        self.batches: list[dict[str, Any]] = []

    def train_step(self, samples: list[RolloutSample]) -> dict[str, float]:
        batch = {
            "weight_version": self.weight_version + 1,
            "groups": sorted({s.group_id for s in samples}),
            "rollout_ids": sorted(s.rollout_id for s in samples),
            "rewards": {s.rollout_id: s.reward for s in samples},
            "gym_instances": {s.rollout_id: s.gym_instance_id for s in samples},
            "restored_from": {s.rollout_id: s.restored_from for s in samples if s.restored_from},
        }
        with naming_write(self.log_path), open(self.log_path, "a") as f:
            f.write(json.dumps(batch, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.batches.append(batch)
        self.weight_version += 1
        return {"loss": 0.0, "num_samples": float(len(samples))}

    def save(self, directory: Path, extra_state: dict[str, Any]) -> None:
        """One file (the lineage); a failed write raises ``RunWriteError`` naming it, like the real trainer."""
        path = Path(directory) / STATE_FILE
        with naming_write(path):
            write_json_atomic(
                path, {"weight_version": self.weight_version, "batches": self.batches, "extra_state": extra_state},
            )

    def load(self, directory: Path) -> dict[str, Any]:
        state = json.loads((Path(directory) / STATE_FILE).read_text())
        self.weight_version = int(state["weight_version"])
        self.batches = list(state["batches"])
        return state["extra_state"]
