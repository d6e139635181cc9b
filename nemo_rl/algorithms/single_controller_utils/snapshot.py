"""One rollout snapshot: prepare -> commit -> drain -> ownership check -> publish -> resume.

The same shape as ``torch.distributed.checkpoint``: Gym plans (prepare) and
writes its records (commit); the controller commits its own state and
publishes the directory atomically; Gym is resumed whatever happens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gym_patches.checkpoint.identity import EpisodeId
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import (
    GymCheckpointNotReady,
    GymCheckpointOperationError,
    is_transient_gym_checkpoint_failure,
)
from nemo_rl.algorithms.single_controller_utils.snapshot_cut import (
    GymOwnershipError,  # noqa: F401 - re-exported: the error a bad cut raises
    check_cut,
    cut_counts,
    plan_cut,
)
from nemo_rl.experience.rollout_recovery import RolloutAttemptStatus
from nemo_rl.utils.fault_injection import crash_point
from nemo_rl.utils.snapshot_store import (
    MANIFEST_NAME,
    SnapshotSelection,
    SnapshotStoreError,
    commit_snapshot,
    prepare_snapshot_paths,
    resolve_latest_snapshot,
    snapshot_sequence,
    snapshots_root,
    verify_directory,
    write_json_atomic,
)

if TYPE_CHECKING:
    from nemo_rl.algorithms.single_controller import SingleController

GYM_CHECKPOINT_SCHEMA_VERSION = 2
GYM_CHECKPOINT_FILE = "gym_checkpoint.json"
CONTROLLER_STATE_FILE = "controller_state.json"


def required_snapshot_files(turn_checkpointing: bool) -> tuple[str, ...]:
    """What every usable snapshot holds: the controller state, plus Gym's index when turns are saved."""
    return (CONTROLLER_STATE_FILE, GYM_CHECKPOINT_FILE) if turn_checkpointing else (CONTROLLER_STATE_FILE,)


def resolve_restorable_snapshot(anchor: str | Path, required: tuple[str, ...]) -> SnapshotSelection:
    """The newest snapshot that verifies *and* lists every ``required`` file; the rest are skipped.

    A snapshot sealed without ``gym_checkpoint.json`` would otherwise restore
    every saved rollout from its prompt without a word, so it is reported and
    an older complete one is used instead.
    """
    selection = resolve_latest_snapshot(anchor)
    skipped = list(selection.skipped)
    path, manifest = selection.path, selection.manifest
    while path is not None and manifest is not None:
        missing = [name for name in required if name not in manifest.files]
        if not missing:
            return SnapshotSelection(path, skipped, manifest)
        why = "every snapshot needs it" if missing[0] == CONTROLLER_STATE_FILE else "turn-level restore needs it"
        skipped.append((path, f"{path / missing[0]}: missing (not listed in {path / MANIFEST_NAME}; {why})"))
        path, manifest = _next_older_valid(Path(anchor), snapshot_sequence(path.name) or 0, skipped)
    return SnapshotSelection(None, skipped)


def _next_older_valid(anchor: Path, below: int, skipped: list[tuple[Path, str]]):
    """The newest snapshot with a sequence below ``below`` that verifies (adds the bad ones to ``skipped``)."""
    known = {p for p, _ in skipped}
    older = []
    for path in snapshots_root(anchor).iterdir():
        seq = snapshot_sequence(path.name)
        if seq is not None and seq < below and path.is_dir() and not path.name.startswith(".") and path not in known:
            older.append((seq, path))
    for seq, path in sorted(older, reverse=True):
        try:
            manifest = verify_directory(path, "rollout_snapshot")
        except SnapshotStoreError as exc:
            skipped.append((path, str(exc)))
            continue
        if manifest.sequence != seq:
            skipped.append((path, f"{path / MANIFEST_NAME}: sequence {manifest.sequence} does not match the name"))
            continue
        return path, manifest
    return None, None


@dataclass
class SnapshotOutcome:
    """One snapshot attempt as ``snapshots.jsonl`` records it.

    ``committed`` becomes true the moment the directory is published and never
    goes back: an error after the publish is recorded next to it
    (``post_publish_error``), it does not un-commit a snapshot a restart uses.
    """

    checkpoint_id: str
    committed: bool = False
    reason: str = ""
    saved: int = 0
    unsaved: int = 0  # turn-level rollouts on restart-only servers (restart from the prompt)
    not_admitted: int = 0  # turn-level rollouts Gym had refused while closed (restart from the prompt)
    pause_s: float = 0.0
    path: str | None = None
    blockers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    post_publish_error: str | None = None


