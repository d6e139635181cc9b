"""The rollout-snapshot component on real files: stager choice, the straight-line attempt, the
store's validated reads, restore's typed state, and hooks at the publish (no Gym: ledger-only
snapshots; the Gym stagers run against real servers in tests/functional)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gym_patches.checkpoint.storage import FileSystemWriter
from nemo_rl.algorithms.single_controller_utils.config import RolloutCheckpointConfig
from nemo_rl.algorithms.single_controller_utils.dispatch import DispatchGate, LedgerChanges
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot import (
    CONTROLLER_STATE_FILE,
    ControllerState,
    RolloutSnapshotter,
    RunRestorer,
    SnapshotInputs,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.stagers import (
    BlockingStager,
    LedgerOnlyStager,
    StagedStager,
    make_stager,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.experience.data_plane import DATA_PLANE_FILE, DataPlaneStore
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.experience.sample import RolloutSample
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.utils.snapshot_store import (
    SnapshotStoreError,
    anchor_dir,
    ensure_bootstrap_anchor,
    resolve_latest_snapshot,
    verify_directory,
)

ROWS = [{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]


class RecordingHooks(RunHooks):
    """Records every phase reached; raises ``fail`` at ``fail_at`` (a test's hooks, as the crash matrix's)."""

    def __init__(self, fail_at: str | None = None, fail: BaseException | None = None):
        self.reached_phases: list[tuple[str, object]] = []
        self.fail_at, self.fail = fail_at, fail

    def reached(self, phase: str, scope: object = None) -> None:
        self.reached_phases.append((phase, scope))
        if phase == self.fail_at and self.fail is not None:
            raise self.fail


class Run:
    """A controller's state at step 0: one group of two siblings, one sealed (its sample in the data plane)."""

    def __init__(self, root: Path):
        self.checkpoint_dir = root / "ckpt"
        ensure_bootstrap_anchor(self.checkpoint_dir)
        self.ledger = RolloutRecoveryLedger()
        self.ledger.reserve_group("g1", "p0", 0, None, None, "sibling", 2, 1, position=0)
        ids = [req.rollout_id for req in self.ledger.reserved_attempts()]
        for rid in ids:
            self.ledger.mark_dispatched(rid, "nemo_gym/replica-0")
        self.ledger.mark_sealed(ids[0], 1.0)
        self.sealed, self.running = ids
        self.data_plane = DataPlaneStore()
        self.data_plane.put(RolloutSample(rollout_id=ids[0], group_id="g1", generation_index=0, reward=1.0))
        self.dataloader = PromptDataloader(ROWS, seed=0)
        self.records = RunRecords(root / "logs")

    def inputs(self) -> SnapshotInputs:
        return SnapshotInputs(self.ledger, self.data_plane, self.dataloader, lambda: 0, lambda: 0,
                              lambda: anchor_dir(self.checkpoint_dir, 0))

    def snapshotter(self, hooks: RunHooks | None = None, **settings) -> RolloutSnapshotter:
        return RolloutSnapshotter(self.inputs(), None, self.records, RolloutCheckpointConfig(**settings),
                                  LedgerChanges(), self.store(RolloutCheckpointConfig(**settings).keep_latest_k), hooks=hooks)

    def store(self, keep_latest_k: int = 1) -> RunStore:
        return RunStore(self.checkpoint_dir, FileSystemWriter(), keep_latest_k=keep_latest_k)

    def restorer(self, *, read_snapshots: bool = True) -> RunRestorer:
        async def no_trainer(anchor: Path) -> dict:
            raise AssertionError("step 0 has no trainer state to load")

        return RunRestorer(self.checkpoint_dir, read_snapshots=read_snapshots, coordinator=None,
                           max_attempts_per_sibling=3, load_trainer=no_trainer, hooks=RunHooks(),
                           store=self.store())

    def rows(self) -> list[dict]:
        return self.records.read("snapshots.jsonl")


def test_one_stager_per_mode_is_chosen_once():
    inputs = SnapshotInputs(RolloutRecoveryLedger(), DataPlaneStore(), PromptDataloader(ROWS, seed=0),
                            lambda: 0, lambda: 0, lambda: Path("/nonexistent"))
    changes = LedgerChanges()
    gate = DispatchGate(changes)
    store = RunStore(Path("/nonexistent"), FileSystemWriter(), keep_latest_k=1)  # never written: only the choice is under test
    assert isinstance(make_stager("staged", inputs, RunHooks(), None, gate, changes, store), LedgerOnlyStager)
    coordinator = object()  # never called: only the choice is under test
    assert isinstance(make_stager("staged", inputs, RunHooks(), coordinator, gate, changes, store), StagedStager)
    assert isinstance(make_stager("blocking", inputs, RunHooks(), coordinator, gate, changes, store), BlockingStager)
    with pytest.raises(ValueError, match=r"rollout_checkpointing.commit_mode='fast': expected one of blocking, "
                                         r"staged"):
        make_stager("fast", inputs, RunHooks(), coordinator, gate, changes, store)


