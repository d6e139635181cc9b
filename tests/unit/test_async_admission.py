"""The async controller's pure parts: the in_order sampler's admission, snapshot coverage, the
trainer checkpoint's view of the ledger, a snapshot restored under a newer trainer step, and the
``async_rl`` keys' validation (each error names its key)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gym_patches.checkpoint.storage import FileSystemWriter
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore
from nemo_rl.algorithms.single_controller_utils.admission import InOrderAdmission
from nemo_rl.algorithms.single_controller_utils.config import ConfigError, RolloutCheckpointConfig, load_config
from nemo_rl.algorithms.single_controller_utils.coverage import SnapshotCoverage
from nemo_rl.algorithms.single_controller_utils.dispatch import LedgerChanges
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot import (
    RolloutSnapshotter,
    RunRestorer,
    SnapshotInputs,
)
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.data.dataloader import PromptDataloader
from nemo_rl.experience.data_plane import DataPlaneStore
from nemo_rl.experience.rollout_recovery import PromptGroupStatus, RolloutRecoveryLedger
from nemo_rl.experience.sample import RolloutSample
from nemo_rl.utils.run_hooks import RunHooks
from nemo_rl.utils.snapshot_store import (
    anchor_dir,
    ensure_bootstrap_anchor,
    prepare_trainer_step,
    publish_trainer_step,
)

ROWS = [{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(8)]


def _admission(lookahead=1, per_step=2, steps=10, inflight=None, buffered=None) -> InOrderAdmission:
    return InOrderAdmission(lookahead, per_step, steps, inflight or (lookahead + 1) * per_step, buffered)


def _reserve(ledger: RolloutRecoveryLedger, targets: list[int], generations: int = 2) -> list[str]:
    ids = []
    for target in targets:
        position = len(ledger.groups) + ledger.trained_count
        gid = f"s{target}p{position}"
        ledger.reserve_group(gid, f"p{position}", position % len(ROWS), None, None, "turn", generations, target,
                             position=position)
        ids.append(gid)
    return ids


def _seal_group(ledger: RolloutRecoveryLedger, gid: str, data_plane: DataPlaneStore | None = None) -> None:
    group = ledger.groups[gid]
    for g in range(group.expected_generations):
        rid = group.rollout_id(g)
        ledger.mark_dispatched(rid, "nemo_gym/replica-0", weight_version=0)
        ledger.mark_sealed(rid, 1.0)
        if data_plane is not None:
            data_plane.put(RolloutSample(rollout_id=rid, group_id=gid, generation_index=g, reward=1.0))


# ----------------------------------------------------------------------------- admission
def test_lookahead_zero_admits_only_the_next_step():
    ledger, adm = RolloutRecoveryLedger(), _admission(lookahead=0)
    assert adm.reservations(ledger, 0, set()) == [1, 1]
    _reserve(ledger, [1, 1])
    assert adm.reservations(ledger, 0, set()) == []  # step 1 is whole; step 2 waits for step 1's weights
    assert adm.newest_target(0) == 1


def test_lookahead_one_admits_the_next_two_steps_in_order_and_gates_generation():
    ledger, adm = RolloutRecoveryLedger(), _admission(lookahead=1)
    assert adm.reservations(ledger, 0, set()) == [1, 1, 2, 2]
    ids = _reserve(ledger, [1, 1, 2, 2, 3])  # a group for step 3 (e.g. restored from a snapshot)
    assert [adm.may_generate(ledger.groups[g], 0) for g in ids] == [True, True, True, True, False]
    assert adm.may_generate(ledger.groups[ids[-1]], 1)  # step 1's weights served: step 3 may generate


def test_admission_stops_at_the_last_step():
    assert _admission(lookahead=2, steps=3).reservations(RolloutRecoveryLedger(), 2, set()) == [3, 3]


def test_max_inflight_prompts_bounds_the_groups_generating():
    ledger, adm = RolloutRecoveryLedger(), _admission(lookahead=1, inflight=3)
    assert adm.reservations(ledger, 0, set()) == [1, 1, 2]
    ids = _reserve(ledger, [1, 1, 2])
    _seal_group(ledger, ids[0])  # complete: no longer generating
    assert adm.reservations(ledger, 0, set()) == [2]


def test_max_buffered_rollouts_counts_sealed_rollouts_not_yet_taken_by_the_trainer():
    ledger, adm = RolloutRecoveryLedger(), _admission(lookahead=1, buffered=4)
    ids = _reserve(ledger, [1, 1])
    _seal_group(ledger, ids[0])
    _seal_group(ledger, ids[1])
    assert adm.reservations(ledger, 0, set()) == []  # 4 sealed, untrained: full
    assert adm.reservations(ledger, 0, set(ids)) == [2, 2]  # the trainer took them


# ----------------------------------------------------------------------------- coverage
class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_coverage_counts_in_flight_time_older_than_two_intervals_uncovered():
    clock = _Clock()
    cov = SnapshotCoverage(1.0, clock)  # window 2 s
    cov.in_flight(3)
    clock.t += 5.0  # 0..2 covered by the start, 2..5 not
    assert cov.share() == pytest.approx(1 - 3 / 5, abs=1e-4)
    cov.committed(clock.t, anchor_step=0)
    clock.t += 1.5  # within the window of the new cut
    cov.in_flight(0)
    clock.t += 10.0  # nothing in flight: covered whatever the age
    assert cov.share() == pytest.approx(1 - 3 / 16.5, abs=1e-4)
    cov.in_flight(1)
    cov.pruned(lambda step: step != 0)  # the anchor of the newest cut was pruned: nothing usable
    clock.t += 1.0
    assert cov.share() == pytest.approx(1 - 4 / 17.5, abs=1e-4)


def test_coverage_without_snapshots_is_only_the_idle_time():
    clock = _Clock()
    cov = SnapshotCoverage(None, clock)
    cov.in_flight(1)
    clock.t += 4.0
    cov.in_flight(0)
    clock.t += 4.0
    assert cov.share() == pytest.approx(0.5, abs=1e-4)


# ----------------------------------------------------------------------------- ledger views
def test_a_trainer_checkpoint_keeps_trained_positions_and_where_the_dataloader_resumes():
    ledger = RolloutRecoveryLedger()
    ids = _reserve(ledger, [1, 1, 2, 2])
    for gid in ids[:3]:
        _seal_group(ledger, gid)
    state, resume_at = ledger.checkpoint_state(ids[:2])
    assert state["groups"] == [] and state["trained_positions"] == [[0, 2]] and state["trained_count"] == 2
    assert resume_at == 2  # step 2's groups were in flight: a trainer-only restore reserves them again
    assert all(ledger.groups[g].status is PromptGroupStatus.COMPLETE for g in ids[:2])  # unchanged
    with pytest.raises(Exception, match=r"group s2p3 is generating, not complete"):
        ledger.checkpoint_state([ids[3]])
    assert ledger.groups[ids[0]].start_weight_version == 0


def test_adopting_a_newer_steps_trained_positions_drops_those_groups_whatever_their_state():
    ledger = RolloutRecoveryLedger()
    ids = _reserve(ledger, [1, 1, 2, 2])
    _seal_group(ledger, ids[0])
    dropped, rollout_ids = ledger.adopt_trained([(0, 2)])
    assert dropped == ids[:2] and len(rollout_ids) == 4
    assert sorted(ledger.groups) == ids[2:] and ledger.trained_positions == [(0, 2)]
    assert ledger.is_held_position(0) and ledger.is_held_position(3) and not ledger.is_held_position(4)


# ----------------------------------------------------------------------------- restore across anchors
def test_a_snapshot_under_an_older_anchor_restores_with_the_newer_step_minus_what_it_trained(tmp_path):
    """Snapshot under bootstrap (step 1 complete, step 2 generating), then step 1 published, no snapshot
    under it: restore at step 1 drops step 1's groups from the snapshot and keeps step 2's."""
    ckpt = tmp_path / "ckpt"
    ensure_bootstrap_anchor(ckpt)
    ledger, data_plane, dataloader = RolloutRecoveryLedger(), DataPlaneStore(), PromptDataloader(ROWS, seed=0)
    for _ in range(4):
        dataloader.next_index()
    ids = _reserve(ledger, [1, 1, 2, 2])
    for gid in ids[:3]:
        _seal_group(ledger, gid, data_plane)
    step = {"now": 1}  # the trainer took step 1's groups; step 1 is not durable yet
    inputs = SnapshotInputs(ledger, data_plane, dataloader, lambda: step["now"], lambda: 0,
                            lambda: anchor_dir(ckpt, 0))
    store = RunStore(ckpt, FileSystemWriter(), keep_latest_k=RolloutCheckpointConfig().keep_latest_k)
    snapshotter = RolloutSnapshotter(inputs, None, RunRecords(tmp_path / "logs"), RolloutCheckpointConfig(),
                                     LedgerChanges(), store)
    outcome = asyncio.run(snapshotter.attempt())
    assert outcome.committed and (outcome.step, outcome.anchor_step) == (1, 0)

    state, _ = ledger.checkpoint_state(ids[:2])
    tmp, final = prepare_trainer_step(ckpt, 1)
    (tmp / "weights.txt").write_text("w1")
    publish_trainer_step(tmp, final, metadata={"step": 1})
    bookkeeping = {"step": 1, "dataloader": dataloader.state_dict(), "ledger": state}

    async def load_trainer(anchor: Path) -> dict:
        assert anchor == final
        return bookkeeping

    restorer = RunRestorer(ckpt, read_snapshots=True, coordinator=None, max_attempts_per_sibling=3,
                           load_trainer=load_trainer, hooks=RunHooks(), store=store)
    restored = asyncio.run(restorer.restore())
    assert restored.step == 1 and restored.record["snapshot"] == outcome.path
    assert restored.record["snapshot_anchor_step"] == 0 and restored.record["snapshot_step"] == 1
    assert restored.record["dropped_trained_groups"] == 2
    assert sorted(restored.ledger.groups) == ids[2:]  # step 2's groups continue; step 1's are done
    assert restored.ledger.trained_positions == [(0, 2)]
    assert {s.group_id for s in restored.data_plane} == {ids[2]}  # step 1's samples dropped


def test_a_snapshot_newer_than_the_restored_step_is_refused(tmp_path):
    """An anchor_step above the trainer step restored (it cannot happen by itself): refused, naming the file."""
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import ControllerState

    state = ControllerState.model_validate({"step": 3, "anchor_step": 2, "ledger": {}, "dataloader": {},
                                            "data_plane": {"file": "x", "sha256": "0" * 64, "count": 0}})
    assert state.anchor == 2
    assert ControllerState.model_validate({**state.model_dump(), "anchor_step": None}).anchor == 3


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, message", [
    (["async_rl.sampler.name=windowed"], r"async_rl.sampler.name: sampler 'windowed' is not implemented here"),
    (["async_rl.min_groups_for_streaming_train=5"], r"async_rl.min_groups_for_streaming_train \(5\) exceeds "
                                                    r"grpo.num_prompts_per_step \(4\)"),
    (["async_rl.max_buffered_rollouts=31"], r"async_rl.max_buffered_rollouts \(31\) is below one step's rollouts"),
    (["async_rl.sampler.max_lookahead_versions=1"], r"set grpo.use_generation_logprobs=true"),
    (["async_rl.sampler.max_lookahead_versions=-1"], r"async_rl.sampler.max_lookahead_versions: Input should be "
                                                     r"greater than or equal to 0"),
    (["async_rl.max_inflight_prompts=0"], r"async_rl.max_inflight_prompts: Input should be greater than or equal"),
    (["++async_rl.sampler.max_staleness_versions=1"], r"async_rl.sampler.max_staleness_versions: unknown key"),
])
def test_async_rl_keys_are_validated_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_async_settings_upstreams_test_uses_load():
    config = load_config(None, ["async_rl.sampler.name=in_order", "async_rl.sampler.max_lookahead_versions=1",
                                "grpo.use_generation_logprobs=true", "async_rl.min_groups_for_streaming_train=2",
                                "async_rl.max_inflight_prompts=4", "async_rl.max_buffered_rollouts=32"])
    adm = InOrderAdmission.from_config(config)
    assert (adm.lookahead, adm.max_inflight_prompts, adm.max_buffered_rollouts) == (1, 4, 32)
    assert InOrderAdmission.from_config(load_config(None)).max_inflight_prompts == 4  # (0 + 1) x 4 prompts
