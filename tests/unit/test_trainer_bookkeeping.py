"""Trainer-checkpoint bookkeeping reads each byte once: listing and pruning trust the commit marker
(stat only), sealing takes the digests written, and a restore hashes only the step it restores.

Real files in ``tmp_path``. Reads are counted two ways: a spy on ``sha256_file`` (which files were
hashed) and the kernel's ``rchar`` from ``/proc/self/io`` (how many bytes this process read).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest

from nemo_rl.utils import snapshot_store
from nemo_rl.utils.atomic_write import recording_digests, write_bytes_atomic, write_json_atomic
from nemo_rl.utils.snapshot_store import (
    MANIFEST_NAME,
    SnapshotStoreError,
    commit_snapshot,
    list_trainer_steps,
    prepare_snapshot_paths,
    prepare_trainer_step,
    prune_trainer_steps,
    publish_trainer_step,
    resolve_latest_snapshot,
    resolve_restore_point,
    trust_directory,
    verify_directory,
)
from nemo_rl.utils.write_errors import RunWriteError
from gym_patches.checkpoint.storage import FileSystemWriter

MB = 1 << 20


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """Every file ``snapshot_store`` hashes, in order (the real ``sha256_file`` still runs)."""
    seen: list[Path] = []
    real = snapshot_store.sha256_file

    def counting_sha256_file(path):
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(snapshot_store, "sha256_file", counting_sha256_file)
    return seen


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


needs_proc_io = pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")


def _step(ckpt: Path, step: int, size: int = 4096) -> Path:
    """A trainer step as the trainer writes it: optimizer and state through ``write_bytes_atomic``
    (digests recorded), the weights some other way (like ``save_pretrained``)."""
    tmp, final = prepare_trainer_step(ckpt, step)
    with recording_digests(tmp) as digests:
        write_bytes_atomic(tmp / "optimizer.pt", os.urandom(size))
        write_json_atomic(tmp / "trainer_state.json", {"step": step})
        (tmp / "model.safetensors").write_bytes(os.urandom(size))
    publish_trainer_step(tmp, final, metadata={"step": step}, digests=digests)
    return final


def _flip_a_byte(path: Path) -> None:
    """Corrupt ``path`` keeping its size: the commit marker still holds, only the digest can tell."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


