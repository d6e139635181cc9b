"""The two components the single controller plugs in: a trainer and a generation backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from nemo_rl.experience.sample import RolloutSample


class Trainer(Protocol):
    """Consumes complete prompt groups; checkpoints itself into a directory it is given."""

    weight_version: int

    def train_step(self, samples: list[RolloutSample]) -> dict[str, float]: ...

    def save(self, directory: Path, extra_state: dict[str, Any]) -> None: ...

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore from ``directory``; return the ``extra_state`` given to ``save``."""
        ...


class GenerationBackend(Protocol):
    """Serves OpenAI-compatible chat completions at ``base_url``; Gym's model server calls it."""

    base_url: str

    def refit(self, trainer: Trainer) -> None: ...

    def stop(self) -> None: ...