class RolloutSnapshotter:
    """Takes snapshots for one controller; counts consecutive failures."""

    def __init__(self, controller: "SingleController"):
        self.c = controller
        self.consecutive_failures = 0

    async def attempt(self) -> SnapshotOutcome:
        c = self.c
        outcome = SnapshotOutcome(f"rollout-{uuid.uuid4().hex[:12]}")
        started = time.monotonic()
        c.dispatch_open.clear()
        try:
            await self._retire_dropped(outcome.checkpoint_id)
            async with c.coordinator.prepared(outcome.checkpoint_id) as prepared:
                await self._commit_and_publish(prepared, outcome)
            outcome.reason = "committed"
            self.consecutive_failures = 0
        except BaseException as exc:
            if outcome.committed:
                # Published: the snapshot stands. Record what failed after it, then let fatal errors stop the run.
                outcome.reason = "committed"
                outcome.post_publish_error = f"{type(exc).__name__}: {exc}"
                self.consecutive_failures = 0
                if isinstance(exc, Exception) and (
                    isinstance(exc, (TimeoutError, OSError)) or is_transient_gym_checkpoint_failure(exc)
                ):
                    return outcome
                raise
            outcome.reason = self._classify(exc)
            if outcome.reason == "invariant_error" or not isinstance(exc, Exception):
                raise
            if isinstance(exc, GymCheckpointNotReady):
                outcome.blockers = exc.blockers
            self._failed(exc)
        finally:
            c.dispatch_open.set()
            outcome.pause_s = time.monotonic() - started
            if outcome.reason:
                c.records.snapshot_attempt(
                    checkpoint_id=outcome.checkpoint_id,
                    committed=outcome.committed,
                    reason=outcome.reason,
                    saved=outcome.saved,
                    unsaved=outcome.unsaved,
                    not_admitted=outcome.not_admitted,
                    pause_s=outcome.pause_s,
                    step=c.step,
                    path=outcome.path,
                    blocking_servers=sorted({s for v in outcome.blockers.values() for s in v}),
                    **({"post_publish_error": outcome.post_publish_error} if outcome.post_publish_error else {}),
                )
        return outcome

    @staticmethod
    def _classify(exc: BaseException) -> str:
        """The ``reason`` of a failed attempt; ``invariant_error`` stops the run."""
        if isinstance(exc, GymCheckpointNotReady):
            return "gym_unavailable"
        if isinstance(exc, TimeoutError):
            return "timeout"
        if isinstance(exc, GymCheckpointOperationError):
            return "gym_unavailable" if is_transient_gym_checkpoint_failure(exc) else "invariant_error"
        if isinstance(exc, OSError):
            return "io_error"
        if isinstance(exc, asyncio.CancelledError):
            return ""  # the run is stopping: not an attempt worth a record
        return "invariant_error"

    def _failed(self, exc: BaseException) -> None:
        self.consecutive_failures += 1
        limit = self.c.config.rollout_checkpointing.max_consecutive_failures
        if self.consecutive_failures >= limit:
            raise RuntimeError(
                f"{self.consecutive_failures} consecutive rollout snapshots failed "
                f"(rollout_checkpointing.max_consecutive_failures={limit}); last error: {exc}"
            ) from exc

    async def _retire_dropped(self, cid: str) -> None:
        """Gym accepts retire only while idle, so dropped episodes go before prepare."""
        c = self.c
        if not c.pending_retirements:
            return
        batch = {iid: list(eps) for iid, eps in c.pending_retirements.items() if eps}
        await c.coordinator.retire(cid, batch)
        for iid, eps in batch.items():
            remaining = [e for e in c.pending_retirements.get(iid, []) if e not in eps]
            c.pending_retirements[iid] = remaining

    async def _commit_and_publish(self, prepared, outcome: SnapshotOutcome) -> None:
        c = self.c
        crash_point("prepare", c.step)  # test-only: Gym is prepared, nothing committed
        plan = plan_cut(
            c.ledger,
            c.coordinator.instance_ids,
            {iid: prepared.unsaved_keys(iid) for iid in c.coordinator.instance_ids},
            c.not_in_gym,
        )
        tmp, final = prepare_snapshot_paths(c.anchor_dir())
        try:
            commits = await c.coordinator.commit(prepared, str(tmp), plan.scope)
            crash_point("commit", c.step)  # test-only: Gym records written, snapshot not published
            exported = {iid: set(commits[iid].agent_exported) for iid in plan.instance_ids}
            await self._drain(plan.scope, exported, prepared.deadline_ts)
            # Exclusive cut: no awaits from here until the directory is published.
            check_cut(c.ledger, plan, exported)
            counts = cut_counts(c.ledger, plan, exported)
            kept = {
                iid: {
                    server: sorted(set(keys) & exported[iid])
                    for server, keys in commits[iid].exported_by_server.items()
                }
                for iid in plan.instance_ids
            }
            write_json_atomic(
                tmp / GYM_CHECKPOINT_FILE,
                {
                    "schema_version": GYM_CHECKPOINT_SCHEMA_VERSION,
                    "checkpoint_id": prepared.checkpoint_id,
                    "instances": kept,
                    "turn_level": {iid: sorted(exported[iid]) for iid in plan.instance_ids},
                    "unsaved": {iid: sorted(plan.unsaved[iid]) for iid in plan.instance_ids},
                },
            )
            c.write_controller_state(tmp)
            crash_point("publish", c.step)  # test-only: tmp dir written, not sealed or renamed
            commit_snapshot(tmp, final, c.config.rollout_checkpointing.keep_latest_k,
                            metadata={"checkpoint_id": prepared.checkpoint_id, "step": c.step})
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        outcome.committed, outcome.path = True, str(final)
        outcome.saved, outcome.unsaved, outcome.not_admitted = counts.saved, counts.unsaved, counts.not_admitted

    async def _drain(self, scope: dict[str, list[EpisodeId]], exported: dict[str, set[str]], deadline_ts: float) -> None:
        """Wait for replies already on the wire: in scope, not exported, must seal (or fail)."""
        c = self.c
        pending = {e.capture_key for iid, eps in scope.items() for e in eps if e.capture_key not in exported[iid]}
        deadline = time.monotonic() + max(1.0, deadline_ts - time.time())
        while pending:
            pending = {k for k in pending if c.ledger_status(k) is RolloutAttemptStatus.DISPATCHED}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"drain: {len(pending)} rollouts neither exported nor finished: {sorted(pending)[:5]}")
            await asyncio.sleep(0.05)
