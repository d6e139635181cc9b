"""Turn recovery across several Gym instances, end to end: real run_grpo processes, real Ray,
real Gym deployments (one per shard replica), SIGKILL and restore.

The two setups users run: one shard on two replicas where every server saves
(``grpo_workplace_two_replicas_turn.yaml``), and two shards of two replicas,
one all-saving (Workplace + a stateless verifier), one restart-only
(``grpo_mixed_two_shards_turn.yaml``). Generation is the scripted test backend
and the trainer records batches, so the checks are about recovery, not learning.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.functional.rl_run import (
    RunDirs,
    env_for,
    processes_with_marker,
    replies,
    run_grpo,
    run_until_then_kill,
    wait_for_no_processes,
)

pytestmark = pytest.mark.functional

TWO_REPLICAS = ["--config", "examples/configs/grpo_workplace_two_replicas_turn.yaml"]
TWO_SHARDS = ["--config", "examples/configs/grpo_mixed_two_shards_turn.yaml"]
SCRIPTED = ["policy.model_name=scripted-test-backend"]
BEST_EFFORT = ["rollout_recovery.allow_restart_only_gym_servers=true"]
MIXED_SHARD_REPLICAS = ("mixed/replica-0", "mixed/replica-1")


@pytest.fixture
def dirs(tmp_path) -> RunDirs:
    return RunDirs(tmp_path)


def _turn_level_by_instance(snapshot_path: str) -> dict[str, list[str]] | None:
    """``turn_level`` of a published snapshot's gym_checkpoint.json (None if it was pruned meanwhile)."""
    try:
        return json.loads((Path(snapshot_path) / "gym_checkpoint.json").read_text())["turn_level"]
    except (OSError, ValueError, KeyError):
        return None


def _final_lineage(dirs: RunDirs, steps: int) -> list[dict]:
    return json.loads((dirs.ckpt / f"step_{steps}" / "recording_trainer.json").read_text())["batches"]


def _check_exactly_once(batches: list[dict], steps: int, prompts: int, generations: int) -> set[str]:
    groups = [g for b in batches for g in b["groups"]]
    assert len(groups) == len(set(groups)) == steps * prompts, groups
    rollouts = [r for b in batches for r in b["rollout_ids"]]
    assert len(rollouts) == len(set(rollouts)) == steps * prompts * generations
    assert all(r == 1.0 for b in batches for r in b["rewards"].values())  # scripted: plays the demonstrations
    return set(rollouts)


def _kill_after_a_snapshot_saved_on(dirs: RunDirs, args: list[str], env: dict, instances: int, *,
                                     need_unsaved: bool = False) -> dict:
    """Run until a committed snapshot (step >= 1) holds turn-level saves on ``instances`` replicas; SIGKILL."""

    def snapshot_on_several_instances() -> bool:
        for s in dirs.records("snapshots.jsonl"):
            if not (s["committed"] and s["step"] >= 1 and s["saved"] > 0):
                continue
            if need_unsaved and s["unsaved"] == 0:
                continue
            turn = _turn_level_by_instance(s["path"])
            if turn is not None and sum(1 for keys in turn.values() if keys) >= instances:
                return True
        return False

    run_until_then_kill(args, env=env, until=snapshot_on_several_instances, timeout_s=240)
    committed = [s for s in dirs.records("snapshots.jsonl") if s["committed"]]
    return committed[-1]


def _check_restored_where_saved(dirs: RunDirs, batches: list[dict], trained: set[str]) -> dict:
    restore = dirs.restore_json()
    restored = restore["restored_instances"]
    assert restored and set(restored) == set(restore["restored_rollout_ids"])
    instances = {rid: iid for b in batches for rid, iid in b["gym_instances"].items()}
    continued = {rid: where for b in batches for rid, where in b["restored_from"].items()}
    for key, iid in restored.items():
        assert key.endswith("-a1") and key in trained
        assert instances[key] == iid, f"{key} was restored on {iid} but ran on {instances[key]}"
        assert continued.get(key) in ("B0", "P1", "P2"), f"{key} did not continue from a saved boundary"
    for key in restore["restarted_rollout_ids"]:
        assert key in trained and key not in continued  # from the prompt, not from a boundary
    assert set(restore["kept_rollout_ids"]) <= trained
    return restore


