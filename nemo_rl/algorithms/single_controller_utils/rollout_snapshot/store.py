"""The files of one rollout snapshot, each model read beside its write and validated.

A snapshot directory (``<anchor>/rollout_snapshots/snapshot_<seq>``) holds:

- ``controller_state.json`` (``ControllerState``): the step, the ledger, the
  dataloader position and the data plane's digest;
- ``data_plane.jsonl``: the sealed samples (``DataPlaneStore``);
- ``gym_checkpoint.json`` (``GymCheckpointIndex``, turn level only): which
  episodes each Gym instance saved, under ``gym/<instance>/`` beside it;
- the manifest, written last (``nemo_rl.utils.snapshot_store``).

``required_snapshot_files`` is what the one scan that picks a snapshot to restore
(``snapshot_store.resolve_restore_point``) asks of it; ``publish_snapshot`` writes a staged cut's files and seals the directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_rl.experience.data_plane import DataPlaneCapture, DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.snapshot_store import (
    SnapshotStoreError,
    commit_snapshot,
    recording_digests,
    write_bytes_atomic,
    write_json_atomic,
)

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

    @classmethod
    def from_written(
        cls, checkpoint_id: str, written: dict[str, dict[str, list[str]]], exported: dict[str, set[str]],
        unsaved: dict[str, list[str]], cut_tokens: dict[str, dict[str, int]] | None = None,
    ) -> "GymCheckpointIndex":
        """The index of what each server wrote (``written[iid][server]``), kept to the rollouts that
        continue at turn level (``exported[iid]``): a server may write more than the agents saved."""
        return cls(
            checkpoint_id=checkpoint_id,
            instances={iid: {server: sorted(set(keys) & exported[iid]) for server, keys in by_server.items()}
                       for iid, by_server in written.items()},
            turn_level={iid: sorted(keys) for iid, keys in exported.items()},
            unsaved=unsaved,
            cut_tokens={iid: {k: n for k, n in cuts.items() if k in exported[iid]}
                        for iid, cuts in (cut_tokens or {}).items() if cuts},
        )

    def cut_of(self, iid: str, capture_key: str) -> int:
        """Tokens of the generation cut saved for ``capture_key`` on ``iid`` (0: none)."""
        return self.cut_tokens.get(iid, {}).get(capture_key, 0)

    def exported(self) -> dict[str, dict[str, list[str]]]:
        """Instances that saved anything, and what (what restore sends back to each)."""
        return {iid: by_server for iid, by_server in self.instances.items() if any(by_server.values())}

    def write(self, directory: Path) -> None:
        write_json_atomic(directory / GYM_CHECKPOINT_FILE, self.model_dump(mode="json"))

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

    step: int = Field(ge=0)  # the controller's step at the cut
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
    ledger_json: bytes
    dataloader: dict[str, Any]
    data_plane: DataPlaneCapture

    @classmethod
    def take(cls, step: int, anchor_step: int, ledger_json: bytes, dataloader: dict[str, Any],
             data_plane: DataPlaneStore) -> "ControllerStateCapture":
        return cls(step, anchor_step, ledger_json, dataloader, data_plane.capture())

    def write(self, directory: Path) -> None:
        # The ledger was serialised unvalidated in the pause; it is checked here, after resume and
        # before anything is sealed: an inconsistent ledger (a bug) fails the attempt, publishes nothing.
        RolloutRecoveryLedger.check_state_json(self.ledger_json)
        data, meta = self.data_plane.encode()
        DataPlaneStore.write_dump(directory, data)
        state = {"step": self.step, "anchor_step": self.anchor_step, "ledger": msgspec.Raw(self.ledger_json),
                 "dataloader": self.dataloader, "data_plane": meta}
        encoded = msgspec.json.encode(state, order="sorted")
        write_bytes_atomic(directory / CONTROLLER_STATE_FILE, msgspec.json.format(encoded, indent=2) + b"\n")


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
    """Every file of a selected snapshot, validated; errors name the file."""
    state = ControllerState.read(path)
    data_plane = DataPlaneStore.load(path, state.data_plane.sha256, state.data_plane.count)
    return SnapshotContents(path, state, data_plane, GymCheckpointIndex.read(path) if turn_level else None)


def publish_snapshot(
    tmp: Path, final: Path, capture: ControllerStateCapture, gym: GymCheckpointIndex | None, checkpoint_id: str,
    keep_latest_k: int, before_seal: Callable[[], None] = lambda: None,
) -> None:
    """Write the controller's files (and Gym's index) into ``tmp``, then seal and rename it to
    ``final``: only a complete directory becomes a snapshot. Runs off the event loop. The seal takes
    the digests of the controller's files as they were written; Gym's records (written by its
    servers) are hashed once, by the seal."""
    with recording_digests(tmp) as digests:
        if gym is not None:
            gym.write(tmp)
        capture.write(tmp)
    before_seal()
    commit_snapshot(tmp, final, keep_latest_k, metadata={"checkpoint_id": checkpoint_id, "step": capture.step,
                                                          "anchor_step": capture.anchor_step},
                    digests=digests)
