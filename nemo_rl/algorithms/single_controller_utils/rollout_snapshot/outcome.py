"""What one snapshot attempt did, how a failure is classified, and the ``snapshots.jsonl`` row."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nemo_rl.algorithms.single_controller_utils.gym_coordinator import (
    GymCheckpointNotReady,
    GymCheckpointOperationError,
    GymReplicasLeftOut,
    is_transient_gym_checkpoint_failure,
)

if TYPE_CHECKING:
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import SnapshotCounts, SnapshotKeys


class SnapshotSuperseded(RuntimeError):
    """An attempt dropped because training moved on (``reason: superseded``, not a failure). Nothing
    raises it since an overtaken snapshot is kept (docs/design.md §5.9); older rows still carry it."""


@dataclass
class SnapshotOutcome:
    """One snapshot attempt as ``snapshots.jsonl`` records it.

    ``committed`` becomes true the moment the directory is published and never
    goes back: an error after the publish is recorded next to it
    (``post_publish_error``), it does not un-commit a snapshot a restart uses.
    """

    checkpoint_id: str
    mode: str  # the stager's: staged | blocking | ledger_only
    step: int  # the controller's step when the attempt began (training may have moved on since)
    anchor_step: int = 0  # the durable trainer step it belongs to (restore re-trains any step after it)
    requested: str | None = None  # the signal that asked for it (SIGUSR1; SIGTERM/SIGINT: the final one)
    overtaken_by: int | None = None  # a newer trainer step published while it was taken (kept all the same)
    committed: bool = False
    reason: str = ""
    saved: int = 0
    unsaved: int = 0  # turn-level rollouts on restart-only servers (restart from the prompt)
    replayed: int = 0  # turn-level rollouts on restart-only servers whose record was written for replay (§4.8)
    not_admitted: int = 0  # turn-level rollouts Gym had refused while closed (restart from the prompt)
    # Of ``saved`` / ``unsaved``: rollouts no earlier committed snapshot of the run counted (0 unless it
    # commits); the summary adds these up to count distinct rollouts (docs/design.md §5.4).
    new_saved: int = 0
    new_unsaved: int = 0
    phases_s: dict[str, float] = field(default_factory=dict)  # seconds since the attempt began, per phase end
    pause_s: float = 0.0  # rollouts held (the dispatch gate closed and Gym prepared)
    persist_s: float = 0.0  # after rollouts resumed: Gym's writes (staged) and the publish
    captured_bytes: int = 0  # the in-memory copies the pause took (Gym records and the data plane)
    captured_bytes_by_server: dict[str, int] = field(default_factory=dict)  # "<instance>/<server>" -> staged copy
    cut_asked: bool = False  # target_level prefix: the prepare asked every model server for a generation cut
    cuts: int = 0  # saved turn-level rollouts whose model call in flight was cut (continues from its tokens)
    cut_tokens: int = 0  # tokens those cuts hold
    cut_failed: int = 0  # calls in flight that got no cut (regenerate at turn level)
    cut_error: str | None = None  # why a model server's cut failed, naming the server
    path: str | None = None
    saved_on: list[str] = field(default_factory=list)  # replicas whose rollouts it saved (§5.12)
    blockers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # replicas that could not be parked in time and left this snapshot -> why (names the server)
    left_out: dict[str, str] = field(default_factory=dict)
    left_out_rollouts: int = 0  # turn-level rollouts in flight on them: not saved in this snapshot
    post_publish_error: str | None = None
    error: str | None = None  # why an attempt that did not commit failed (names the file for an I/O error)
    started: float = field(default_factory=time.monotonic, repr=False)
    _keys: "SnapshotKeys | None" = field(default=None, init=False, repr=False, compare=False)

    def count(self, counts: "SnapshotCounts") -> None:
        """Take the snapshot's counts (in the pause); its first counts are settled by ``row`` if it commits."""
        self.saved, self.unsaved, self.not_admitted = counts.saved, counts.unsaved, counts.not_admitted
        self.replayed = counts.replayed
        self._keys = counts.keys

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def mark(self, phase: str) -> None:
        """Record when ``phase`` ended (seconds since the attempt began)."""
        self.phases_s[phase] = round(self.elapsed(), 4)

    def failed(self, exc: BaseException) -> None:
        """Record why an attempt that did not commit failed."""
        self.reason = classify_failure(exc)
        self.error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, GymCheckpointNotReady):
            self.blockers = exc.blockers
        if isinstance(exc, (GymCheckpointNotReady, GymReplicasLeftOut)):
            self.left_out = exc.left_out

    def row(self) -> dict[str, Any]:
        """The keyword arguments of ``RunRecords.snapshot_attempt``. The snapshotter asks once, when the
        attempt is over (after the pause): a committed one settles its first counts here, so an attempt
        that did not commit leaves its rollouts to the next that does."""
        if self.committed and self._keys is not None:
            self.new_saved, self.new_unsaved = self._keys.settle()
            self._keys = None
        return dict(
            checkpoint_id=self.checkpoint_id,
            committed=self.committed,
            reason=self.reason,
            saved=self.saved,
            unsaved=self.unsaved,
            **({"replayed": self.replayed} if self.replayed else {}),
            new_saved=self.new_saved,
            new_unsaved=self.new_unsaved,
            not_admitted=self.not_admitted,
            pause_s=self.pause_s,
            persist_s=round(self.persist_s, 4),
            phases_s=self.phases_s,
            commit_mode=self.mode,
            captured_bytes=self.captured_bytes,
            captured_bytes_by_server=self.captured_bytes_by_server,
            **({"cuts": self.cuts, "cut_tokens": self.cut_tokens, "cut_failed": self.cut_failed}
               if self.cut_asked else {}),
            **({"cut_error": self.cut_error} if self.cut_error else {}),
            step=self.step,
            anchor_step=self.anchor_step,
            **({"overtaken_by": self.overtaken_by} if self.overtaken_by is not None else {}),
            **({"requested": self.requested} if self.requested else {}),
            path=self.path,
            blocking_servers=sorted({s for v in self.blockers.values() for s in v}),
            **({"left_out": self.left_out, "left_out_rollouts": self.left_out_rollouts} if self.left_out else {}),
            **({"post_publish_error": self.post_publish_error} if self.post_publish_error else {}),
            **({"error": self.error} if self.error and not self.committed else {}),
        )


