"""The run store: a snapshot's temporary directory is made, published and removed by it, every file goes
through the writer it was built with, and the trainer step's bookkeeping is written and read as one model."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from gym_patches.checkpoint.storage import FileSystemWriter
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import (
    CONTROLLER_STATE_FILE,
    ControllerStateCapture,
    GymCheckpointIndex,
    RunStore,
    SnapshotDir,
    TrainerBookkeeping,
)
from nemo_rl.experience.data_plane import DATA_PLANE_FILE, DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.atomic_write import write_json_atomic
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


PLAIN = FileSystemWriter()


def _capture(step: int = 0, anchor: int = 0) -> ControllerStateCapture:
    return ControllerStateCapture.take(step, anchor, RolloutRecoveryLedger(3), {"position": 0},
                                       DataPlaneStore())


def _bookkeeping(step: int) -> TrainerBookkeeping:
    return TrainerBookkeeping(step=step, dataloader={"position": 4}, ledger=RolloutRecoveryLedger(3).state_dict(),
                              metrics_row={"step": step})


def _save_json(directory: Path, extra: dict, writer) -> None:
    write_json_atomic(directory / "trainer.json", extra, writer)


def test_a_snapshot_is_begun_published_and_read_through_the_store(tmp_path):
    writer = NotingWriter()
    store = RunStore(tmp_path, writer, keep_latest_k=2)
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
    assert contents.state.step == 0


def test_an_aborted_snapshot_leaves_nothing_and_a_failed_publish_is_aborted_by_its_caller(tmp_path):
    anchor = ensure_bootstrap_anchor(tmp_path)
    store = RunStore(tmp_path, NotingWriter(fail=CONTROLLER_STATE_FILE), keep_latest_k=1)
    snap = store.begin(anchor)
    with pytest.raises(RunWriteError, match=CONTROLLER_STATE_FILE):
        store.publish(snap, _capture(), None, "rollout-1")
    assert snap.tmp.is_dir() and not snap.final.exists()
    store.abort(snap)
    store.abort(snap)  # idempotent
    assert not snap.tmp.exists()
    assert RunStore(tmp_path, PLAIN, keep_latest_k=1).select(turn_level=False, read_snapshots=True).snapshot.path is None


def test_a_reanchored_snapshot_is_published_under_the_newer_step(tmp_path):
    store = RunStore(tmp_path, PLAIN, keep_latest_k=1)
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
        RunStore(tmp_path / "a", PLAIN, keep_latest_k=1).begin(ensure_bootstrap_anchor(tmp_path / "b"))


def test_a_trainer_step_keeps_its_bookkeeping_as_the_controller_always_wrote_it(tmp_path):
    writer = NotingWriter()
    store = RunStore(tmp_path, writer, keep_latest_k=1)
    kept = _bookkeeping(3)
    assert list(kept.as_saved()) == ["step", "dataloader", "ledger", "metrics_row"]
    store.save_step(3, kept, _save_json, {"config.yaml": b"a: 1\n"})
    step_dir = anchor_dir(tmp_path, 3)
    assert list_trainer_steps(tmp_path) == [3] and (step_dir / "config.yaml").read_bytes() == b"a: 1\n"
    assert {p.name.split(".")[1] for p in writer.paths} == {"trainer", "config", "manifest"}  # through the store's writer
    saved = json.loads((step_dir / "trainer.json").read_text())
    assert store.read_step(step_dir, saved) == kept


def test_a_step_that_cannot_be_written_is_not_published_and_its_temporary_directory_goes(tmp_path):
    store = RunStore(tmp_path, NotingWriter(fail="manifest.json"), keep_latest_k=1)
    with pytest.raises(RunWriteError, match="manifest.json"):
        store.save_step(1, _bookkeeping(1), _save_json)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_bad_bookkeeping_is_refused_naming_the_step_and_the_field(tmp_path):
    with pytest.raises(SnapshotStoreError, match=r"step_2: trainer state: dataloader: Field required"):
        RunStore(tmp_path, PLAIN, keep_latest_k=1).read_step(tmp_path / "step_2", {"step": 2, "ledger": {}})


# ----- the writer handed to the store sees every file -------------------------------------------
class RecordingWriter(FileSystemWriter):
    """Test-only, named as such: writes plain files and records, for each file that reaches its final
    name, how it was written (``write`` / ``stream`` / ``put``); and every directory it commits."""

    def __init__(self) -> None:
        self.how: dict[Path, str] = {}  # temporary or final path -> how its bytes were written
        self.landed: dict[Path, str] = {}  # final path of a file -> how its bytes were written
        self.dirs: list[tuple[Path, Path]] = []

    def write(self, path, data):
        self.how[Path(path)] = "write"
        super().write(path, data)

    def open_write(self, path):
        self.how[Path(path)] = "stream"
        return super().open_write(path)

    def put(self, path, staged):
        self.landed[Path(path)] = "put"
        super().put(path, staged)

    def commit(self, src, dst, *, replace=True):
        src, dst = Path(src), Path(dst)
        if src.is_dir():
            self.dirs.append((src, dst))
        elif src in self.how:
            self.landed[dst] = self.how.pop(src)
        super().commit(src, dst, replace=replace)

    def under(self, root: Path) -> dict[str, str]:
        """The files that landed under ``root`` (relative POSIX path -> how)."""
        return {p.relative_to(root).as_posix(): how for p, how in self.landed.items() if p.is_relative_to(root)}


def test_a_recording_writer_passed_to_the_store_sees_every_file_of_a_snapshot(tmp_path):
    from gym_patches.checkpoint.store import write_participant_state
    from nemo_rl.experience.sample import RolloutSample

    writer = RecordingWriter()
    store = RunStore(tmp_path, writer, keep_latest_k=1)
    anchor = store.ensure_bootstrap()
    snap = store.begin(anchor)
    # Gym's records land in the snapshot's directory through a Gym server's own writer; here the same one.
    write_participant_state(snap.tmp, "agent", "replica-0", "c1", [{"episode_id": {"rollout_id": "r1", "attempt": 0}}],
                            writer=writer)
    plane = DataPlaneStore()
    plane.put(RolloutSample(rollout_id="r0", group_id="g", generation_index=0, reward=1.0))
    capture = ControllerStateCapture.take(0, 0, RolloutRecoveryLedger(3), {"position": 0}, plane)
    store.publish(snap, capture, GymCheckpointIndex.from_written("c1", {"i": {"agent": ["r1"]}}, {"i": {"r1"}}, {}),
                  "c1")
    manifest = verify_directory(snap.final, "rollout_snapshot")
    seen = writer.under(snap.tmp)
    assert set(seen) == {*manifest.files, "manifest.json"}, seen  # nothing reached the directory another way
    assert {"controller_state.json", DATA_PLANE_FILE, "gym_checkpoint.json"} <= set(seen)
    assert (snap.tmp, snap.final) in writer.dirs  # and the writer committed the directory


def test_a_recording_writer_passed_to_the_store_sees_every_file_of_a_trainer_step_including_the_weights(tmp_path):
    from nemo_rl.algorithms.grpo import GRPOTrainer
    from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import tiny_qwen_dir

    model = tiny_qwen_dir(tmp_path / "model")
    trainer = GRPOTrainer(PolicyConfig(device="cpu", max_seq_len=64), LossConfig(), GRPOConfig(seed=0),
                          load_policy(str(model), "float32", "cpu", 64))
    trainer.reset_reference()
    writer = RecordingWriter()
    store = RunStore(tmp_path / "ckpt", writer, keep_latest_k=1)
    manifest = store.save_step(1, _bookkeeping(1), lambda d, extra, w: trainer.save(d, extra, writer=w),
                               {"config.yaml": b"a: 1\n"})
    tmp = tmp_path / "ckpt" / ".tmp-step_1"
    seen = writer.under(tmp)
    assert set(seen) == {*manifest.files, "manifest.json"}, seen  # every file, none another way
    assert seen["model.safetensors"] == "put" and seen["config.json"] == "put"  # the weights, staged then put
    assert seen["optimizer.pt"] == seen["reference.pt"] == "stream"  # streamed: no in-memory copy of it
    assert (tmp, anchor_dir(tmp_path / "ckpt", 1)) in writer.dirs
    verify_directory(anchor_dir(tmp_path / "ckpt", 1), "trainer_step")
    assert not any(p.name.startswith(".staging-") for p in anchor_dir(tmp_path / "ckpt", 1).iterdir())


def test_a_weights_file_the_writer_cannot_put_fails_the_step_naming_that_file(tmp_path):
    from nemo_rl.algorithms.grpo import GRPOTrainer
    from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
    from nemo_rl.models.policy import load_policy
    from testkit.write_faults import FailingWriter
    from tests.model_fixtures import tiny_qwen_dir

    trainer = GRPOTrainer(PolicyConfig(device="cpu", max_seq_len=64), LossConfig(), GRPOConfig(seed=0),
                          load_policy(str(tiny_qwen_dir(tmp_path / "model")), "float32", "cpu", 64))
    store = RunStore(tmp_path / "ckpt", FailingWriter("ENOSPC:model.safetensors"), keep_latest_k=1)
    with pytest.raises(RunWriteError) as caught:
        store.save_step(1, _bookkeeping(1), lambda d, extra, w: trainer.save(d, extra, writer=w))
    assert caught.value.filename == str(tmp_path / "ckpt" / ".tmp-step_1" / "model.safetensors")
    assert "No space left on device" in str(caught.value)
    assert list((tmp_path / "ckpt").iterdir()) == []  # no step, no temporary directory, no staging left
