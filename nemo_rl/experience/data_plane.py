"""Sealed rollout samples waiting for training, keyed by rollout id (capture key).

The ledger says which attempts are sealed; this store holds their tokens,
logprobs and rewards. Both go into the same snapshot, so after a restore every
sealed sibling the ledger keeps has exactly one sample here (docs/design.md §5.3).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import ValidationError

from nemo_rl.experience.sample import RolloutSample
from gym_patches.checkpoint.storage import StorageWriter
from nemo_rl.utils.atomic_write import PLAIN_FILES, write_bytes_atomic

DATA_PLANE_FILE = "rollout_samples.jsonl"


class DataPlaneError(ValueError):
    """A store operation or file that does not fit (names the rollout id or file)."""


class DataPlaneCapture:
    """The store's lines at one moment (a snapshot's pause): taken in O(samples) without encoding or
    hashing; ``encode`` builds the file and its digest later, off the pause."""

    def __init__(self, lines: dict[str, bytes]):
        self._lines = lines

    def __len__(self) -> int:
        return len(self._lines)

    @property
    def nbytes(self) -> int:
        return sum(map(len, self._lines.values()))

    def encode(self) -> tuple[bytes, dict]:
        """The JSONL bytes (sorted by id) and ``{file, sha256, count}``."""
        data = b"".join(self._lines[k] for k in sorted(self._lines))
        return data, {"file": DATA_PLANE_FILE, "sha256": hashlib.sha256(data).hexdigest(), "count": len(self._lines)}


class DataPlaneStore:
    def __init__(self) -> None:
        self._samples: dict[str, RolloutSample] = {}
        # each sample's line, encoded once when it is sealed (samples never change afterwards), so a
        # snapshot's pause copies references instead of serialising every sample while rollouts wait
        self._lines: dict[str, bytes] = {}

    def put(self, sample: RolloutSample) -> None:
        if sample.rollout_id in self._samples:
            raise DataPlaneError(f"rollout {sample.rollout_id} is already in the data plane")
        self._samples[sample.rollout_id] = sample
        self._lines[sample.rollout_id] = sample.__pydantic_serializer__.to_json(sample) + b"\n"

    def get(self, rollout_id: str) -> RolloutSample:
        try:
            return self._samples[rollout_id]
        except KeyError:
            raise DataPlaneError(f"rollout {rollout_id} is not in the data plane") from None

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._samples

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(list(self._samples.values()))

    def rollout_ids(self) -> set[str]:
        return set(self._samples)

    def group_samples(self, group_id: str) -> list[RolloutSample]:
        """The group's samples ordered by generation_index (left in the store)."""
        samples = sorted(
            (s for s in self._samples.values() if s.group_id == group_id),
            key=lambda s: s.generation_index,
        )
        for a, b in zip(samples, samples[1:]):
            if a.generation_index == b.generation_index:
                raise DataPlaneError(
                    f"group {group_id} has two samples for generation {a.generation_index}: "
                    f"{a.rollout_id} and {b.rollout_id}"
                )
        return samples

    def pop_group(self, group_id: str) -> list[RolloutSample]:
        """Remove and return the group's samples ordered by generation_index."""
        samples = self.group_samples(group_id)
        for sample in samples:
            del self._samples[sample.rollout_id]
            del self._lines[sample.rollout_id]
        return samples

    def discard(self, rollout_ids: Iterable[str]) -> int:
        """Drop samples that no longer belong to a group; unknown ids are ignored."""
        removed = 0
        for rollout_id in rollout_ids:
            if self._samples.pop(rollout_id, None) is not None:
                del self._lines[rollout_id]
                removed += 1
        return removed

    # ----- persistence -----------------------------------------------------
    def capture(self) -> DataPlaneCapture:
        """A copy of the store's lines that nothing later changes (cheap: the lines are shared)."""
        return DataPlaneCapture(dict(self._lines))

    def dump(self) -> tuple[bytes, dict]:
        """The store as JSONL bytes (sorted by id) and ``{file, sha256, count}``."""
        return self.capture().encode()

    @staticmethod
    def write_dump(directory: str | Path, data: bytes, writer: StorageWriter) -> None:
        """``data`` (from ``dump`` or a capture) written atomically through ``writer``."""
        write_bytes_atomic(Path(directory) / DATA_PLANE_FILE, data, writer)

    def save(self, directory: str | Path, writer: StorageWriter = PLAIN_FILES) -> dict:
        """Write one JSONL file (sorted by id) atomically; returns ``{file, sha256, count}``."""
        data, meta = self.dump()
        self.write_dump(directory, data, writer)
        return meta

    @classmethod
    def load(
        cls, directory: str | Path, expected_sha256: str, expected_count: int | None = None
    ) -> "DataPlaneStore":
        """Read a saved store, verifying its digest (and count) first."""
        path = Path(directory) / DATA_PLANE_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataPlaneError(f"{path}: missing") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected_sha256:
            raise DataPlaneError(f"{path}: sha256 {digest} does not match expected {expected_sha256}")
        store = cls()
        for lineno, line in enumerate(data.decode().splitlines(), start=1):
            try:
                sample = RolloutSample.model_validate_json(line)
            except ValidationError as exc:
                raise DataPlaneError(f"{path}:{lineno}: invalid sample: {exc.errors()[0]['msg']}") from None
            try:
                store.put(sample)
            except DataPlaneError as exc:
                raise DataPlaneError(f"{path}:{lineno}: {exc}") from None
        if expected_count is not None and len(store) != expected_count:
            raise DataPlaneError(f"{path}: {len(store)} samples, expected {expected_count}")
        return store
