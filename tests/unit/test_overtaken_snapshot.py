"""A snapshot overtaken by a trainer checkpoint is kept (docs/design.md §5.9), on real files: cut before
the publish it stays under its own anchor, which the prune spares and a restore picks; cut after it, its
directory is renamed under the new anchor at the publish. The Gym stagers' re-anchoring runs against real
servers in tests/functional/test_overtaken_snapshots.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gym_patches.checkpoint.storage import FileSystemWriter
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
from nemo_rl.algorithms.single_controller_utils.config import RolloutCheckpointConfig
from nemo_rl.algorithms.single_controller_utils.dispatch import LedgerChanges
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot import (
    ControllerState,
    RolloutSnapshotter,
    SnapshotInputs,
)
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.utils.atomic_write import write_json_atomic
from nemo_rl.utils.snapshot_store import (
    anchor_dir,
    commit_snapshot,
    ensure_bootstrap_anchor,
    next_snapshot_path,
    prepare_snapshot_paths,
    prepare_trainer_step,
    prune_trainer_steps,
    publish_trainer_step,
    resolve_restore_point,
    verify_directory,
)

ROWS = [{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]


def _publish_step(ckpt: Path, step: int) -> None:
    tmp, final = prepare_trainer_step(ckpt, step)
    (tmp / "weights.txt").write_text(f"w{step}")
    publish_trainer_step(tmp, final, metadata={"step": step})


class PublishAt(RunHooks):
    """Publishes trainer step 1 (and moves the anchor) when the attempt reaches ``phase``."""

    def __init__(self, ckpt: Path, anchor: dict, phase: str):
        self.ckpt, self.anchor, self.phase = ckpt, anchor, phase

    def reached(self, phase: str, scope: object = None) -> None:
        if phase == self.phase and self.anchor["now"] == 0:
            _publish_step(self.ckpt, 1)
            self.anchor["now"] = 1


def test_a_snapshot_cut_before_the_publish_stays_under_its_anchor_which_prune_spares_and_restore_picks(tmp_path):
    ckpt = tmp_path / "ckpt"
    ensure_bootstrap_anchor(ckpt)
    ledger = RolloutRecoveryLedger()
    ledger.reserve_group("g1", "p0", 0, None, None, "sibling", 2, 1, position=0)
    anchor = {"now": 0}
    inputs = SnapshotInputs(ledger, DataPlaneStore(), PromptDataloader(ROWS, seed=0), lambda: 1,
                            lambda: anchor["now"], lambda: anchor_dir(ckpt, anchor["now"]))
    records = RunRecords(tmp_path / "logs")
    store = RunStore(ckpt, FileSystemWriter(), keep_latest_k=RolloutCheckpointConfig().keep_latest_k)
    snapshotter = RolloutSnapshotter(inputs, None, records, RolloutCheckpointConfig(), LedgerChanges(), store,
                                     hooks=PublishAt(ckpt, anchor, "persist"))  # after the cut, before the publish
    outcome = asyncio.run(snapshotter.attempt())
    assert outcome.committed and outcome.reason == "committed"
    assert (outcome.anchor_step, outcome.overtaken_by) == (0, 1)
    assert Path(outcome.path).parent.parent == anchor_dir(ckpt, 0)
    assert ControllerState.read(Path(outcome.path)).anchor_step == 0
    [row] = records.read("snapshots.jsonl")
    assert row["committed"] and row["anchor_step"] == 0 and row["overtaken_by"] == 1
    assert store.held() == {Path(outcome.path)} and store.held_anchors() == {0}  # held for a relaunch
    # keep_top_k=1 would take bootstrap with step 1 published; the newest snapshot's anchor is spared
    assert store.prune_steps(1, 1) == []
    point = resolve_restore_point(ckpt, ("controller_state.json",))
    assert point.step == 1 and point.snapshot.path == Path(outcome.path)
    assert prune_trainer_steps(ckpt, 1, 1) == [anchor_dir(ckpt, 0)]  # without the spare it would go


def test_an_attempt_not_overtaken_has_no_overtaken_by(tmp_path):
    ckpt = tmp_path / "ckpt"
    ensure_bootstrap_anchor(ckpt)
    inputs = SnapshotInputs(RolloutRecoveryLedger(), DataPlaneStore(), PromptDataloader(ROWS, seed=0), lambda: 0,
                            lambda: 0, lambda: anchor_dir(ckpt, 0))
    records = RunRecords(tmp_path / "logs")
    store = RunStore(ckpt, FileSystemWriter(), keep_latest_k=RolloutCheckpointConfig().keep_latest_k)
    snapshotter = RolloutSnapshotter(inputs, None, records, RolloutCheckpointConfig(), LedgerChanges(), store)
    outcome = asyncio.run(snapshotter.attempt())
    assert outcome.committed and outcome.overtaken_by is None and store.held_anchors() == {0}
    assert "overtaken_by" not in records.read("snapshots.jsonl")[0]


def test_a_snapshot_staged_under_an_older_anchor_is_published_under_the_new_one(tmp_path):
    """The re-anchored publish: the temporary directory made under bootstrap is sealed and renamed into
    step 1's ``rollout_snapshots/`` (created); step 1 stays intact, nothing is left under bootstrap."""
    ckpt = tmp_path / "ckpt"
    ensure_bootstrap_anchor(ckpt)
    tmp, _ = prepare_snapshot_paths(anchor_dir(ckpt, 0))
    write_json_atomic(tmp / "controller_state.json", {"anchor_step": 1})
    _publish_step(ckpt, 1)
    final = next_snapshot_path(anchor_dir(ckpt, 1))
    assert final == anchor_dir(ckpt, 1) / "rollout_snapshots" / "snapshot_000001" and not final.parent.exists()
    commit_snapshot(tmp, final, keep_latest_k=2, metadata={"anchor_step": 1})
    assert verify_directory(final, "rollout_snapshot").metadata["anchor_step"] == 1
    assert not any((anchor_dir(ckpt, 0) / "rollout_snapshots").iterdir())
    verify_directory(anchor_dir(ckpt, 1), "trainer_step")  # its manifest does not cover rollout_snapshots/
    point = resolve_restore_point(ckpt, ("controller_state.json",))
    assert point.step == 1 and point.snapshot.path == final