async def test_a_ledger_only_snapshot_restores_as_a_typed_state(tmp_path):
    run = Run(tmp_path)
    hooks = RecordingHooks()
    outcome = await run.snapshotter(hooks).attempt()
    assert outcome.committed and outcome.reason == "committed" and outcome.mode == "ledger_only"
    assert [p for p, _ in hooks.reached_phases] == ["persist", "publish"]  # no Gym: no prepare, no commit
    assert list(outcome.phases_s) == ["prepare", "cut", "resume", "publish"]
    (row,) = run.rows()
    assert row["commit_mode"] == "ledger_only" and row["committed"] and row["path"] == outcome.path

    restored = await run.restorer().restore()
    assert restored is not None and restored.step == 0
    assert restored.record["snapshot"] == outcome.path and restored.record["kept_siblings"] == 1
    assert restored.record["restarted_from_prompt"] == 1  # the sibling still running restarts
    assert [s.rollout_id for s in restored.data_plane.group_samples("g1")] == [run.sealed]
    assert restored.dataloader == run.dataloader.state_dict()
    assert "Restored rollout snapshot snapshot_" in restored.message


async def test_restore_mode_trainer_checkpoint_reads_no_snapshot(tmp_path):
    run = Run(tmp_path)
    assert (await run.snapshotter().attempt()).committed
    restored = await run.restorer(read_snapshots=False).restore()
    assert restored.record["snapshot"] is None and "restore_mode=trainer_checkpoint" in restored.record[
        "snapshot_reason"]
    assert len(restored.data_plane) == 0 and restored.dataloader is None


async def test_a_failure_at_the_publish_leaves_the_previous_snapshot_the_newest(tmp_path):
    run = Run(tmp_path)
    first = await run.snapshotter().attempt()
    failing = run.snapshotter(RecordingHooks("publish", OSError(28, "No space left on device", "x")))
    second = await failing.attempt()
    assert not second.committed and second.reason == "io_error" and "No space left" in second.error
    assert failing.consecutive_failures == 1
    snapshots = anchor_dir(run.checkpoint_dir, 0) / "rollout_snapshots"
    assert [p.name for p in snapshots.iterdir()] == [Path(first.path).name]  # no tmp dir left
    assert resolve_latest_snapshot(anchor_dir(run.checkpoint_dir, 0)).path == Path(first.path)
    assert [r["reason"] for r in run.rows()] == ["committed", "io_error"]


async def test_gym_failures_the_recovery_owns_are_not_failures_in_a_row(tmp_path):
    """A snapshot that failed on a replica whose server has exited or is stopped (the in-run recovery says so:
    here a stand-in that answers for the replica it is told is lost) does not count towards
    ``max_consecutive_failures``; the same failure on another replica does, and the third in a row stops the run."""
    from nemo_rl.algorithms.single_controller_utils.gym_coordinator import GymReplicasLeftOut

    run = Run(tmp_path)
    asked: list[list[str]] = []

    async def recovers(exc: BaseException) -> bool:  # stand-in for InRunRecovery.recovers
        asked.append(sorted(exc.left_out))
        return "nemo_gym/replica-0" in exc.left_out

    def snapshotter(replica: str) -> RolloutSnapshotter:
        why = {replica: f"{replica}: Gym server 'workplace_assistant' of {replica} is stopped"}
        hooks = RecordingHooks("persist", GymReplicasLeftOut(why))
        snap = run.snapshotter(hooks, max_consecutive_failures=3)
        snap.recovers = recovers
        return snap

    owned = snapshotter("nemo_gym/replica-0")
    for _ in range(5):
        outcome = await owned.attempt()
        assert not outcome.committed and outcome.reason == "gym_unavailable"
    assert owned.consecutive_failures == 0
    other = snapshotter("nemo_gym/replica-1")
    await other.attempt()
    await other.attempt()
    assert other.consecutive_failures == 2
    with pytest.raises(RuntimeError, match=r"3 consecutive rollout snapshots failed \(rollout_checkpointing"
                                           r"\.max_consecutive_failures=3\); last error: no Gym replica"):
        await other.attempt()
    assert asked == [["nemo_gym/replica-0"]] * 5 + [["nemo_gym/replica-1"]] * 3
    assert [r["reason"] for r in run.rows()] == ["gym_unavailable"] * 8  # each attempt has its row


async def test_a_restore_skips_a_snapshot_whose_samples_file_is_a_symlink_naming_it(tmp_path):
    """The checkpoint dir is untrusted input: a samples file replaced by a link to the same bytes outside it
    (size and digest still match the manifest) makes its snapshot unusable; the previous one is restored."""
    run = Run(tmp_path)
    first = await run.snapshotter(keep_latest_k=2).attempt()
    second = await run.snapshotter(keep_latest_k=2).attempt()
    assert first.committed and second.committed
    samples = Path(second.path) / DATA_PLANE_FILE
    outside = tmp_path / "elsewhere" / DATA_PLANE_FILE
    outside.parent.mkdir()
    outside.write_bytes(samples.read_bytes())
    samples.unlink()
    samples.symlink_to(outside)
    restored = await run.restorer().restore()
    assert restored.record["snapshot"] == first.path
    reasons = {s["path"]: s["reason"] for s in restored.record["skipped_snapshots"]}
    assert reasons == {second.path: f"{samples}: a symbolic link; a sealed directory holds only regular files "
                                     "and directories"}


