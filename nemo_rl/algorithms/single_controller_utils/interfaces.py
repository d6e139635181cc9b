"""The two components the single controller plugs in: a trainer and a generation backend.

A trainer's step can be fed in pieces (``open_step``): whole prompt groups are
added as they complete, so training starts while the step's last groups still
generate; the step is still one optimizer step over all of them.
``StepLedger`` holds the rules every such step enforces, so the real trainer
and the recording fake reject the same mistakes with the same messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from gym_patches.checkpoint.storage import StorageWriter
from nemo_rl.experience.sample import RolloutSample


class StreamingStep(Protocol):
    """One optimizer step fed whole prompt groups as they complete.

    ``add`` takes whole groups, each once; ``finish`` takes the optimizer step and
    returns its metrics, after which the step is spent. ``abort`` drops what was
    added (weights and counters stay as they were), so a failed or cancelled step
    does not leave the trainer unable to open another.
    """

    def add(self, samples: list[RolloutSample]) -> None: ...

    def finish(self) -> dict[str, float]: ...

    def abort(self) -> None: ...


class Trainer(Protocol):
    """Consumes complete prompt groups; checkpoints itself into a directory it is given."""

    weight_version: int

    def open_step(self) -> StreamingStep:
        """Start a step; one open at a time. ``train_step(s)`` is ``open_step()``, ``add(s)``, ``finish()``."""
        ...

    def train_step(self, samples: list[RolloutSample]) -> dict[str, float]: ...

    def save(self, directory: Path, extra_state: dict[str, Any], writer: StorageWriter) -> None:
        """Every file into ``directory`` through ``writer`` (the run store's)."""
        ...

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore from ``directory``; return the ``extra_state`` given to ``save``."""
        ...


class GenerationBackend(Protocol):
    """Serves OpenAI-compatible chat completions at ``base_url``; Gym's model server calls it."""

    base_url: str

    def refit(self, trainer: Trainer) -> None: ...

    def stop(self) -> None: ...


class StepLedger:
    """The rules of a ``StreamingStep``: whole prompt groups, each in exactly one ``add``; nothing after
    ``finish`` or ``abort``. Checks raise before anything changes, so a rejected ``add`` leaves the
    step as it was."""

    def __init__(self, name: str):
        self.name = name  # e.g. "GRPOStreamingStep", used in every message
        self.group_ids: list[str] = []  # in the order they were added
        self._seen: set[str] = set()
        self.closed: str | None = None  # why the step takes nothing more ("finished", "aborted", a failure)

    def check_open(self, verb: str) -> None:
        if self.closed is not None:
            raise RuntimeError(f"{self.name}.{verb}: this step is {self.closed}; open a new one with open_step()")

    def new_groups(self, samples: list[RolloutSample]) -> list[str]:
        """The group ids of one ``add``, in order; raises if the add is empty or repeats a group."""
        self.check_open("add")
        if not samples:
            raise ValueError(f"{self.name}.add needs at least one RolloutSample (whole prompt groups)")
        ids = list(dict.fromkeys(s.group_id for s in samples))
        for g in ids:
            if g in self._seen:
                raise ValueError(
                    f"{self.name}.add: group {g!r} was already added to this step; a prompt group is "
                    "added whole, in one add (split across adds, or added twice)"
                )
        return ids

    def commit(self, group_ids: list[str]) -> None:
        self.group_ids.extend(group_ids)
        self._seen.update(group_ids)

    def check_finish(self) -> None:
        self.check_open("finish")
        if not self._seen:
            raise ValueError(f"{self.name}.finish: nothing was added; a step needs at least one RolloutSample")

    def close(self, why: str) -> None:
        self.closed = why


def already_open(owner: str, step: Any) -> RuntimeError:
    """The error for ``open_step`` while ``step`` is still open on ``owner``."""
    n = len(getattr(getattr(step, "ledger", None), "group_ids", ()))
    return RuntimeError(
        f"{owner}.open_step: a step is already open on this trainer ({n} group(s) added); "
        "finish() or abort() it before opening another"
    )