def _leaf_codes(exc: BaseException) -> set[str | None]:
    """The error codes of every server a (possibly nested) Gym failure names."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return set().union(*(_leaf_codes(e) for e in failures.values()))
    return {getattr(exc, "code", None)}


def classify_failure(exc: BaseException) -> str:
    """The ``reason`` of a failed attempt; ``invariant_error`` stops the run, ``""`` is not recorded."""
    if isinstance(exc, SnapshotSuperseded):
        return "superseded"
    if isinstance(exc, (GymCheckpointNotReady, GymReplicasLeftOut)):
        return "gym_unavailable"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, GymCheckpointOperationError):
        if exc.failures and _leaf_codes(exc) == {"invalid_checkpoint_state"}:
            return "io_error"  # Gym could not write its records (disk full, I/O error): names the file
        return "gym_unavailable" if is_transient_gym_checkpoint_failure(exc) else "invariant_error"
    if isinstance(exc, OSError):
        return "io_error"
    if isinstance(exc, asyncio.CancelledError):
        return ""  # the run is stopping: not an attempt worth a record
    return "invariant_error"


def failed_replicas(exc: BaseException) -> list[str]:
    """The Gym replicas a failed attempt names (left out of it, not ready, or failing an operation)."""
    named = set(getattr(exc, "left_out", None) or {}) | set(getattr(exc, "blockers", None) or {})
    named |= set(getattr(exc, "failures", None) or {})
    return sorted(named)


def survives_publish(exc: BaseException) -> bool:
    """An error after the publish that leaves the run going (the snapshot stands either way)."""
    return isinstance(exc, Exception) and (
        isinstance(exc, (TimeoutError, OSError)) or is_transient_gym_checkpoint_failure(exc))
