"""The run store, and the files of one rollout snapshot, each model read beside its write and validated.

``RunStore`` owns the layout of ``checkpointing.checkpoint_dir`` for snapshots
(docs/design.md §5.4): a snapshot's temporary directory is made, published and
removed only here; every file, rename and directory goes through the writer it was built with.

A snapshot directory (``<anchor>/rollout_snapshots/snapshot_<seq>``) holds:

- ``controller_state.json`` (``ControllerState``): the step, the ledger, the
  dataloader position and the data plane's digest;
- ``data_plane.jsonl``: the sealed samples (``DataPlaneStore``);
- ``gym_checkpoint.json`` (``GymCheckpointIndex``, turn level only): which
  episodes each Gym instance saved, under ``gym/<instance>/`` beside it;
- the manifest, written last (``nemo_rl.utils.snapshot_store``).

``required_snapshot_files`` is what the one scan that picks a snapshot to restore
(``snapshot_store.resolve_restore_point``) asks of it; ``publish_snapshot`` writes a staged snapshot's files and
seals the directory. ``TrainerBookkeeping`` is what the controller keeps beside the trainer's own state
in ``step_N``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_rl.experience.data_plane import DataPlaneCapture, DataPlaneStore
from nemo_rl.experience.rollout_recovery import LedgerJsonParts, RolloutRecoveryLedger
from gym_patches.checkpoint.storage import StorageWriter
from nemo_rl.utils.atomic_write import recording_digests, write_bytes_atomic, write_json_atomic
# Listed, list_checkpoint_dir and RestorePoint are the run store's read side too: the inspector and the
# runner's components take them from here, not from the layout module.
from nemo_rl.utils.snapshot_store import (
    DirectoryManifest,
    Listed,
    RestorePoint,
    SnapshotStoreError,
    anchor_dir,
    commit_snapshot,
    ensure_bootstrap_anchor,
    list_checkpoint_dir,
    anchor_step_of,
    list_trainer_steps,
    next_snapshot_path,
    prepare_snapshot_paths,
    prepare_trainer_step,
    prune_trainer_steps,
    publish_trainer_step,
    remove_stale_tmp_dirs,
    resolve_restore_point,
    verify_directory,
)

logger = logging.getLogger(__name__)
REPLICA_HOLD = "gym:"  # the run store's holders of each replica's newest snapshot that saved its rollouts
GYM_CHECKPOINT_SCHEMA_VERSION = 3
GYM_CHECKPOINT_FILE = "gym_checkpoint.json"
CONTROLLER_STATE_FILE = "controller_state.json"


def _invalid(path: Path, exc: ValidationError) -> SnapshotStoreError:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "<root>"
    return SnapshotStoreError(f"{path}: {where}: {first['msg']}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise SnapshotStoreError(f"{path}: cannot read ({exc})") from None


class GymCheckpointIndex(BaseModel):
    """``gym_checkpoint.json``: which episodes each Gym instance saved in a snapshot."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[3] = GYM_CHECKPOINT_SCHEMA_VERSION
    checkpoint_id: str
    instances: dict[str, dict[str, list[str]]]  # instance -> server -> capture keys it exported
    turn_level: dict[str, list[str]]  # instance -> rollouts that continue at turn level
    unsaved: dict[str, list[str]]  # instance -> rollouts restart-only servers could not save
    # instance -> capture key -> tokens: turn-level rollouts whose model call in flight was cut (prefix level)
    cut_tokens: dict[str, dict[str, int]] = Field(default_factory=dict)
    # instance -> the older snapshot (relative to checkpoint_dir) that holds its rollouts: it was left out of
    # this one (a hung server, an in-run recovery), so a restore takes its saved episodes from there
    carried: dict[str, str] = Field(default_factory=dict)
    # instance -> rollouts that come back by replay: only their model server's record was written (§4.8)
    replayed: dict[str, list[str]] = Field(default_factory=dict)

    @classmethod
    def from_written(
        cls, checkpoint_id: str, written: dict[str, dict[str, list[str]]], exported: dict[str, set[str]],
        unsaved: dict[str, list[str]], cut_tokens: dict[str, dict[str, int]] | None = None,
        replayed: dict[str, set[str]] | None = None,
    ) -> "GymCheckpointIndex":
        """The index of what each server wrote (``written[iid][server]``), kept to the rollouts that
        continue at turn level (``exported[iid]``: a server may write more than the agents saved) or by
        replay (``replayed[iid]``, of which only those a model server wrote)."""
        replayed = replayed or {}
        kept = {iid: exported[iid] | replayed.get(iid, set()) for iid in written}
        by_replay = {iid: sorted({k for keys in by_server.values() for k in keys} & replayed.get(iid, set()))
                     for iid, by_server in written.items()}
        return cls(
            checkpoint_id=checkpoint_id,
            instances={iid: {server: sorted(set(keys) & kept[iid]) for server, keys in by_server.items()}
                       for iid, by_server in written.items()},
            turn_level={iid: sorted(keys) for iid, keys in exported.items()},
            unsaved=unsaved,
            cut_tokens={iid: {k: n for k, n in cuts.items() if k in kept.get(iid, exported.get(iid, set()))}
                        for iid, cuts in (cut_tokens or {}).items() if cuts},
            replayed={iid: keys for iid, keys in by_replay.items() if keys},
        )

    def replayed_keys(self, iid: str) -> set[str]:
        """What ``iid`` saved for replay (its model record only)."""
        return set(self.replayed.get(iid, ()))

    def cut_of(self, iid: str, capture_key: str) -> int:
        """Tokens of the generation cut saved for ``capture_key`` on ``iid`` (0: none)."""
        return self.cut_tokens.get(iid, {}).get(capture_key, 0)

    def exported(self) -> dict[str, dict[str, list[str]]]:
        """Instances that saved anything, and what (what restore sends back to each)."""
        return {iid: by_server for iid, by_server in self.instances.items() if any(by_server.values())}

    def write(self, directory: Path, writer: StorageWriter) -> None:
        write_json_atomic(directory / GYM_CHECKPOINT_FILE, self.model_dump(mode="json"), writer)

    @classmethod
    def read(cls, directory: Path) -> "GymCheckpointIndex":
        """Parse and check the schema version; errors name the file."""
        path = directory / GYM_CHECKPOINT_FILE
        data = _read_json(path)
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != GYM_CHECKPOINT_SCHEMA_VERSION:
            raise SnapshotStoreError(
                f"{path}: schema_version {version!r}, this code reads {GYM_CHECKPOINT_SCHEMA_VERSION}"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _invalid(path, exc) from None


class DataPlaneDigest(BaseModel):
    """Where the sealed samples are and how to check them."""

    model_config = ConfigDict(extra="forbid")

    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    count: int = Field(ge=0)


class ControllerState(BaseModel):
    """``controller_state.json`` as read back: the ledger and the dataloader are checked by their owners
    (``RolloutRecoveryLedger.load_state_dict``, ``PromptDataloader.load_state_dict``)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)  # the controller's step in the snapshot's pause
    anchor_step: int | None = Field(default=None, ge=0)  # the trainer step it belongs to (None: older files, = step)
    ledger: dict[str, Any]
    dataloader: dict[str, Any]
    data_plane: DataPlaneDigest

    @property
    def anchor(self) -> int:
        return self.step if self.anchor_step is None else self.anchor_step

    @classmethod
    def read(cls, directory: Path) -> "ControllerState":
        path = directory / CONTROLLER_STATE_FILE
        try:
            return cls.model_validate(_read_json(path))
        except ValidationError as exc:
            raise _invalid(path, exc) from None


@dataclass(frozen=True)
class ControllerStateCapture:
    """The controller's state at the cut: nothing that runs later can change it.

    Taken in the pause without encoding or hashing anything large (the ledger is one pydantic-core
    call, the data plane's lines are shared references); ``write`` builds the files after resume,
    in the form ``ControllerState`` reads.
    """

    step: int
    anchor_step: int
    ledger_json: LedgerJsonParts  # each group's JSON by reference; joined by ``write``
    dataloader: dict[str, Any]
    data_plane: DataPlaneCapture

    @classmethod
    def take(cls, step: int, anchor_step: int, ledger: RolloutRecoveryLedger, dataloader: dict[str, Any],
             data_plane: DataPlaneStore) -> "ControllerStateCapture":
        return cls(step, anchor_step, ledger.state_json_parts(), dataloader, data_plane.capture())

    def write(self, directory: Path, writer: StorageWriter) -> None:
        # The ledger was serialised unvalidated in the pause (and joined only now); it is checked here,
        # after resume and before anything is sealed: an inconsistent ledger (a bug) fails the attempt,
        # publishes nothing.
        ledger_json = self.ledger_json.encode()
        RolloutRecoveryLedger.check_state_json(ledger_json)
        data, meta = self.data_plane.encode()
        DataPlaneStore.write_dump(directory, data, writer)
        state = {"step": self.step, "anchor_step": self.anchor_step, "ledger": msgspec.Raw(ledger_json),
                 "dataloader": self.dataloader, "data_plane": meta}
        encoded = msgspec.json.encode(state, order="sorted")
        write_bytes_atomic(directory / CONTROLLER_STATE_FILE, msgspec.json.format(encoded, indent=2) + b"\n", writer)


def required_snapshot_files(turn_level: bool) -> tuple[str, ...]:
    """What every usable snapshot holds: the controller state, plus Gym's index when turns are saved."""
    return (CONTROLLER_STATE_FILE, GYM_CHECKPOINT_FILE) if turn_level else (CONTROLLER_STATE_FILE,)


@dataclass(frozen=True)
class SnapshotContents:
    """A selected snapshot, read and checked: what restore applies."""

    path: Path
    state: ControllerState
    data_plane: DataPlaneStore
    gym: GymCheckpointIndex | None  # None: a ledger-only snapshot (sibling / prompt_group levels)


def read_snapshot(path: Path, turn_level: bool) -> SnapshotContents:
    """Every file of a selected snapshot, validated; errors name the file. (The sealed samples are read
    by their owner, ``DataPlaneStore.load``.)"""
    state = ControllerState.read(path)
    data_plane = DataPlaneStore.load(path, state.data_plane.sha256, state.data_plane.count)
    return SnapshotContents(path, state, data_plane, GymCheckpointIndex.read(path) if turn_level else None)


def select_restore_point(checkpoint_dir: Path, *, turn_level: bool, read_snapshots: bool) -> RestorePoint | None:
    """``RunStore.select`` for a reader that writes nothing (the start's lookup, the inspector)."""
    return resolve_restore_point(checkpoint_dir, required_snapshot_files(turn_level), read_snapshots=read_snapshots)


def holds_trainer_steps(checkpoint_dir: Path) -> bool:
    """Whether ``checkpoint_dir`` holds a trainer step (its manifest trusted, nothing hashed): the run
    identity's question about a directory an older version wrote (``run_identity_check``)."""
    return bool(list_trainer_steps(Path(checkpoint_dir)))


def publish_snapshot(
    tmp: Path, final: Path, capture: ControllerStateCapture, gym: GymCheckpointIndex | None, checkpoint_id: str,
    keep_latest_k: int, writer: StorageWriter, before_seal: Callable[[], None] = lambda: None,
    spare: frozenset[Path] = frozenset(),
) -> None:
    """Write the controller's files (and Gym's index) into ``tmp``, then seal and rename it to
    ``final``: only a complete directory becomes a snapshot. Runs off the event loop. The seal takes
    the digests of the controller's files as they were written; Gym's records (written by its
    servers) are hashed once, by the seal. ``writer``: every file written here, the seal and the rename."""
    with recording_digests(tmp) as digests:
        if gym is not None:
            gym.write(tmp, writer)
        capture.write(tmp, writer)
    before_seal()
    commit_snapshot(tmp, final, keep_latest_k, metadata={"checkpoint_id": checkpoint_id, "step": capture.step,
                                                          "anchor_step": capture.anchor_step},
                    digests=digests, writer=writer, spare=spare)


# ----- the trainer step's bookkeeping --------------------------------------------------------
class TrainerBookkeeping(BaseModel):
    """What the controller keeps beside the trainer's own state in ``step_N``: handed to the trainer's
    ``save`` as its extra state (``as_saved``) and given back by its ``load`` (``RunStore.read_step``)."""

    model_config = ConfigDict(extra="ignore")

    step: int = Field(ge=0)
    dataloader: dict[str, Any]
    ledger: dict[str, Any]
    metrics_row: dict[str, Any] | None = None  # the step's metrics.jsonl row, in case its append was lost

    def as_saved(self) -> dict[str, Any]:
        """The trainer's extra state: the same keys, in the same order, as the controller's dict always had."""
        return {"step": self.step, "dataloader": self.dataloader, "ledger": self.ledger,
                "metrics_row": self.metrics_row}


# ----- the run store ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SnapshotDir:
    """A snapshot being written: its temporary directory and the name it is published under."""

    tmp: Path
    final: Path

    @property
    def anchor(self) -> Path:
        """The anchor its temporary directory was made under."""
        return self.tmp.parent.parent


class RunStore:
    """The snapshots and trainer steps of one ``checkpointing.checkpoint_dir``: every file, rename and
    directory goes through the ``StorageWriter`` it is built with (``gym_patches.checkpoint.storage``),
    which its builder was handed (the driver builds one from ``checkpointing.storage_writer``).
    Layout: ``nemo_rl.utils.snapshot_store``.

    The order of calls (docs/design.md §5.4):

    - at start, under the run lock: ``remove_stale_tmp_dirs()``, then ``ensure_bootstrap()``;
    - a snapshot (the snapshotter, one attempt at a time; ``busy`` serialises it with pruning):
      ``begin(anchor) -> SnapshotDir`` in the pause, before the capture (an empty temporary directory
      under the anchor: Gym's blocking commit and staged persist write into ``snap.tmp``);
      ``reanchor(snap, anchor)`` if the snapshot belongs to a trainer step published meanwhile (§5.9);
      then either ``publish(snap, ...)`` after resume (write, seal, rename, prune the anchor's
      snapshots to ``keep_latest_k``) or ``abort(snap)`` on any failure before the publish;
    - a trainer step (the controller): ``save_step(step, bookkeeping, save_trainer, files)``, then
      ``prune_steps(keep_top_k, newest, spare)`` once no snapshot is being written;
    - a restore (once per start): ``select(turn_level=, read_snapshots=)``, then
      ``read_step(anchor, saved)`` for the trainer's bookkeeping and ``read(snapshot, turn_level)``.
    """

    def __init__(self, checkpoint_dir: str | Path, writer: StorageWriter, *, keep_latest_k: int):
        if not isinstance(writer, StorageWriter):
            raise TypeError(f"writer must be a StorageWriter, got {type(writer).__name__}")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.writer = writer
        self.keep_latest_k = keep_latest_k
        self._held: dict[str, tuple[Path, float]] = {}  # who -> the snapshot a restore of theirs may read, since

    # -- retention: one rule, whatever any restore may still need stays
    def hold(self, owner: str, snapshot: str | Path | None) -> None:
        """``owner`` may still restore from ``snapshot`` (None: no longer from any): neither a publish's
        prune of older snapshots nor a trainer-step prune removes it or its anchor. Owners: the relaunch
        (``relaunch``: the newest committed snapshot, until the run is complete), each Gym replica
        (``gym:<replica>``: the newest snapshot that saved its rollouts) and each in-run recovery while it
        installs from one (docs/design.md §5.4.7, "Retention")."""
        if snapshot is None:
            self._held.pop(owner, None)
        elif owner not in self._held or self._held[owner][0] != Path(snapshot):
            self._held[owner] = (Path(snapshot), time.time())

    def holding(self, owner: str) -> tuple[Path, float] | None:
        """The snapshot ``owner`` holds and since when (wall clock), or None."""
        return self._held.get(owner)

    def holders(self, prefix: str) -> dict[str, tuple[Path, float]]:
        """Every owner named ``<prefix><name>`` -> what it holds, by ``<name>``."""
        return {owner[len(prefix):]: held for owner, held in self._held.items() if owner.startswith(prefix)}

    def held(self) -> frozenset[Path]:
        """Every snapshot some restore may still need."""
        return frozenset(path for path, _ in self._held.values())

    def held_anchors(self) -> frozenset[int]:
        """The trainer steps (0: bootstrap) whose directories hold a held snapshot."""
        return frozenset(anchor_step_of(p) for p in self.held())

    def relative(self, snapshot: str | Path) -> str:
        """A snapshot's path as an index names it: relative to ``checkpoint_dir``."""
        return str(Path(snapshot).relative_to(self.checkpoint_dir))

    def anchor(self, step: int) -> Path:
        """The directory of trainer step ``step`` (``bootstrap/`` for 0): where its snapshots go."""
        return anchor_dir(self.checkpoint_dir, step)

    # -- at start
    def remove_stale_tmp_dirs(self) -> list[Path]:
        """The ``.tmp-`` directories a crash left (only the run lock's holder may call it)."""
        return remove_stale_tmp_dirs(self.checkpoint_dir, self.writer)

    def ensure_bootstrap(self, metadata: dict[str, Any] | None = None) -> Path:
        """The step-0 anchor, made once."""
        return ensure_bootstrap_anchor(self.checkpoint_dir, metadata, self.writer)

    # -- a snapshot
    def begin(self, anchor: Path) -> SnapshotDir:
        """An empty temporary directory for the next snapshot under ``anchor`` (no await: in the pause)."""
        if Path(anchor).parent != self.checkpoint_dir:
            raise SnapshotStoreError(f"{anchor}: not an anchor of {self.checkpoint_dir}")
        tmp, final = prepare_snapshot_paths(anchor, writer=self.writer)
        return SnapshotDir(tmp, final)

    def reanchor(self, snap: SnapshotDir, anchor: Path) -> SnapshotDir:
        """``snap`` published under ``anchor`` instead (its directory moves there at the publish)."""
        if Path(anchor) == snap.anchor:
            return snap
        return SnapshotDir(snap.tmp, next_snapshot_path(anchor))

    def publish(self, snap: SnapshotDir, capture: ControllerStateCapture, gym: GymCheckpointIndex | None,
                checkpoint_id: str, before_seal: Callable[[], None] = lambda: None) -> None:
        """Write the controller's files (and Gym's index), seal and rename (``publish_snapshot``); off the
        event loop. The anchor's older snapshots beyond ``keep_latest_k`` go, except those ``held``. On a
        failure the caller calls ``abort(snap)``."""
        publish_snapshot(snap.tmp, snap.final, capture, gym, checkpoint_id, self.keep_latest_k, self.writer,
                         before_seal, self.held())

    def abort(self, snap: SnapshotDir) -> None:
        """The snapshot will not be published: its temporary directory goes (idempotent). Called on a
        failure: a directory that cannot be removed now is logged, not raised over that failure (the next
        start removes what is left)."""
        try:
            self.writer.remove(snap.tmp)
        except OSError as exc:
            logger.warning("could not remove %s (the next start removes it): %s", snap.tmp, exc)

    # -- a trainer step
    def save_step(self, step: int, bookkeeping: TrainerBookkeeping,
                  save_trainer: Callable[[Path, dict, StorageWriter], None],
                  files: dict[str, bytes] | None = None) -> DirectoryManifest:
        """Trainer step ``step``: ``save_trainer(tmp, bookkeeping.as_saved(), writer)`` (every file through
        ``writer``) and ``files`` (name -> bytes) into a temporary directory, sealed with the digests taken
        as they were written, renamed to ``step_N``. A failure removes the temporary directory and raises."""
        tmp, final = prepare_trainer_step(self.checkpoint_dir, step, self.writer)
        try:
            with recording_digests(tmp) as digests:
                save_trainer(tmp, bookkeeping.as_saved(), self.writer)
                for name, data in (files or {}).items():
                    write_bytes_atomic(tmp / name, data, self.writer)
            return publish_trainer_step(tmp, final, metadata={"step": step}, digests=digests, writer=self.writer)
        except BaseException:
            with contextlib.suppress(OSError):  # nothing half-written stays (startup removes what is left)
                self.writer.remove(tmp)
            raise

    def prune_steps(self, keep_top_k: int | None, newest: int | None = None) -> list[Path]:
        """``snapshot_store.prune_trainer_steps`` on this directory, sparing every anchor that holds a
        ``held`` snapshot."""
        return prune_trainer_steps(self.checkpoint_dir, keep_top_k, newest, self.held_anchors(), self.writer)

    # -- a restore
    def select(self, *, turn_level: bool, read_snapshots: bool) -> RestorePoint | None:
        """The newest intact trainer step (only it is hashed) and its newest snapshot that verifies and holds
        every file this run needs (``required_snapshot_files``); ``read_snapshots=False`` leaves them unread."""
        return select_restore_point(self.checkpoint_dir, turn_level=turn_level, read_snapshots=read_snapshots)

    def read_step(self, anchor: Path, saved: Any) -> TrainerBookkeeping:
        """The bookkeeping the trainer's ``load(anchor)`` gave back (``saved``), checked; errors name the step."""
        try:
            return TrainerBookkeeping.model_validate(saved)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise SnapshotStoreError(f"{anchor}: trainer state: {'.'.join(map(str, first['loc']))}: "
                                     f"{first['msg']}") from None

    def read(self, snapshot: Path, turn_level: bool) -> SnapshotContents:
        """Every file of the selected ``snapshot``, validated (``read_snapshot``)."""
        return read_snapshot(snapshot, turn_level)

    def read_carried(self, relative: str) -> GymCheckpointIndex:
        """The Gym index of a snapshot a newer one carries (``GymCheckpointIndex.carried``), its directory
        verified first (every digest): a relaunch installs episodes from it (docs/design.md §5.5)."""
        path = self.checkpoint_dir / relative
        if path.parent.parent.parent != self.checkpoint_dir:
            raise SnapshotStoreError(f"{path}: not a snapshot of {self.checkpoint_dir}")
        verify_directory(path, "rollout_snapshot")
        return GymCheckpointIndex.read(path)

    def read_gym_index(self, snapshot: Path) -> GymCheckpointIndex:
        """Only Gym's index of a published snapshot (what each replica saved): an in-run recovery
        installs a lost replica's episodes from it (docs/design.md §5.12); the records themselves are
        read and checked by the Gym servers that install them."""
        if Path(snapshot).parent.parent.parent != self.checkpoint_dir:
            raise SnapshotStoreError(f"{snapshot}: not a snapshot of {self.checkpoint_dir}")
        return GymCheckpointIndex.read(Path(snapshot))
