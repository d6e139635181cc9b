"""One rollout snapshot.

- ``blocking``: prepare -> commit -> drain -> cut -> publish -> resume.
- ``staged`` (default): prepare (each Gym server captures its sessions in
  memory as it becomes prepared) -> drain -> cut -> resume -> persist ->
  publish. Rollouts are held only while state is copied.

The same shape as ``torch.distributed.checkpoint`` (and its ``async_save``):
Gym plans (prepare) and writes its records (commit, or persist from the copy);
under the exclusive cut the controller's state is captured in memory; the files
are written and the directory is published atomically off the event loop; Gym
is resumed whatever happens.

The snapshotter reads the controller only through ``SnapshotInputs`` and owns
the dispatch gate; it writes no controller field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError

from gym_patches.utils.collector import CollectorHold
from nemo_rl.algorithms.single_controller_utils.config import RolloutCheckpointConfig
from nemo_rl.algorithms.single_controller_utils.dispatch import DispatchGate, LedgerChanges
from nemo_rl.algorithms.single_controller_utils.gym_coordinator import (
    GymCheckpointCoordinator,
    GymCheckpointNotReady,
    GymCheckpointOperationError,
    GymReplicasLeftOut,
    PreparedGym,
    is_transient_gym_checkpoint_failure,
)
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.algorithms.single_controller_utils.snapshot_cut import (
    GymOwnershipError,  # re-exported: the error a bad cut raises
    check_cut,
    cut_counts,
    episode_scopes,
    plan_cut,
    server_scopes,
)
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutAttemptStatus, RolloutRecoveryLedger
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
    write_bytes_atomic,
    write_json_atomic,
)

logger = logging.getLogger(__name__)
GYM_CHECKPOINT_SCHEMA_VERSION = 3
# How long the drain waits for in-scope rollouts Gym did not export (replies already on the wire).
DRAIN_GRACE_S = 2.0
GYM_CHECKPOINT_FILE = "gym_checkpoint.json"
CONTROLLER_STATE_FILE = "controller_state.json"


class GymCheckpointIndex(BaseModel):
    """``gym_checkpoint.json``: which episodes each Gym instance saved in a snapshot (write and read)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[3] = GYM_CHECKPOINT_SCHEMA_VERSION
    checkpoint_id: str
    instances: dict[str, dict[str, list[str]]]  # instance -> server -> capture keys it exported
    turn_level: dict[str, list[str]]  # instance -> rollouts that continue at turn level
    unsaved: dict[str, list[str]]  # instance -> rollouts restart-only servers could not save

    def exported(self) -> dict[str, dict[str, list[str]]]:
        """Instances that saved anything, and what (what restore sends back to each)."""
        return {iid: by_server for iid, by_server in self.instances.items() if any(by_server.values())}

    def write(self, directory: Path) -> None:
        write_json_atomic(directory / GYM_CHECKPOINT_FILE, self.model_dump(mode="json"))

    @classmethod
    def read(cls, directory: Path) -> "GymCheckpointIndex":
        """Parse and check the schema version; errors name the file."""
        path = directory / GYM_CHECKPOINT_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SnapshotStoreError(f"{path}: cannot read ({exc})") from None
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != GYM_CHECKPOINT_SCHEMA_VERSION:
            raise SnapshotStoreError(
                f"{path}: schema_version {version!r}, this code reads {GYM_CHECKPOINT_SCHEMA_VERSION}"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SnapshotStoreError(f"{path}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


@dataclass
class SnapshotInputs:
    """What a snapshot may read from the controller; it changes none of it."""

    ledger: RolloutRecoveryLedger
    data_plane: DataPlaneStore
    dataloader: PromptDataloader
    step: Callable[[], int]
    anchor_dir: Callable[[], Path]
    agent_servers: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # instance -> agent -> servers


@dataclass(frozen=True)
class ControllerStateCapture:
    """The controller's state at the cut, serialised: nothing that runs later can change it."""

    state: dict[str, Any]
    data_plane: bytes

    @classmethod
    def take(cls, inputs: SnapshotInputs) -> "ControllerStateCapture":
        data, meta = inputs.data_plane.dump()
        state = {
            "step": inputs.step(),
            "ledger": msgspec.Raw(inputs.ledger.state_json()),  # already JSON: spliced in by the write
            "dataloader": inputs.dataloader.state_dict(),
            "data_plane": meta,
        }
        return cls(state, data)

    def write(self, directory: Path) -> None:
        DataPlaneStore.write_dump(directory, self.data_plane)
        encoded = msgspec.json.encode(self.state, order="sorted")
        write_bytes_atomic(directory / CONTROLLER_STATE_FILE, msgspec.json.format(encoded, indent=2) + b"\n")


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


class SnapshotSuperseded(RuntimeError):
    """Training moved to the next step while this snapshot was being taken: it is dropped, not failed."""


def _leaf_codes(exc: BaseException) -> set[str | None]:
    """The error codes of every server a (possibly nested) Gym failure names."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return set().union(*(_leaf_codes(e) for e in failures.values()))
    return {getattr(exc, "code", None)}


@dataclass
class _Cut:
    """Everything captured in the pause that the publish needs."""

    step: int
    tmp: Path
    final: Path
    checkpoint_id: str
    index: GymCheckpointIndex | None  # None: a ledger-only snapshot, or a staged one until Gym persisted
    capture: ControllerStateCapture
    persist: "_PendingPersist | None" = None  # staged: what Gym writes after resume


@dataclass(frozen=True)
class _PendingPersist:
    """A staged cut's Gym half: each server writes its share of the turn-level saves from its capture."""

    scopes: dict[str, dict[str, list[str]]]  # instance -> server -> capture keys (``server_scopes``)
    exported: dict[str, set[str]]  # instance -> what its agents captured in the scope: continues at turn level
    unsaved: dict[str, list[str]]  # instance -> rollouts restart-only servers could not save


def _gym_index(
    checkpoint_id: str, written: dict[str, dict[str, list[str]]], exported: dict[str, set[str]],
    unsaved: dict[str, list[str]],
) -> GymCheckpointIndex:
    """``gym_checkpoint.json`` from what each server wrote (``written[iid][server]``), kept to the
    rollouts that continue at turn level (``exported[iid]``)."""
    return GymCheckpointIndex(
        checkpoint_id=checkpoint_id,
        instances={iid: {server: sorted(set(keys) & exported[iid]) for server, keys in by_server.items()}
                   for iid, by_server in written.items()},
        turn_level={iid: sorted(keys) for iid, keys in exported.items()},
        unsaved=unsaved,
    )


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
    phases_s: dict[str, float] = field(default_factory=dict)  # seconds since the attempt began, per phase end
    pause_s: float = 0.0  # rollouts held (the dispatch gate closed and Gym prepared)
    persist_s: float = 0.0  # staged: Gym's writes and the publish, after rollouts resumed
    captured_bytes: int = 0  # the in-memory copies the cut took (Gym records and the data plane)
    captured_bytes_by_server: dict[str, int] = field(default_factory=dict)  # "<instance>/<server>" -> staged copy
    path: str | None = None
    blockers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # replicas that could not be parked in time and left this snapshot -> why (names the server)
    left_out: dict[str, str] = field(default_factory=dict)
    left_out_rollouts: int = 0  # turn-level rollouts in flight on them: not saved in this snapshot
    post_publish_error: str | None = None
    error: str | None = None  # why an attempt that did not commit failed (names the file for an I/O error)


class RolloutSnapshotter:
    """Takes snapshots for one controller; counts consecutive failures."""

    def __init__(
        self,
        inputs: SnapshotInputs,
        coordinator: GymCheckpointCoordinator | None,
        records: RunRecords,
        settings: RolloutCheckpointConfig,
        changes: LedgerChanges,
    ):
        self.inputs = inputs
        self.coordinator = coordinator
        self.records = records
        self.settings = settings
        self.changes = changes
        self.gate = DispatchGate(changes)  # owned here; the controller reads it
        # Held for a whole attempt: pruning old trainer anchors waits for it, so a snapshot still
        # persisting under an anchor (staged mode runs past the step's end) never loses its directory.
        self.busy = asyncio.Lock()
        self.consecutive_failures = 0
        self._collector = CollectorHold()

    async def attempt(self) -> SnapshotOutcome:
        """One snapshot. ``staged``: the pause covers capture only; Gym persists and the
        controller publishes after rollouts resume. ``blocking``: all of it in the pause.
        The pump awaits this, so at most one snapshot is ever persisting."""
        async with self.busy:
            return await self._attempt()

    async def _attempt(self) -> SnapshotOutcome:
        outcome = SnapshotOutcome(f"rollout-{uuid.uuid4().hex[:12]}")
        staged = self.settings.commit_mode == "staged"
        started = self._started = time.monotonic()
        self._step = self.inputs.step()  # the anchor this attempt belongs to
        try:
            if self.coordinator is None:
                # sibling / prompt_group: sealed samples and the ledger only; Gym is not asked, nothing is held.
                cut = self._capture_ledger_only(outcome.checkpoint_id)
                outcome.captured_bytes = len(cut.capture.data_plane)
                outcome.pause_s = time.monotonic() - started
                await self._publish(cut, outcome)
                outcome.persist_s = time.monotonic() - started - outcome.pause_s
                outcome.reason = "committed"
                self.consecutive_failures = 0
                return outcome
            async with self.gate.closed():
                try:
                    async with self.coordinator.prepared(outcome.checkpoint_id, capture=staged) as prepared:
                        self._collector.hold()  # prepared to resumed: no full collection while rollouts are held
                        self._mark(outcome, "prepare")
                        cut = await self._capture(prepared, outcome, staged)
                        self._mark(outcome, "cut")
                        if not staged:
                            await self._publish(cut, outcome)
                            self._mark(outcome, "publish")
                finally:
                    self._collector.release()
            outcome.pause_s = time.monotonic() - started
            self._mark(outcome, "resume")
            if staged:
                crash_point("persist", cut.step)  # test-only: rollouts resumed, snapshot not persisted
                await self._publish(cut, outcome)
                self._mark(outcome, "publish")
                outcome.persist_s = time.monotonic() - started - outcome.pause_s
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
            outcome.error = f"{type(exc).__name__}: {exc}"
            if outcome.reason == "invariant_error" or not isinstance(exc, Exception):
                raise
            logger.warning("rollout snapshot %s failed (%s): %s", outcome.checkpoint_id, outcome.reason, exc)
            if isinstance(exc, GymCheckpointNotReady):
                outcome.blockers = exc.blockers
            if isinstance(exc, (GymCheckpointNotReady, GymReplicasLeftOut)):
                outcome.left_out = exc.left_out
            if outcome.reason != "superseded":  # not a failure: the next step's snapshots follow
                self._failed(exc)
        finally:
            if not outcome.pause_s:
                outcome.pause_s = time.monotonic() - started
            if outcome.reason:
                self.records.snapshot_attempt(
                    checkpoint_id=outcome.checkpoint_id,
                    committed=outcome.committed,
                    reason=outcome.reason,
                    saved=outcome.saved,
                    unsaved=outcome.unsaved,
                    not_admitted=outcome.not_admitted,
                    pause_s=outcome.pause_s,
                    persist_s=round(outcome.persist_s, 4),
                    phases_s=outcome.phases_s,
                    commit_mode=self.settings.commit_mode if self.coordinator is not None else "ledger_only",
                    captured_bytes=outcome.captured_bytes,
                    captured_bytes_by_server=outcome.captured_bytes_by_server,
                    step=self._step,  # the step the attempt belongs to (training may have moved on since)
                    path=outcome.path,
                    blocking_servers=sorted({s for v in outcome.blockers.values() for s in v}),
                    **({"left_out": outcome.left_out, "left_out_rollouts": outcome.left_out_rollouts}
                       if outcome.left_out else {}),
                    **({"post_publish_error": outcome.post_publish_error} if outcome.post_publish_error else {}),
                    **({"error": outcome.error} if outcome.error and not outcome.committed else {}),
                )
        return outcome

    def _mark(self, outcome: SnapshotOutcome, phase: str) -> None:
        """Record when ``phase`` ended (seconds since the attempt began) in ``snapshots.jsonl``."""
        outcome.phases_s[phase] = round(time.monotonic() - self._started, 4)

    @staticmethod
    def _classify(exc: BaseException) -> str:
        """The ``reason`` of a failed attempt; ``invariant_error`` stops the run."""
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

    def _failed(self, exc: BaseException) -> None:
        self.consecutive_failures += 1
        limit = self.settings.max_consecutive_failures
        if self.consecutive_failures >= limit:
            raise RuntimeError(
                f"{self.consecutive_failures} consecutive rollout snapshots failed "
                f"(rollout_checkpointing.max_consecutive_failures={limit}); last error: {exc}"
            ) from exc

    async def _capture(self, prepared: PreparedGym, outcome: SnapshotOutcome, staged: bool) -> "_Cut":
        """Inside the pause: Gym's records are committed (blocking) or were captured by the prepare
        (staged), replies on the wire drain, the cut is checked, and the controller's state is
        serialised in memory."""
        inputs = self.inputs
        step = self._step
        if inputs.step() != step:
            # The step's last rollouts finished during prepare and training moved on: this cut would
            # straddle two trainer steps (and its directory an anchor not yet published). Skip it.
            raise SnapshotSuperseded(f"training reached step {inputs.step()} while the snapshot of step {step} "
                                     "was being prepared")
        crash_point("prepare", step)  # test-only: Gym is prepared, nothing committed
        iids = prepared.instance_ids  # replicas that left the snapshot save nothing in it
        plan = plan_cut(inputs.ledger, iids, {iid: prepared.unsaved_keys(iid) for iid in iids}, prepared.left_out)
        restart_only = self.coordinator.shard_set.restart_only_servers
        # A saving server reports as unsaved only runs that reached it after it closed: not started.
        not_started = {
            iid: {k for server, keys in prepared.results[iid].unsaved.items()
                  if server not in restart_only.get(iid, ()) for k in keys}
            for iid in iids
        }
        tmp, final = prepare_snapshot_paths(inputs.anchor_dir())
        try:
            scopes = server_scopes(plan, inputs.agent_servers)
            if staged:  # the agents' captures are the turn-level saves; each server writes after resume
                exported = {iid: prepared.results[iid].captured_keys("agent") & plan.scope[iid].keys()
                            for iid in plan.instance_ids}
                written = None
            else:
                commits = await self.coordinator.commit(prepared, str(tmp), episode_scopes(scopes))
                self._mark(outcome, "commit")
                exported = {iid: set(commits[iid].agent_exported) for iid in plan.instance_ids}
                written = {iid: commits[iid].exported_by_server for iid in plan.instance_ids}
            crash_point("commit", step)  # test-only: Gym records committed (or captured), snapshot not published
            for iid, keys in (await self._drain(plan.scope, exported, prepared.deadline_ts)).items():
                not_started[iid] |= keys
            self._mark(outcome, "drain")
            if inputs.step() != step:
                raise SnapshotSuperseded(f"training reached step {inputs.step()} while the snapshot of step {step} "
                                         "was being committed")
            # Exclusive cut: no awaits until the state is captured in memory.
            owned = check_cut(inputs.ledger, plan, exported, not_started)
            if plan.left_out:
                outcome.left_out = dict(prepared.left_out)
                outcome.left_out_rollouts = sum(len(owned[iid]) for iid in plan.left_out)
            counts = cut_counts(inputs.ledger, plan, exported, not_started, owned)
            unsaved = {iid: sorted(plan.unsaved[iid]) for iid in plan.instance_ids}
            capture = ControllerStateCapture.take(inputs)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        outcome.saved, outcome.unsaved, outcome.not_admitted = counts.saved, counts.unsaved, counts.not_admitted
        if written is None:
            outcome.captured_bytes_by_server = {
                f"{iid}/{server}": n for iid in iids for server, n in sorted(prepared.results[iid].captured_bytes().items())}
            outcome.captured_bytes = sum(outcome.captured_bytes_by_server.values()) + len(capture.data_plane)
            pending = _PendingPersist(scopes, exported, unsaved)
            return _Cut(step, tmp, final, prepared.checkpoint_id, None, capture, pending)
        outcome.captured_bytes = len(capture.data_plane)
        index = _gym_index(prepared.checkpoint_id, written, exported, unsaved)
        return _Cut(step, tmp, final, prepared.checkpoint_id, index, capture)

    def _capture_ledger_only(self, checkpoint_id: str) -> "_Cut":
        """The controller's state alone (no awaits: a consistent cut of ledger and data plane)."""
        tmp, final = prepare_snapshot_paths(self.inputs.anchor_dir())
        capture = ControllerStateCapture.take(self.inputs)
        return _Cut(self.inputs.step(), tmp, final, checkpoint_id, None, capture)

    async def _publish(self, cut: "_Cut", outcome: SnapshotOutcome) -> None:
        """Gym persists (staged), then the controller's files are written and the directory is
        sealed and renamed, off the event loop. Only a complete write becomes a snapshot."""
        try:
            if cut.persist is not None:
                assert self.coordinator is not None
                cut.index = await self._persist_gym(cut.checkpoint_id, cut.tmp, cut.persist)
                self._mark(outcome, "persist")
            await asyncio.to_thread(self._write_and_publish, cut)
        except BaseException:
            shutil.rmtree(cut.tmp, ignore_errors=True)
            raise
        outcome.committed, outcome.path = True, str(cut.final)

    async def _persist_gym(self, checkpoint_id: str, tmp: Path, pending: _PendingPersist) -> GymCheckpointIndex:
        """Every Gym server writes its scope from its capture; every turn-level save must be written."""
        assert self.coordinator is not None
        persisted = await self.coordinator.persist(checkpoint_id, str(tmp), episode_scopes(pending.scopes))
        for iid, keys in pending.exported.items():
            lost = keys - set(persisted[iid].agent_exported)
            if lost:
                raise GymOwnershipError(f"Gym instance {iid}: agents captured {sorted(lost)[:10]} at prepare but "
                                        "did not write them")
        written = {iid: persisted[iid].exported_by_server for iid in pending.exported}
        return _gym_index(checkpoint_id, written, pending.exported, pending.unsaved)

    def _write_and_publish(self, cut: "_Cut") -> None:
        if cut.index is not None:
            cut.index.write(cut.tmp)
        cut.capture.write(cut.tmp)
        crash_point("publish", cut.step)  # test-only: tmp dir written, not sealed or renamed
        commit_snapshot(cut.tmp, cut.final, self.settings.keep_latest_k,
                        metadata={"checkpoint_id": cut.checkpoint_id, "step": cut.step})

    async def _drain(
        self, scope: dict[str, dict[str, str | None]], exported: dict[str, set[str]], deadline_ts: float
    ) -> dict[str, set[str]]:
        """Give in-scope rollouts Gym did not export a moment to finish (a reply or a verify on the
        wire seals them), without holding every rollout for them: whatever has not sealed, failed or
        been refused after ``DRAIN_GRACE_S`` is returned per instance as not started. Such a rollout
        restarts from its prompt after a crash; nothing it did is in the snapshot or lost by it."""
        ledger = self.inputs.ledger
        pending = {key: iid for iid, keys in scope.items() for key in keys if key not in exported[iid]}

        def settled() -> bool:
            for key in [k for k in pending if ledger.attempt_status(k) is not RolloutAttemptStatus.DISPATCHED]:
                del pending[key]
            return not pending

        try:
            await self.changes.wait_for(settled, timeout_s=max(0.1, min(DRAIN_GRACE_S, deadline_ts - time.time())))
        except TimeoutError:
            logger.info("snapshot drain: %d rollouts neither exported nor finished within %.1fs; they restart "
                        "from the prompt if this snapshot is restored: %s", len(pending), DRAIN_GRACE_S,
                        sorted(pending)[:5])
        out: dict[str, set[str]] = {iid: set() for iid in scope}
        for key, iid in pending.items():
            out[iid].add(key)
        return out
