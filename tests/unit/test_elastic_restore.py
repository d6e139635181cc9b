"""Elastic restore (docs/design.md §5.7): the plan, the Gym read across replica directories, the
portability status, the ledger's re-pinning and the run identity without replica counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_patches.checkpoint import calls
from gym_patches.checkpoint import coordination as co
from gym_patches.checkpoint.storage import FileSystemWriter
from gym_patches.checkpoint.store import write_participant_state
from nemo_rl.algorithms.single_controller_utils.config import load_config
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.reshard import (
    GymShardRemoved,
    plan_restore,
    replica_counts,
    vanished,
)
from nemo_rl.algorithms.single_controller_utils.run_identity_check import check_run_identity, record_run_identity
from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointAdapter, GymCheckpointInstance
from nemo_rl.experience.rollout_recovery import RolloutAttemptStatus as S
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.run_identity import RunIdentityError, record_replicas, replica_changes
from tests.unit.test_coordination import TOKEN, dep, deadline, ep  # noqa: F401 - dep is a fixture
from tests.unit.test_rollout_recovery import _dispatch_all, _reserve, _triple

REPO = Path(__file__).resolve().parents[2]
R0, R1, R2 = "nemo_gym/replica-0", "nemo_gym/replica-1", "nemo_gym/replica-2"

PLAIN = FileSystemWriter()  # what a Gym server writes through when the writer is not under test


# -- the plan ---------------------------------------------------------------------------------
def _saved(*keys: str) -> dict[str, list[str]]:
    return {"policy": list(keys), "agent": list(keys), "tools": list(keys)}


def test_same_shape_installs_each_replica_its_own():
    exported = {R0: _saved("a", "b"), R1: _saved("c")}
    plan = plan_restore(exported, [R0, R1])
    assert plan.sources == {R0: {R0: _saved("a", "b")}, R1: {R1: _saved("c")}}
    assert plan.moved == {} and plan.not_portable == {}
    assert plan_restore(exported, [R0, R1, R2]).sources == plan.sources  # more replicas: nothing moves


def test_a_vanished_replicas_episodes_are_dealt_round_robin_over_the_survivors_in_order():
    exported = {R0: _saved("a"), R1: _saved("k2", "k1"), R2: _saved("k4", "k3-a1", "k0")}
    plan = plan_restore(exported, [R0])
    assert plan.sources[R0][R0] == _saved("a")
    assert plan.sources[R0][R1] == _saved("k1", "k2") and plan.sources[R0][R2] == _saved("k0", "k3-a1", "k4")
    assert plan.moved == {k: (R1, R0) for k in ("k1", "k2")} | {k: (R2, R0) for k in ("k0", "k3-a1", "k4")}
    # two survivors of three: replica-2's episodes alternate, in capture-key order
    plan = plan_restore({R2: _saved("k4", "k3", "k0")}, [R1, R0])
    assert plan.moved == {"k0": (R2, R0), "k3": (R2, R1), "k4": (R2, R0)}
    assert plan.sources == {R0: {R2: _saved("k0", "k4")}, R1: {R2: _saved("k3")}}
    assert plan.source_of(R1, "k3") == R2 and plan.source_of(R0, "zz") == R0
    assert plan_restore({R2: _saved("k4", "k3", "k0")}, [R0, R1]) == plan  # deterministic


def test_an_episode_moves_whole_and_a_survivor_reads_every_server_of_its_source():
    exported = {R1: {"policy": ["a", "b"], "agent": ["a", "b"], "tools": ["b"]}}
    plan = plan_restore(exported, [R0])
    assert plan.sources == {R0: {R1: {"policy": ["a", "b"], "agent": ["a", "b"], "tools": ["b"]}}}
    plan = plan_restore({R1: {"policy": ["a"], "agent": ["a"], "tools": []}}, [R0])
    assert plan.sources[R0][R1]["tools"] == []


def test_records_that_are_not_portable_stay_home_and_restart_from_the_prompt():
    exported = {R0: {"policy": ["a"], "agent": ["a"], "tools": ["a"]},
                R1: {"policy": ["b", "c"], "agent": ["b", "c"], "tools": ["c"]}}
    plan = plan_restore(exported, [R0], {"nemo_gym": {"tools"}})
    assert plan.moved == {"b": (R1, R0)}
    assert list(plan.not_portable) == ["c"] and "'tools'" in plan.not_portable["c"]
    assert R1 in plan.not_portable["c"] and "not portable" in plan.not_portable["c"]
    assert plan.sources[R0] == {R0: exported[R0], R1: {"policy": ["b"], "agent": ["b"], "tools": []}}


def test_a_removed_shard_is_refused_by_name():
    exported = {"saving/replica-0": _saved("a"), "mixed/replica-1": _saved("b")}
    with pytest.raises(GymShardRemoved) as info:
        plan_restore(exported, ["saving/replica-0"])
    text = str(info.value)
    assert "shard 'mixed' (saved on mixed/replica-1)" in text and "this run's shards are ['saving']" in text
    assert "nowhere to run" in text and "env.nemo_gym.shards" in text
    assert "rollout_checkpointing.restore_mode=trainer_checkpoint" in text
    assert vanished(exported, ["saving/replica-0"]) == []
    assert replica_counts(["saving/replica-1", "saving/replica-0", "mixed/replica-0"]) == {"saving": 2, "mixed": 1}


# -- Gym: reading another replica's records, the portability status ---------------------------
async def _committed(dep, parts, root: Path) -> tuple[Path, Path]:  # noqa: F811
    """Replica 0 commits r1 and r2 for real; replica 1's directory holds r3 under the same id."""
    for name in ("policy", "b_agent", "tools"):
        for key in ("r1", "r2"):
            dep.fakes[name].saved[key] = {"episode_id": ep(key).model_dump(), "by": name}
    own = GymCheckpointInstance("shard", 0).checkpoint_dir(root)
    other = GymCheckpointInstance("shard", 1).checkpoint_dir(root)
    assert (await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline()))).prepared
    await co.call(parts, calls.CommitCall(checkpoint_id="c1", deadline_ts=deadline(), checkpoint_dir=str(own),
                                          episode_ids=None))
    await co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline()))
    kinds = {"policy": "model", "a_agent": "agent", "b_agent": "agent", "tools": "resources"}
    for name, kind in kinds.items():
        records = [{"episode_id": ep("r3").model_dump(), "by": name}] if name != "a_agent" else []
        write_participant_state(other, kind, name, "c1", records, writer=PLAIN)
    return own, other