@pytest.mark.parametrize("plant", ["linked_directory", "fifo"])
async def test_verify_refuses_a_link_or_a_special_file_anywhere_in_a_sealed_directory(tmp_path, plant):
    run = Run(tmp_path)
    path = Path((await run.snapshotter().attempt()).path)
    if plant == "linked_directory":  # a directory of real files moved out and linked back: every file still matches
        (path / "sub").mkdir()
        (path / "sub" / "x").write_text("x")
        verify_directory(path, "rollout_snapshot")  # an unlisted real directory is no harm
        (path / "sub").rename(tmp_path / "sub")
        (path / "sub").symlink_to(tmp_path / "sub")
        why = "a symbolic link"
    else:
        os.mkfifo(path / "pipe")
        why = "not a regular file"
    named = path / ("sub" if plant == "linked_directory" else "pipe")
    with pytest.raises(SnapshotStoreError, match=re.escape(f"{named}: {why}")):
        verify_directory(path, "rollout_snapshot")


async def test_an_invariant_error_stops_the_run_and_is_recorded(tmp_path):
    run = Run(tmp_path)
    with pytest.raises(RuntimeError, match="a bug"):
        await run.snapshotter(RecordingHooks("persist", RuntimeError("a bug"))).attempt()
    assert [r["reason"] for r in run.rows()] == ["invariant_error"]


async def test_controller_state_is_validated_where_it_is_read(tmp_path):
    run = Run(tmp_path)
    outcome = await run.snapshotter().attempt()
    path = Path(outcome.path) / CONTROLLER_STATE_FILE
    state = ControllerState.read(Path(outcome.path))
    assert state.step == 0 and state.data_plane.count == 1
    data = json.loads(path.read_text())
    data["data_plane"]["sha256"] = "not-a-digest"
    path.write_text(json.dumps(data))
    with pytest.raises(SnapshotStoreError, match=rf"{path}: data_plane.sha256: String should match pattern"):
        ControllerState.read(Path(outcome.path))
    path.write_text("{")
    with pytest.raises(SnapshotStoreError, match=rf"{path}: cannot read"):
        ControllerState.read(Path(outcome.path))


async def test_the_ledger_taken_unvalidated_in_the_pause_is_checked_before_the_seal(tmp_path):
    """``state_json`` skips validation inside the pause; the write checks the bytes: a ledger broken
    by a bug fails the attempt as invariant_error and publishes nothing."""
    run = Run(tmp_path)
    assert json.loads(run.ledger.state_json()) == run.ledger.state_dict()
    group = run.ledger.groups["g1"]
    sibling = group.siblings[0]
    # a corruption no transition makes, through the ledger's unchecked record edit (as a bug in a restart
    # rule would make it): model_construct bypasses validation
    run.ledger.replace_current(group, sibling, sibling.current_attempt.model_construct(
        **{**sibling.current_attempt.__dict__, "refusals": -1}))
    with pytest.raises(Exception, match="ledger state is inconsistent"):
        await run.snapshotter().attempt()
    assert [r["reason"] for r in run.rows()] == ["invariant_error"]
    assert not (anchor_dir(run.checkpoint_dir, 0) / "rollout_snapshots").exists() or not any(
        (anchor_dir(run.checkpoint_dir, 0) / "rollout_snapshots").iterdir())


def test_rollouts_of_an_agent_on_a_restart_only_server_are_never_in_a_commit_scope():
    """A /run that reached a restart-only agent after it answered prepare is missing from Gym's
    unsaved report; the plan still keeps it out of every scope (a blocking commit would refuse the
    scope with restart_in_scope), as it does for the ones Gym reported."""
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import plan_snapshot, server_scopes

    iid = "nemo_gym/replica-0"
    ledger = RolloutRecoveryLedger()
    ledger.reserve_group("g1", "p0", 0, None, "simple", "turn", 1, 1, position=0)
    ledger.reserve_group("g2", "p1", 1, None, "plain", "turn", 2, 1, position=1)
    ids = {req.rollout_id: req for req in ledger.reserved_attempts()}
    for rid in ids:
        ledger.mark_dispatched(rid, iid)
    saved = ledger.groups["g1"].rollout_id(0)
    reported, late = ledger.groups["g2"].rollout_id(0), ledger.groups["g2"].rollout_id(1)
    plan = plan_snapshot(ledger, [iid], {iid: {reported}}, unsavable_agents={iid: {"plain"}})
    assert set(plan.scope[iid]) == {saved} and plan.unsaved[iid] == {reported, late}
    servers = {iid: {"simple": ["simple", "model", "tools"], "plain": ["plain", "model", "sandbox"]}}
    assert server_scopes(plan, servers)[iid] == {"simple": [saved], "model": [saved], "tools": [saved]}
    without = plan_snapshot(ledger, [iid], {iid: {reported}})  # what Gym's report alone would give
    assert late in without.scope[iid]
