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


class GymOwnershipError(RuntimeError):
    """Gym and the ledger disagree about who holds a rollout: a bug, never retried."""


@dataclass
class SnapshotOutcome:
    checkpoint_id: str
    committed: bool
    reason: str
    saved: int = 0
    unsaved: int = 0
    pause_s: float = 0.0
    path: str | None = None
    blockers: dict[str, dict[str, list[str]]] = field(default_factory=dict)


class RolloutSnapshotter:
    """Takes snapshots for one controller; counts consecutive failures."""

    def __init__(self, controller: "SingleController"):
        self.c = controller
        self.consecutive_failures = 0

    async def attempt(self) -> SnapshotOutcome:
        c = self.c
        cid = f"rollout-{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        outcome = SnapshotOutcome(cid, committed=False, reason="")
        c.dispatch_open.clear()
        try:
            await self._retire_dropped(cid)
            async with c.coordinator.prepared(cid) as prepared:
                outcome = await self._commit_and_publish(prepared)
            outcome.reason = "committed"
            self.consecutive_failures = 0
        except GymCheckpointNotReady as exc:
            outcome.reason, outcome.blockers = "gym_unavailable", exc.blockers
            self._failed(exc)
        except (GymCheckpointOperationError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                outcome.reason = "timeout"
            elif is_transient_gym_checkpoint_failure(exc):
                outcome.reason = "gym_unavailable"
            else:
                outcome.reason = "invariant_error"
                raise
            self._failed(exc)
        except OSError as exc:
            outcome.reason = "io_error"
            self._failed(exc)
        except Exception:
            outcome.reason = "invariant_error"
            raise
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
                    pause_s=outcome.pause_s,
                    step=c.step,
                    path=outcome.path,
                    blocking_servers=sorted({s for v in outcome.blockers.values() for s in v}),
                )
        return outcome

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

    async def _commit_and_publish(self, prepared) -> SnapshotOutcome:
        c = self.c
        crash_point("prepare", c.step)  # test-only: Gym is prepared, nothing committed
        iids = c.coordinator.instance_ids
        unsaved = {iid: prepared.unsaved_keys(iid) for iid in iids}
        inventory = c.ledger.gym_checkpoint_inventory(iids)
        scope = {
            iid: [e for e in eps if e.capture_key not in unsaved[iid] and e.capture_key not in c.not_in_gym]
            for iid, eps in inventory.items()
        }
        tmp, final = prepare_snapshot_paths(c.anchor_dir())
        try:
            commits = await c.coordinator.commit(prepared, str(tmp), scope)
            crash_point("commit", c.step)  # test-only: Gym records written, snapshot not published
            exported = {iid: set(commits[iid].agent_exported) for iid in iids}
            await self._drain(scope, exported, prepared.deadline_ts)
            # Exclusive cut: no awaits from here until the directory is published.
            self._check_ownership(exported, unsaved)
            kept = {
                iid: {
                    server: sorted(set(keys) & exported[iid])
                    for server, keys in commits[iid].exported_by_server.items()
                }
                for iid in iids
            }
            write_json_atomic(
                tmp / GYM_CHECKPOINT_FILE,
                {
                    "schema_version": GYM_CHECKPOINT_SCHEMA_VERSION,
                    "checkpoint_id": prepared.checkpoint_id,
                    "instances": kept,
                    "turn_level": {iid: sorted(exported[iid]) for iid in iids},
                    "unsaved": {iid: sorted(unsaved[iid]) for iid in iids},
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
        saved = sum(len(v) for v in exported.values())
        live_unsaved = sum(
            1 for iid in iids for e in c.ledger.gym_checkpoint_inventory([iid])[iid]
            if e.capture_key in unsaved[iid] or e.capture_key in c.not_in_gym
        )
        return SnapshotOutcome(prepared.checkpoint_id, True, "committed", saved, live_unsaved, 0.0, str(final))

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

    def _check_ownership(self, exported: dict[str, set[str]], unsaved: dict[str, set[str]]) -> None:
        c = self.c
        for iid in c.coordinator.instance_ids:
            owned = {e.capture_key for e in c.ledger.owned_live_episodes(iid)}
            stray = owned - exported[iid] - unsaved[iid] - c.not_in_gym
            if stray:
                raise GymOwnershipError(
                    f"Gym instance {iid}: rollouts owned by the ledger were neither saved nor reported unsaved "
                    f"by Gym: {sorted(stray)[:10]}"
                )