async def test_a_restore_reads_records_another_replica_saved(dep, tmp_path):  # noqa: F811
    parts = await co.discover(dep.client(), TOKEN)
    own, other = await _committed(dep, parts, tmp_path)
    scope = {n: [ep("r1"), ep("r3")] for n in ("policy", "b_agent", "tools")}
    replies = await co.call(parts, calls.RestoreCall(
        checkpoint_id="c2", deadline_ts=deadline(), checkpoint_dir=str(own), source_dirs=[str(other)],
        episode_ids=scope, source_checkpoint_id="c1"))
    assert replies["b_agent"].restored == ["r1-a1", "r3-a1"]
    assert sorted(r["episode_id"]["rollout_id"] for r in dep.fakes["tools"].installed) == ["r1", "r3"]
    await co.call(parts, calls.ResumeCall(checkpoint_id="c2", deadline_ts=deadline()))
    # without the other replica's directory, r3 is missing, named
    with pytest.raises(co.CoordinationFailures, match=r"has no records for \['r3'\]"):
        await co.call(parts, calls.RestoreCall(
            checkpoint_id="c3", deadline_ts=deadline(), checkpoint_dir=str(own), episode_ids=[ep("r3")],
            source_checkpoint_id="c1"))


async def test_a_record_in_two_replica_directories_is_refused(dep, tmp_path):  # noqa: F811
    parts = await co.discover(dep.client(), TOKEN)
    own, other = await _committed(dep, parts, tmp_path)
    third = GymCheckpointInstance("shard", 2).checkpoint_dir(tmp_path)
    for name, kind in {"policy": "model", "a_agent": "agent", "b_agent": "agent", "tools": "resources"}.items():
        write_participant_state(third, kind, name, "c1", [{"episode_id": ep("r1").model_dump()}], writer=PLAIN)
    with pytest.raises(co.CoordinationError, match=f"r1 has a record in {own} and in {third}.*holds it twice"):
        await co.call(parts, calls.RestoreCall(
            checkpoint_id="c2", deadline_ts=deadline(), checkpoint_dir=str(own), source_dirs=[str(other), str(third)],
            episode_ids={"policy": [ep("r1")]}, source_checkpoint_id="c1"))


async def test_a_server_whose_records_are_not_portable_says_so_in_its_status(dep):  # noqa: F811
    dep.fakes["tools"].records_portable = False
    adapter = GymCheckpointAdapter(GymCheckpointInstance("shard", 0), dep.client(), TOKEN)
    await adapter.discover(timeout_s=5)
    probes = await adapter.checkpoint(calls.ProbeCall(timeout_s=2.0))
    assert {name: p.records_portable for name, p in probes.items()} == {
        "policy": True, "a_agent": True, "b_agent": True, "tools": False}
    status = dep.planes["tools"].status()
    assert status["records_portable"] is False and dep.planes["policy"].status()["records_portable"] is True


