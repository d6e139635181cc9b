"""A test trainer that records every batch it is given (no model, no gradients).

RL-level tests plug it in to check that each prompt group is trained exactly
once across crashes: its checkpoint holds the batches of its lineage, and
``trained_batches.jsonl`` in the log dir keeps every call, including ones a
crash later rolled back. A step can be fed group by group (``open_step``) under
the same rules as the real trainer's; its batch is the concatenation of the adds.

``SimulatedTrainer`` is a trainer stand-in for throughput benchmarks: the
recording trainer plus a fixed wall-clock time per sample, spent sleeping.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from nemo_rl.algorithms.single_controller_utils.interfaces import StepLedger, already_open
from nemo_rl.experience.sample import RolloutSample
from gym_patches.checkpoint.storage import StorageWriter
from nemo_rl.utils.atomic_write import PLAIN_FILES, write_json_atomic
from nemo_rl.utils.write_errors import naming_write

STATE_FILE = "recording_trainer.json"


class RecordingStep:
    """A ``StreamingStep`` that only collects samples; ``finish`` records them as one batch."""

    def __init__(self, trainer: "RecordingTrainer"):
        self.trainer = trainer
        self.ledger = StepLedger("RecordingStep")
        self._lock = threading.Lock()
        self._samples: list[RolloutSample] = []

    def add(self, samples: list[RolloutSample]) -> None:
        with self._lock:
            self.ledger.check_open("add")
            samples = [s if isinstance(s, RolloutSample) else RolloutSample.model_validate(s) for s in samples]
            group_ids = self.ledger.new_groups(samples)
            self.trainer._spend(len(samples))  # the stand-in's "training" (nothing for the recording trainer)
            self.ledger.commit(group_ids)
            self._samples.extend(samples)

    def finish(self) -> dict[str, float]:
        with self._lock:
            self.ledger.check_finish()
            try:
                metrics = self.trainer._record(self._samples)
            except BaseException as exc:
                self._close(f"failed in finish ({type(exc).__name__}: {exc})")
                raise
            self._close("finished")
            return metrics

    def abort(self) -> None:
        with self._lock:
            if self.ledger.closed is None:
                self._close("aborted")

    def _close(self, why: str) -> None:
        self.ledger.close(why)
        self.trainer._release(self)


class RecordingTrainer:
    """Records every batch it trains (no model, no gradients); takes no time of its own."""

    def __init__(self, log_dir: str | Path):
        self.log_path = Path(log_dir) / "trained_batches.jsonl"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.weight_version = 0
        self.batches: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._open: RecordingStep | None = None

    def open_step(self) -> RecordingStep:
        with self._lock:
            if self._open is not None:
                raise already_open("RecordingTrainer", self._open)
            self._open = RecordingStep(self)
            return self._open

    def _spend(self, samples: int) -> None:
        """What training ``samples`` samples costs besides recording them: nothing here."""

    def _release(self, step: RecordingStep) -> None:
        with self._lock:
            if self._open is step:
                self._open = None

    def train_step(self, samples: list[RolloutSample]) -> dict[str, float]:
        step = self.open_step()
        try:
            step.add(samples)
            return step.finish()
        finally:
            step.abort()  # no-op once finished

    def _record(self, samples: list[RolloutSample]) -> dict[str, float]:
        batch = {
            "weight_version": self.weight_version + 1,
            "groups": sorted({s.group_id for s in samples}),
            "rollout_ids": sorted(s.rollout_id for s in samples),
            "rewards": {s.rollout_id: s.reward for s in samples},
            "gym_instances": {s.rollout_id: s.gym_instance_id for s in samples},
            "restored_from": {s.rollout_id: s.restored_from for s in samples if s.restored_from},
        }
        replayed = _replayed_calls(samples)
        if replayed:  # only rollouts that came back by replay: a batch without any is as before
            batch["replay_calls"] = replayed
        with naming_write(self.log_path), open(self.log_path, "a") as f:
            f.write(json.dumps(batch, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.batches.append(batch)
        self.weight_version += 1
        return {"loss": 0.0, "num_samples": float(len(samples))}

    def save(self, directory: Path, extra_state: dict[str, Any], writer: StorageWriter = PLAIN_FILES) -> None:
        """One file (the lineage), through ``writer``; a failed write raises ``RunWriteError`` naming it,
        like the real trainer."""
        path = Path(directory) / STATE_FILE
        with naming_write(path):
            write_json_atomic(
                path, {"weight_version": self.weight_version, "batches": self.batches, "extra_state": extra_state},
                writer,
            )

    def load(self, directory: Path) -> dict[str, Any]:
        if self._open is not None:
            raise RuntimeError(
                f"RecordingTrainer.load({str(directory)!r}): a step is open; finish() or abort() it first")
        state = json.loads((Path(directory) / STATE_FILE).read_text())
        self.weight_version = int(state["weight_version"])
        self.batches = list(state["batches"])
        return state["extra_state"]


def _replayed_calls(samples: list[RolloutSample]) -> dict[str, list[dict[str, Any]]]:
    """Each call of each rollout that came back by replay (docs/design.md §4.8) as trained: its replay note
    (None: generated live, no note), token ids, logprobs and weight version; so a test can hold them against
    the model record the first attempt left in a snapshot."""
    out = {}
    for s in samples:
        if any(call.replay is not None for call in s.calls):
            out[s.rollout_id] = [{"replay": None if call.replay is None else call.replay.model_dump(mode="json"),
                                  "generation_token_ids": call.generation_token_ids,
                                  "generation_log_probs": call.generation_log_probs,
                                  "weight_version": call.weight_version} for call in s.calls]
    return out


class SimulatedTrainer(RecordingTrainer):
    """A trainer stand-in, not a trainer: the recording trainer that also takes ``seconds_per_sample``
    of wall-clock time per sample, sleeping (no model, no gradients, no CPU).

    With the scripted backend decoding at a fixed rate (``policy.scripted_backend.tokens_per_s``) it
    gives generation and training each their own timeline, so async against sync measures what the
    controller overlaps and not how two processes share the cores (``policy.simulated_trainer``;
    docs/benchmarks.md, "Async on simulated devices"). The time is spent in ``add``, group by group,
    like the real trainer's forward and backward passes; ``finish`` only records.
    """

    def __init__(self, log_dir: str | Path, seconds_per_sample: float):
        if not seconds_per_sample > 0:
            raise ValueError(f"policy.simulated_trainer.seconds_per_sample={seconds_per_sample!r}: must be > 0")
        super().__init__(log_dir)
        self.seconds_per_sample = float(seconds_per_sample)

    def _spend(self, samples: int) -> None:
        time.sleep(samples * self.seconds_per_sample)