# ----- sealing --------------------------------------------------------------------------------
def test_seal_hashes_only_the_files_not_written_through_write_bytes_atomic(tmp_path, hashed):
    step = _step(tmp_path, 1)
    assert [p.name for p in hashed] == ["model.safetensors"]  # the optimizer and state came with their digests
    manifest = json.loads((step / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"optimizer.pt", "trainer_state.json", "model.safetensors"}
    for rel, entry in manifest["files"].items():  # the recorded digests are the bytes on disk
        assert entry["sha256"] == hashlib.sha256((step / rel).read_bytes()).hexdigest()
        assert entry["size"] == (step / rel).stat().st_size
    verify_directory(step, "trainer_step")


def test_a_file_replaced_after_it_was_recorded_is_hashed_at_seal(tmp_path, hashed):
    tmp, final = prepare_trainer_step(tmp_path, 1)
    with recording_digests(tmp) as digests:
        write_bytes_atomic(tmp / "optimizer.pt", b"a" * 100)
    (tmp / "other.pt").write_bytes(b"b" * 100)
    os.replace(tmp / "other.pt", tmp / "optimizer.pt")  # same size, another file: the stale digest is not used
    publish_trainer_step(tmp, final, digests=digests)
    assert [p.name for p in hashed] == ["optimizer.pt"]
    verify_directory(final, "trainer_step")


def test_recording_keeps_only_files_under_its_root_and_ends_with_the_block(tmp_path):
    with recording_digests(tmp_path / "step") as digests:
        write_bytes_atomic(tmp_path / "step" / "a.bin", b"a")
        write_bytes_atomic(tmp_path / "elsewhere.json", b"{}")
    write_bytes_atomic(tmp_path / "step" / "b.bin", b"b")
    assert len(digests) == 1


def test_a_snapshot_commit_takes_recorded_digests_too(tmp_path, hashed):
    tmp, final = prepare_snapshot_paths(tmp_path)
    with recording_digests(tmp) as digests:
        write_json_atomic(tmp / "controller_state.json", {"step": 0})
    commit_snapshot(tmp, final, 2, digests=digests)
    assert hashed == []
    assert resolve_latest_snapshot(tmp_path).path == final


# ----- listing and pruning trust the commit marker ------------------------------------------------
@needs_proc_io
def test_listing_and_pruning_read_no_checkpoint_bytes(tmp_path, hashed):
    for step in (1, 2, 3, 4):
        _step(tmp_path, step, size=2 * MB)
    hashed.clear()
    before = _rchar()
    assert list_trainer_steps(tmp_path) == [1, 2, 3, 4]
    removed = prune_trainer_steps(tmp_path, 3, newest=4)
    read = _rchar() - before
    assert [p.name for p in removed] == ["step_1"]
    assert hashed == []
    assert read < 256 * 1024, f"listing + pruning read {read} bytes of 16 MB of checkpoints"  # the manifests only


def test_same_size_corruption_is_listed_and_pruned_but_restore_detects_it_and_falls_back(tmp_path):
    for step in (1, 2, 3):
        _step(tmp_path, step)
    _flip_a_byte(tmp_path / "step_3" / "optimizer.pt")
    assert list_trainer_steps(tmp_path) == [1, 2, 3]  # no byte of it was read: it is trusted
    assert prune_trainer_steps(tmp_path, 3, newest=3) == []
    point = resolve_restore_point(tmp_path)
    assert point.step == 2 and point.anchor == tmp_path / "step_2"
    (path, reason), = point.skipped
    assert path == tmp_path / "step_3"
    assert reason == f"{tmp_path / 'step_3' / 'optimizer.pt'}: sha256 does not match the manifest"


def _no_manifest(step: Path) -> str:
    (step / MANIFEST_NAME).unlink()
    return f"{step / MANIFEST_NAME}: missing"


def _shorter_file(step: Path) -> str:
    path = step / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:-1])
    return f"{path}: size 4095, manifest says 4096"


def _missing_file(step: Path) -> str:
    (step / "model.safetensors").unlink()
    return f"{step / 'model.safetensors'}: listed in the manifest but missing"