# -- the ledger: a moved rollout is pinned to its new replica ---------------------------------
def test_a_relocated_restored_attempt_is_pinned_to_the_replica_that_installed_it():
    ledger = RolloutRecoveryLedger()
    _reserve(ledger, n=2)
    r0, r1 = _dispatch_all(ledger, instance=R1)
    triple = _triple(ledger, r0)
    assert triple[0] == R1
    summary = ledger.bring_back({triple}, {triple[1]: R0})
    assert summary.restored_turn == [f"{r0}-a1"] and len(summary.restarted_from_prompt) == 1
    attempt = ledger.groups["grp0"].siblings[0].current_attempt
    assert (attempt.status, attempt.gym_attempt, attempt.gym_instance_id) == (S.RESERVED, 1, R0)
    req = next(r for r in ledger.reserved_attempts() if r.rollout_id == f"{r0}-a1")
    assert req.gym_instance_id == R0
    ledger.mark_dispatched(req.rollout_id, R0)


# -- the run identity: replica counts are not identity; a removed or renamed shard is ------
TWO_SHARDS = "examples/configs/grpo_mixed_two_shards_turn.yaml"


def _config(tmp_path: Path, *overrides: str):
    return load_config(REPO / TWO_SHARDS, [f"checkpointing.checkpoint_dir={tmp_path}", *overrides])


def test_fewer_replicas_are_the_same_run_and_the_change_is_recorded(tmp_path):
    record_run_identity(_config(tmp_path))
    check_run_identity(_config(tmp_path, "env.nemo_gym.shards.0.replicas=1", "env.nemo_gym.shards.1.replicas=3"))
    assert replica_changes(tmp_path, {"saving": 1, "mixed": 3}) == {"saving": {"from": 2, "to": 1},
                                                                    "mixed": {"from": 2, "to": 3}}
    record_replicas(tmp_path, {"saving": 1, "mixed": 3})
    assert replica_changes(tmp_path, {"saving": 1, "mixed": 3}) == {}
    topology = json.loads((tmp_path / "run_identity.json").read_text())["gym_topology"]
    assert topology["saving"]["replicas"] == 1 and topology["mixed"]["agents"]


def test_a_renamed_or_removed_shard_is_refused_by_name(tmp_path):
    record_run_identity(_config(tmp_path))
    with pytest.raises(RunIdentityError) as info:
        check_run_identity(_config(tmp_path, "env.nemo_gym.shards.1.name=other"))
    text = str(info.value)
    assert "Gym shard 'mixed' was renamed to 'other'" in text and "name it 'mixed' again" in text
    assert "another Gym topology: shard 'other'" not in text  # the rename is named once, as a rename
    with pytest.raises(RunIdentityError) as info:
        check_run_identity(_config(tmp_path, "env.nemo_gym.shards=[{name: saving, replicas: 2, config_paths: "
                                             "[examples/gym_configs/saving_shard.yaml]}]"))
    text = str(info.value)
    assert "Gym shard 'mixed' (agents [" in text and "is gone from env.nemo_gym.shards" in text
    assert "nowhere to run" in text and "put it back under that name" in text
    # the explicit takeover still goes ahead, and the directory then records this run
    check_run_identity(_config(tmp_path, "env.nemo_gym.shards.1.name=other", "checkpointing.allow_different_run=true"))
    check_run_identity(_config(tmp_path, "env.nemo_gym.shards.1.name=other"))


def test_a_directory_with_trainer_steps_but_no_identity_takes_this_runs_through_the_run_store(tmp_path):
    """An older version's checkpoints (a trainer step, no run_identity.json): the run store says the
    directory holds steps, so this run's identity is recorded; an empty directory records nothing."""
    from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import RunStore, TrainerBookkeeping

    check_run_identity(_config(tmp_path))
    assert not (tmp_path / "run_identity.json").exists()  # nothing there yet: the run records it when it starts
    kept = TrainerBookkeeping(step=1, dataloader={}, ledger={})
    RunStore(tmp_path, PLAIN, keep_latest_k=1).save_step(1, kept, lambda d, extra, w: None)
    check_run_identity(_config(tmp_path))
    assert json.loads((tmp_path / "run_identity.json").read_text())["gym_topology"]["saving"]["replicas"] == 2
