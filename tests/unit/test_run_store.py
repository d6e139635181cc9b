"""The run store: a snapshot's temporary directory is made, published and removed by it, every file goes
through the writer it was built with, and the trainer step's bookkeeping is written and read as one model."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from gym_patches.checkpoint.storage import FileSystemReader, FileSystemWriter
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import (
    CONTROLLER_STATE_FILE,
    ControllerStateCapture,
    GymCheckpointIndex,
    RunStore,
    SnapshotDir,
    TrainerBookkeeping,
)
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.snapshot_store import (
    SnapshotStoreError,
    anchor_dir,
    ensure_bootstrap_anchor,
    list_trainer_steps,
    verify_directory,
)
from nemo_rl.utils.write_errors import RunWriteError


class NotingWriter(FileSystemWriter):
    """Writes plain files and notes each path; ``fail`` (a name fragment) fails like a full disk."""

    def __init__(self, fail: str | None = None):
        self.paths: list[Path] = []
        self.fail = fail

    def write(self, path, data):
        self.paths.append(Path(path))
        if self.fail is not None and self.fail in Path(path).name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        super().write(path, data)


class NotingReader(FileSystemReader):
    def __init__(self):
        self.paths: list[Path] = []

    def read_bytes(self, path):
        self.paths.append(Path(path))
        return super().read_bytes(path)

    def open(self, path):
        self.paths.append(Path(path))
        return super().open(path)


def _capture(step: int = 0, anchor: int = 0) -> ControllerStateCapture:
    return ControllerStateCapture.take(step, anchor, RolloutRecoveryLedger(3), {"position": 0},
                                       DataPlaneStore())


def _bookkeeping(step: int) -> TrainerBookkeeping:
    return TrainerBookkeeping(step=step, dataloader={"position": 4}, ledger=RolloutRecoveryLedger(3).state_dict(),
                              metrics_row={"step": step})


def _save_json(directory: Path, extra: dict) -> None:
    (directory / "trainer.json").write_text(json.dumps(extra, sort_keys=True))


def test_a_snapshot_is_begun_published_and_read_through_the_store(tmp_path):
    writer, reader = NotingWriter(), NotingReader()
    store = RunStore(tmp_path, keep_latest_k=2, writer=writer, reader=reader)
    anchor = ensure_bootstrap_anchor(tmp_path)
    snap = store.begin(anchor)
    assert snap.tmp.is_dir() and not any(snap.tmp.iterdir()) and snap.anchor == anchor
    store.publish(snap, _capture(), None, "rollout-1")
    assert not snap.tmp.exists() and snap.final.is_dir()
    assert {p.parent for p in writer.paths} == {snap.tmp}  # controller_state, data plane, manifest
    assert any(CONTROLLER_STATE_FILE in p.name for p in writer.paths)
    verify_directory(snap.final, "rollout_snapshot")
    point = store.select(turn_level=False, read_snapshots=True)
    assert point is not None and point.snapshot.path == snap.final
    contents = store.read(snap.final, turn_level=False)
    assert contents.state.step == 0 and snap.final / CONTROLLER_STATE_FILE in reader.paths


def test_an_aborted_snapshot_leaves_nothing_and_a_failed_publish_is_aborted_by_its_caller(tmp_path):
    anchor = ensure_bootstrap_anchor(tmp_path)
    store = RunStore(tmp_path, writer=NotingWriter(fail=CONTROLLER_STATE_FILE))
    snap = store.begin(anchor)
    with pytest.raises(RunWriteError, match=CONTROLLER_STATE_FILE):
        store.publish(snap, _capture(), None, "rollout-1")
    assert snap.tmp.is_dir() and not snap.final.exists()
    store.abort(snap)
    store.abort(snap)  # idempotent
    assert not snap.tmp.exists()
    assert RunStore(tmp_path).select(turn_level=False, read_snapshots=True).snapshot.path is None


def test_a_reanchored_snapshot_is_published_under_the_newer_step(tmp_path):
    store = RunStore(tmp_path)
    old = ensure_bootstrap_anchor(tmp_path)
    snap = store.begin(old)
    assert store.reanchor(snap, old) is snap
    store.save_step(1, _bookkeeping(1), _save_json)
    moved = store.reanchor(snap, anchor_dir(tmp_path, 1))
    assert isinstance(moved, SnapshotDir) and moved.tmp == snap.tmp and moved.final.parent.parent == anchor_dir(tmp_path, 1)
    store.publish(moved, _capture(1, 1), GymCheckpointIndex.from_written("c", {}, {}, {}), "rollout-2")
    assert store.select(turn_level=True, read_snapshots=True).snapshot.path == moved.final


def test_begin_refuses_an_anchor_of_another_directory(tmp_path):
    with pytest.raises(SnapshotStoreError, match="not an anchor of"):
        RunStore(tmp_path / "a").begin(ensure_bootstrap_anchor(tmp_path / "b"))


def test_a_trainer_step_keeps_its_bookkeeping_as_the_controller_always_wrote_it(tmp_path):
    writer = NotingWriter()
    store = RunStore(tmp_path, writer=writer)
    kept = _bookkeeping(3)
    assert list(kept.as_saved()) == ["step", "dataloader", "ledger", "metrics_row"]
    store.save_step(3, kept, _save_json, {"config.yaml": b"a: 1\n"})
    step_dir = anchor_dir(tmp_path, 3)
    assert list_trainer_steps(tmp_path) == [3] and (step_dir / "config.yaml").read_bytes() == b"a: 1\n"
    assert {p.name.split(".")[1] for p in writer.paths} == {"config", "manifest"}  # through the store's writer
    saved = json.loads((step_dir / "trainer.json").read_text())
    assert store.read_step(step_dir, saved) == kept


def test_a_step_that_cannot_be_written_is_not_published_and_its_temporary_directory_goes(tmp_path):
    store = RunStore(tmp_path, writer=NotingWriter(fail="manifest.json"))
    with pytest.raises(RunWriteError, match="manifest.json"):
        store.save_step(1, _bookkeeping(1), _save_json)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_bad_bookkeeping_is_refused_naming_the_step_and_the_field(tmp_path):
    with pytest.raises(SnapshotStoreError, match=r"step_2: trainer state: dataloader: Field required"):
        RunStore(tmp_path).read_step(tmp_path / "step_2", {"step": 2, "ledger": {}})