def test_two_replicas_snapshot_spans_both_and_restores_each_rollout_on_its_replica(dirs):
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = TWO_REPLICAS + SCRIPTED + replies(0.3) + dirs.overrides() + [
        "grpo.max_num_steps=3", "rollout_checkpointing.snapshot_attempt_interval_s=0.5",
    ]
    newest = _kill_after_a_snapshot_saved_on(dirs, args, env, instances=2)
    assert wait_for_no_processes(marker) == [], "processes of the killed run outlived it"
    assert all(s["reason"] in ("committed", "superseded") for s in dirs.records("snapshots.jsonl"))

    proc = run_grpo(args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert processes_with_marker(marker) == []
    snaps = dirs.records("snapshots.jsonl")
    assert all((s["committed"] and s["reason"] == "committed" and s["path"]) or s["reason"] == "superseded"
               for s in snaps), snaps

    restore = dirs.restore_json()
    assert restore["snapshot"] == newest["path"]
    batches = _final_lineage(dirs, 3)
    trained = _check_exactly_once(batches, steps=3, prompts=4, generations=4)
    restore = _check_restored_where_saved(dirs, batches, trained)
    assert set(restore["restored_instances"].values()) <= {"nemo_gym/replica-0", "nemo_gym/replica-1"}
    assert restore["restored_turn"] > 0
    assert {iid for b in batches for iid in b["gym_instances"].values()} == {
        "nemo_gym/replica-0", "nemo_gym/replica-1"}


def test_two_shards_two_replicas_best_effort_kill_and_restore(dirs):
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = TWO_SHARDS + SCRIPTED + replies(0.3) + BEST_EFFORT + dirs.overrides() + [
        "grpo.max_num_steps=3", "rollout_checkpointing.snapshot_attempt_interval_s=0.5",
    ]
    newest = _kill_after_a_snapshot_saved_on(dirs, args, env, instances=2, need_unsaved=True)
    assert wait_for_no_processes(marker) == [], "processes of the killed run outlived it"

    proc = run_grpo(args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert processes_with_marker(marker) == []
    warning = [line for line in proc.stderr.splitlines() if line.startswith("UserWarning")]
    assert warning and "(on mixed/replica-0, mixed/replica-1)" in warning[0], warning
    assert "'workplace_restart_only_agent'" in warning[0] and "'python_sandbox'" in warning[0]
    assert "arithmetic_verifier" not in warning[0] and "saving/" not in warning[0]

    restore = dirs.restore_json()
    assert restore["snapshot"] == newest["path"]
    batches = _final_lineage(dirs, 3)
    trained = _check_exactly_once(batches, steps=3, prompts=4, generations=4)
    restore = _check_restored_where_saved(dirs, batches, trained)
    # Only the all-saving shard saves turns; the restart-only shard's rollouts restart from the prompt.
    assert restore["restored_turn"] > 0
    assert set(restore["restored_instances"].values()) <= {"saving/replica-0", "saving/replica-1"}
    assert restore["restarted_from_prompt"] > 0
    ran_on = {iid for b in batches for iid in b["gym_instances"].values()}
    assert ran_on == {"saving/replica-0", "saving/replica-1", *MIXED_SHARD_REPLICAS}


def test_two_shards_setup_error_names_each_restart_only_server_with_its_replicas(dirs):
    proc = run_grpo(TWO_SHARDS + SCRIPTED + dirs.overrides(), env=env_for())
    assert proc.returncode == 1
    err = proc.stderr
    assert "agent 'workplace_restart_only_agent' (on mixed/replica-0, mixed/replica-1)" in err
    assert "resources server 'python_sandbox' (on mixed/replica-0, mixed/replica-1)" in err
    for saving in ("'workplace_simple_agent'", "'arithmetic_simple_agent'", "'arithmetic_verifier'",
                   "'workplace_assistant'", "saving/replica"):
        assert saving not in err
    # the third way out is the exact override
    assert ("'rollout_recovery.agent_target_level_overrides={sandbox_simple_agent: sibling, "
            "workplace_restart_only_agent: sibling}'") in err
    assert not dirs.records("metrics.jsonl")


def test_coarser_levels_for_the_restart_only_shard_pass_setup_with_the_setting_false(dirs):
    override = ("rollout_recovery.agent_target_level_overrides="
                "{sandbox_simple_agent: sibling, workplace_restart_only_agent: sibling}")
    proc = run_grpo(
        TWO_SHARDS + SCRIPTED + replies(0.25) + dirs.overrides() + [
            override, "grpo.max_num_steps=2", "rollout_checkpointing.snapshot_attempt_interval_s=0.4",
            "rollout_recovery.gym_prepare_timeout_s=5",
        ],
        env=env_for(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UserWarning" not in proc.stderr
    snaps = dirs.records("snapshots.jsonl")
    # Restart-only servers that carry only sibling-level rollouts prepare best_effort: no snapshot stalls.
    assert snaps and all(s["committed"] or s["reason"] == "superseded" for s in snaps), snaps
    assert any(s["saved"] > 0 for s in snaps)
    assert all(s["unsaved"] == 0 for s in snaps)  # sibling-level rollouts are not part of a turn snapshot
    assert [m["step"] for m in dirs.records("metrics.jsonl")] == [1, 2]