def _torn_manifest(step: Path) -> str:
    raw = (step / MANIFEST_NAME).read_bytes()
    (step / MANIFEST_NAME).write_bytes(raw[: len(raw) // 2])
    return f"{step / MANIFEST_NAME}: unreadable manifest"


@pytest.mark.parametrize("tear", [_no_manifest, _shorter_file, _missing_file, _torn_manifest],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_torn_step_is_not_listed_and_restore_skips_it_without_hashing_it(tmp_path, hashed, tear):
    _step(tmp_path, 1)
    torn = _step(tmp_path, 2)
    why = tear(torn)
    assert list_trainer_steps(tmp_path) == [1]
    with pytest.raises(SnapshotStoreError, match="step_2"):
        trust_directory(torn, "trainer_step")
    hashed.clear()
    point = resolve_restore_point(tmp_path)
    assert point.step == 1
    assert [(p, r.startswith(why)) for p, r in point.skipped] == [(torn, True)]
    assert {p.parent for p in hashed} == {tmp_path / "step_1"}  # the torn one cost no read


def test_a_renamed_step_whose_manifest_names_another_step_is_not_listed(tmp_path):
    _step(tmp_path, 1)
    (tmp_path / "step_1").rename(tmp_path / "step_7")
    assert list_trainer_steps(tmp_path) == []
    assert resolve_restore_point(tmp_path) is None


def test_prune_neither_counts_nor_removes_steps_newer_than_the_one_just_saved(tmp_path):
    """After a restore went past a corrupt step 6 to step 4, saving step 5 with k=1 keeps step 5."""
    for step in (4, 6):
        _step(tmp_path, step)
    _flip_a_byte(tmp_path / "step_6" / "optimizer.pt")
    assert resolve_restore_point(tmp_path).step == 4
    _step(tmp_path, 5)
    removed = prune_trainer_steps(tmp_path, 1, newest=5)
    assert [p.name for p in removed] == ["step_4"]
    assert list_trainer_steps(tmp_path) == [5, 6]
    assert resolve_restore_point(tmp_path).step == 5


def test_publish_replaces_a_corrupt_step_a_restore_skipped(tmp_path):
    _step(tmp_path, 1)
    _step(tmp_path, 2)
    _flip_a_byte(tmp_path / "step_2" / "model.safetensors")
    assert resolve_restore_point(tmp_path).step == 1
    _step(tmp_path, 2)  # the run trains step 2 again: the same-size corrupt one is replaced
    point = resolve_restore_point(tmp_path)
    assert point.step == 2 and point.skipped == ()


# ----- restore hashes only what it restores -------------------------------------------------------
@needs_proc_io
def test_restore_verifies_only_the_chosen_step(tmp_path, hashed):
    for step in (1, 2, 3):
        _step(tmp_path, step, size=2 * MB)
    hashed.clear()
    before = _rchar()
    point = resolve_restore_point(tmp_path)
    read = _rchar() - before
    assert point.step == 3 and point.skipped == ()
    assert sorted(p.name for p in hashed) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert {p.parent for p in hashed} == {tmp_path / "step_3"}
    step_bytes = sum(p.stat().st_size for p in (tmp_path / "step_3").iterdir())
    assert step_bytes <= read < step_bytes + 256 * 1024, (read, step_bytes)  # one pass over one step


def test_restore_after_a_corrupt_newest_hashes_that_one_and_the_one_restored(tmp_path, hashed):
    for step in (1, 2, 3):
        _step(tmp_path, step)
    _flip_a_byte(tmp_path / "step_3" / "model.safetensors")
    hashed.clear()
    point = resolve_restore_point(tmp_path)
    assert point.step == 2
    assert {p.parent.name for p in hashed} == {"step_2", "step_3"}  # step_1 is never read


def test_restore_point_passes_required_to_its_snapshot(tmp_path):
    step = _step(tmp_path, 1)
    complete = _snapshot(step, ["controller_state.json", "gym_checkpoint.json"])
    _snapshot(step, ["controller_state.json"])
    point = resolve_restore_point(tmp_path, required=("controller_state.json", "gym_checkpoint.json"))
    assert point.snapshot.path == complete and len(point.snapshot.skipped) == 1


def test_restore_point_without_snapshots_reads_none(tmp_path, hashed):
    step = _step(tmp_path, 1)
    _snapshot(step, ["controller_state.json"])
    hashed.clear()
    point = resolve_restore_point(tmp_path, read_snapshots=False)
    assert point.step == 1 and point.snapshot == (None, [], None)
    assert {p.parent for p in hashed} == {step}  # the trainer step only, no snapshot file


# ----- required files in resolve_latest_snapshot ---------------------------------------------------
def _snapshot(anchor: Path, files: list[str]) -> Path:
    tmp, final = prepare_snapshot_paths(anchor)
    for name in files:
        write_json_atomic(tmp / name, {"name": name})
    commit_snapshot(tmp, final, 10)
    return final


def test_a_snapshot_that_does_not_list_a_required_file_is_skipped_for_an_older_one(tmp_path):
    good = _snapshot(tmp_path, ["controller_state.json", "gym_checkpoint.json"])
    lacking = _snapshot(tmp_path, ["controller_state.json"])
    bare = _snapshot(tmp_path, [])
    sel = resolve_latest_snapshot(tmp_path, required=("controller_state.json", "gym_checkpoint.json"))
    assert sel.path == good and sel.manifest.sequence == 1
    assert sel.skipped == [
        (bare, f"{bare / 'controller_state.json'}: missing (not listed in {bare / MANIFEST_NAME}; "
               "the restore needs it)"),
        (lacking, f"{lacking / 'gym_checkpoint.json'}: missing (not listed in {lacking / MANIFEST_NAME}; "
                  "the restore needs it)"),
    ]
    assert resolve_latest_snapshot(tmp_path).path == bare  # nothing required: the newest valid one


def test_required_walks_past_corrupt_and_lacking_snapshots_in_one_scan(tmp_path):
    good = _snapshot(tmp_path, ["controller_state.json"])
    corrupt = _snapshot(tmp_path, ["controller_state.json"])
    _flip_a_byte(corrupt / "controller_state.json")
    lacking = _snapshot(tmp_path, ["data.json"])
    sel = resolve_latest_snapshot(tmp_path, required=("controller_state.json",))
    assert sel.path == good
    assert [p for p, _ in sel.skipped] == [lacking, corrupt]
    assert "sha256 does not match the manifest" in sel.skipped[1][1]
    none = resolve_latest_snapshot(tmp_path, required=("absent.json",))
    assert none.path is None and len(none.skipped) == 3


# ----- the storage writer seam ------------------------------------------------------------------
class HalfThenFullDisk(FileSystemWriter):
    """A disk that fills up mid-file: half the bytes of a matching file land, then ENOSPC."""

    def __init__(self, fragment: str):
        self.fragment = fragment
        self.paths: list[Path] = []

    def write(self, path: Path, data: bytes) -> None:
        self.paths.append(path)
        if self.fragment not in path.name:
            return super().write(path, data)
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_failing_writer_leaves_no_torn_file_and_the_error_names_the_file(tmp_path):
    target = tmp_path / "optimizer.pt"
    write_bytes_atomic(target, b"old bytes")
    with pytest.raises(RunWriteError) as caught:
        write_bytes_atomic(target, b"new bytes, twice as many", HalfThenFullDisk("optimizer.pt"))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)
    assert os.listdir(tmp_path) == ["optimizer.pt"]  # no temp file left
    assert target.read_bytes() == b"old bytes"  # the old file is whole


def test_a_manifest_that_cannot_be_written_publishes_nothing(tmp_path):
    _step(tmp_path, 1)
    writer = HalfThenFullDisk(MANIFEST_NAME)
    tmp, final = prepare_trainer_step(tmp_path, 2)
    with recording_digests(tmp) as digests:
        write_bytes_atomic(tmp / "optimizer.pt", b"x" * 64, writer)
    with pytest.raises(RunWriteError, match="manifest.json"):
        publish_trainer_step(tmp, final, digests=digests, writer=writer)
    assert not final.exists() and list_trainer_steps(tmp_path) == [1]
    assert sorted(p.name for p in tmp.iterdir()) == ["optimizer.pt"]  # the caller removes the tmp dir
    assert [p.name.split(".")[1] for p in writer.paths] == ["optimizer", "manifest"]  # every file went through it


def test_snapshot_store_reads_no_test_environment_and_imports_no_testing_module():
    source = Path(snapshot_store.__file__).read_text()
    assert "testing" not in source and "os.environ" not in source and "getenv" not in source


# ----- the GRPO trainer's save -----------------------------------------------------------------
def test_grpo_trainer_save_is_sealed_hashing_only_what_hugging_face_wrote(tmp_path, hashed):
    from nemo_rl.algorithms.grpo import GRPOTrainer
    from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
    from nemo_rl.models.policy import load_policy
    from tests.model_fixtures import tiny_qwen_dir

    model = tiny_qwen_dir(tmp_path / "model")
    trainer = GRPOTrainer(PolicyConfig(device="cpu", max_seq_len=64), LossConfig(), GRPOConfig(seed=0),
                          load_policy(str(model), "float32", "cpu", 64))
    trainer.reset_reference()
    tmp, final = prepare_trainer_step(tmp_path / "ckpt", 1)
    with recording_digests(tmp) as digests:
        trainer.save(tmp, dataloader_state={"position": 0})
    publish_trainer_step(tmp, final, digests=digests)
    names = {p.name for p in hashed}
    assert {"optimizer.pt", "reference.pt", "rng.pt", "trainer_state.json"}.isdisjoint(names)
    assert "model.safetensors" in names  # save_pretrained writes it itself: hashed once, at seal
    assert len(hashed) == len(names)  # each at most once
    verify_directory(final, "trainer_step")


# ----- the controller's save: checkpoint_s, nothing read back ------------------------------------------
def test_save_trainer_checkpoint_returns_checkpoint_s_and_reads_no_checkpoint(tmp_path, hashed):
    """The controller's own method on a stand-in controller: the recording trainer (the RL tests'
    trainer), the real store, keep_top_k=2."""
    import asyncio
    from types import SimpleNamespace

    from nemo_rl.algorithms.recording_trainer import STATE_FILE, RecordingTrainer
    from nemo_rl.algorithms.single_controller import SingleController
    from nemo_rl.algorithms.single_controller_utils.coverage import SnapshotCoverage
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
    from nemo_rl.experience.data_plane import DataPlaneStore
    from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
    from nemo_rl.utils.run_hooks import RunHooks

    ckpt = tmp_path / "ckpt"
    controller = SimpleNamespace(
        step=0, anchor_step=0, checkpoint_dir=ckpt, store=RunStore(ckpt, FileSystemWriter(), keep_latest_k=1), snapshotter=None,
        trainer=RecordingTrainer(tmp_path / "logs"),
        dataloader=SimpleNamespace(state_dict=lambda: {"position": 0}),
        ledger=RolloutRecoveryLedger(), data_plane=DataPlaneStore(), _trained_pending={}, _rollouts={},
        hooks=RunHooks(),
        coverage=SnapshotCoverage(None),
        config=SimpleNamespace(checkpointing=SimpleNamespace(keep_top_k=2), grpo=SimpleNamespace(max_num_steps=10),
                               to_yaml=lambda: "grpo:\n  seed: 7\n"),
    )
    controller._prune = lambda newest: SingleController._prune(controller, newest)
    seconds = []
    for step in (1, 2, 3):
        controller.step = step
        seconds.append(asyncio.run(SingleController.save_trainer_checkpoint(controller)))
    assert all(isinstance(s, float) and s > 0 for s in seconds)
    assert controller.anchor_step == 3 and list_trainer_steps(ckpt) == [2, 3]
    assert hashed == []  # the trainer's file and the config came with their digests; pruning only stats
    manifest = verify_directory(ckpt / "step_3", "trainer_step")
    assert set(manifest.files) == {STATE_FILE, "config.yaml"}  # the config the step was trained with, sealed
    assert (ckpt / "step_3" / "config.yaml").read_text() == "grpo:\n  seed: 7\n"


# ----- retention: the spare anchor goes once no restore can need it ------------------------------
def _stand_in(tmp_path, max_num_steps: int, newest_snapshot_under: int):
    """A stand-in controller (the recording trainer, the real store, keep_top_k=2) whose run store holds, for a
    relaunch, a snapshot under ``newest_snapshot_under`` (pruning reads only the holds)."""
    import asyncio
    from types import SimpleNamespace

    from nemo_rl.algorithms.recording_trainer import RecordingTrainer
    from nemo_rl.algorithms.single_controller import SingleController
    from nemo_rl.algorithms.single_controller_utils.coverage import SnapshotCoverage
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
    from nemo_rl.experience.data_plane import DataPlaneStore
    from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
    from nemo_rl.utils.run_hooks import RunHooks
    from nemo_rl.utils.snapshot_store import anchor_dir

    ckpt = tmp_path / "ckpt"
    store = RunStore(ckpt, FileSystemWriter(), keep_latest_k=1)
    store.hold("relaunch", anchor_dir(ckpt, newest_snapshot_under) / "rollout_snapshots" / "snapshot_000001")
    controller = SimpleNamespace(
        step=0, anchor_step=0, checkpoint_dir=ckpt, store=store, snapshotter=SimpleNamespace(busy=asyncio.Lock()),
        trainer=RecordingTrainer(tmp_path / "logs"), dataloader=SimpleNamespace(state_dict=lambda: {"position": 0}),
        ledger=RolloutRecoveryLedger(), data_plane=DataPlaneStore(), _trained_pending={}, _rollouts={},
        hooks=RunHooks(), coverage=SnapshotCoverage(None), _pruned_sparing=frozenset(),
        config=SimpleNamespace(checkpointing=SimpleNamespace(keep_top_k=2),
                               grpo=SimpleNamespace(max_num_steps=max_num_steps), to_yaml=lambda: "a: 1\n"),
    )
    controller._prune = lambda newest: SingleController._prune(controller, newest)
    return controller


def _save_steps(controller, steps) -> None:
    import asyncio

    from nemo_rl.algorithms.single_controller import SingleController

    for step in steps:
        controller.step = step
        asyncio.run(SingleController.save_trainer_checkpoint(controller))


def test_the_spare_anchor_stays_while_a_restore_needs_it_and_goes_once_a_newer_step_holds_a_snapshot(tmp_path):
    import asyncio

    from nemo_rl.algorithms.single_controller import SingleController
    from nemo_rl.utils.snapshot_store import anchor_dir

    controller = _stand_in(tmp_path, max_num_steps=10, newest_snapshot_under=1)
    _save_steps(controller, (1, 2, 3))
    ckpt = controller.checkpoint_dir
    assert list_trainer_steps(ckpt) == [1, 2, 3] and controller._pruned_sparing == {1}  # it holds the newest snapshot
    # a snapshot published under step 3: a relaunch takes that one
    controller.store.hold("relaunch", anchor_dir(ckpt, 3) / "rollout_snapshots" / "snapshot_000002")
    controller.anchor_step = 3
    asyncio.run(SingleController._prune_again(controller))
    assert list_trainer_steps(ckpt) == [2, 3] and controller._pruned_sparing == {3}


def test_the_snapshot_a_recovery_needs_survives_a_trainer_step_prune_at_keep_top_k_1(tmp_path):
    """One retention rule: a snapshot held for an in-run recovery (the newest that saved a replica's rollouts,
    while newer ones left that replica out) keeps its trainer step, whatever ``keep_top_k`` says."""
    from nemo_rl.utils.snapshot_store import anchor_dir

    controller = _stand_in(tmp_path, max_num_steps=10, newest_snapshot_under=3)
    controller.config.checkpointing.keep_top_k = 1
    ckpt = controller.checkpoint_dir
    controller.store.hold("gym:nemo_gym/replica-1", anchor_dir(ckpt, 1) / "rollout_snapshots" / "snapshot_000001")
    _save_steps(controller, (1, 2, 3))
    assert list_trainer_steps(ckpt) == [1, 3]  # step 2 went; step 1 holds what a recovery of replica-1 needs
    controller.store.hold("gym:nemo_gym/replica-1", None)  # a newer snapshot saved replica-1 again
    _save_steps(controller, (4,))
    assert list_trainer_steps(ckpt) == [3, 4]  # step 1 went with it; step 3 holds the relaunch's newest


def test_a_complete_run_keeps_only_keep_top_k_steps(tmp_path):
    controller = _stand_in(tmp_path, max_num_steps=3, newest_snapshot_under=1)
    _save_steps(controller, (1, 2))
    assert list_trainer_steps(controller.checkpoint_dir) == [1, 2]
    _save_steps(controller, (3,))  # the last step: the run is complete, no restore needs step 1
    assert list_trainer_steps(controller.checkpoint_dir) == [2, 3] and controller._pruned_sparing == frozenset()
