"""RL-level recovery, end to end: real run_grpo processes, real Ray, real Gym servers.

Generation is the scripted test backend (plays each row's demonstration) and
the trainer records every batch it is given, so these tests isolate recovery
from learning.
"""

from __future__ import annotations

import re
import time
import uuid

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
from testkit.run_grpo import SKIP_RESTART_ONLY_ENV

pytestmark = pytest.mark.functional

MIXED = ["--config", "examples/configs/grpo_mixed_turn.yaml"]
WORKPLACE = ["--config", "examples/configs/grpo_workplace_turn.yaml"]
SCRIPTED = ["policy.model_name=scripted-test-backend"]


@pytest.fixture
def dirs(tmp_path) -> RunDirs:
    return RunDirs(tmp_path)


def test_mixed_config_as_shipped_fails_before_any_rollout(dirs):
    started = time.monotonic()
    proc = run_grpo(MIXED + dirs.overrides(), env=env_for())
    elapsed = time.monotonic() - started
    print(f"\nmixed config as shipped: launch to error in {elapsed:.1f}s")
    assert proc.returncode != 0
    err = proc.stderr
    assert "rollout_recovery.target_level=turn" in err
    assert "rollout_recovery.allow_restart_only_gym_servers=true" in err
    assert "agent 'workplace_restart_only_agent'" in err
    assert "resources server 'python_sandbox'" in err
    # the servers that can save are not named
    assert "'workplace_simple_agent'" not in err and "'sandbox_simple_agent'" not in err
    assert not dirs.records("metrics.jsonl") and not dirs.records("snapshots.jsonl")
    assert not dirs.ckpt.exists() or not any(dirs.ckpt.iterdir())


@pytest.mark.parametrize("level", ["sibling", "prompt_group"])
def test_setting_true_needs_a_turn_level_target(dirs, level):
    proc = run_grpo(
        MIXED + dirs.overrides()
        + [f"rollout_recovery.target_level={level}", "rollout_recovery.allow_restart_only_gym_servers=true"],
        env=env_for(),
    )
    assert proc.returncode == 2
    assert "rollout_recovery.allow_restart_only_gym_servers" in proc.stderr
    assert not dirs.logs.exists()


def test_workplace_with_setting_true_warns_it_should_be_false(dirs):
    proc = run_grpo(
        WORKPLACE + SCRIPTED + dirs.overrides()
        + ["rollout_recovery.allow_restart_only_gym_servers=true", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=2"],
        env=env_for(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UserWarning" in proc.stderr
    assert "every Gym agent and resources server that serves a turn-level rollout saves its rollouts; set it to false" in proc.stderr
    assert len(dirs.records("metrics.jsonl")) == 1


def test_best_effort_trains_and_commits_snapshots_with_unsaved_rollouts(dirs):
    proc = run_grpo(
        MIXED + SCRIPTED + replies(0.25) + dirs.overrides()
        + ["rollout_recovery.allow_restart_only_gym_servers=true", "grpo.max_num_steps=2",
           "rollout_checkpointing.snapshot_attempt_interval_s=0.4"],
        env=env_for(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = [line for line in proc.stderr.splitlines() if line.startswith("UserWarning")]
    assert warning and "'workplace_restart_only_agent'" in warning[0] and "'python_sandbox'" in warning[0]
    snaps = dirs.records("snapshots.jsonl")
    committed = [s for s in snaps if s["committed"]]
    assert committed, snaps
    assert any(s["unsaved"] > 0 for s in committed)
    assert any(s["saved"] > 0 for s in committed)
    # every attempt committed, or was dropped because training reached the next step meanwhile
    assert all(s["reason"] in ("committed", "superseded") for s in snaps)
    metrics = dirs.records("metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["reward_mean"] == 1.0 for m in metrics)  # the scripted backend plays the demonstrations


def test_sigkill_after_snapshot_then_rerun_restores(dirs):
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = MIXED + SCRIPTED + replies(0.3) + dirs.overrides() + [
        "rollout_recovery.allow_restart_only_gym_servers=true",
        "grpo.max_num_steps=3",
        "rollout_checkpointing.snapshot_attempt_interval_s=0.4",
    ]

    def snapshot_with_saved_and_unsaved_in_step_1() -> bool:
        return any(
            s["committed"] and s["saved"] > 0 and s["unsaved"] > 0 and s["step"] == 1
            for s in dirs.records("snapshots.jsonl")
        )

    run_until_then_kill(args, env=env, until=snapshot_with_saved_and_unsaved_in_step_1)
    assert wait_for_no_processes(marker) == [], "processes of the killed run outlived it"
    committed = [s for s in dirs.records("snapshots.jsonl") if s["committed"]]
    newest = committed[-1]

    proc = run_grpo(args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert processes_with_marker(marker) == []

    restore = dirs.restore_json()
    assert restore["trainer_step"] == newest["step"] == 1
    assert restore["snapshot"] == newest["path"]
    assert restore["restored_turn"] > 0
    assert restore["restarted_from_prompt"] > 0
    assert restore["restored_turn"] == len(restore["restored_rollout_ids"])
    assert all(k.endswith("-a1") for k in restore["restored_rollout_ids"])

    # The lineage the final trainer checkpoint holds: every group once, nothing lost or duplicated.
    import json

    final = json.loads((dirs.ckpt / "step_3" / "recording_trainer.json").read_text())
    groups = [g for b in final["batches"] for g in b["groups"]]
    assert len(groups) == len(set(groups)) == 3 * 4
    rollouts = [r for b in final["batches"] for r in b["rollout_ids"]]
    assert len(rollouts) == len(set(rollouts)) == 3 * 4 * 4
    trained = set(rollouts)
    # saved rollouts continued at attempt+1; unsaved ones restarted from the prompt; sealed siblings kept
    assert set(restore["restored_rollout_ids"]) <= trained
    assert set(restore["restarted_rollout_ids"]) <= trained
    assert set(restore["kept_rollout_ids"]) <= trained
    assert all(r == 1.0 for b in final["batches"] for r in b["rewards"].values())


def test_restore_mode_trainer_checkpoint_resumes_from_the_trainer_step_only(dirs):
    """rollout_checkpointing.restore_mode=trainer_checkpoint: a committed snapshot with turn-level
    rollouts is left unread; the run resumes from the trainer step and every rollout starts anew."""
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = WORKPLACE + SCRIPTED + replies(0.3) + dirs.overrides() + [
        "grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "rollout_checkpointing.snapshot_attempt_interval_s=0.4",
    ]

    def snapshot_with_saved_rollouts_in_step_1() -> bool:
        return any(s["committed"] and s["saved"] > 0 and s["step"] == 1 for s in dirs.records("snapshots.jsonl"))

    run_until_then_kill(args, env=env, until=snapshot_with_saved_rollouts_in_step_1)
    assert wait_for_no_processes(marker) == [], "processes of the killed run outlived it"
    newest = [s for s in dirs.records("snapshots.jsonl") if s["committed"]][-1]

    proc = run_grpo(args + ["rollout_checkpointing.restore_mode=trainer_checkpoint"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout_checkpointing.restore_mode=trainer_checkpoint" in proc.stdout

    restore = dirs.restore_json()
    assert restore["trainer_step"] == newest["step"] == 1
    assert restore["snapshot"] is None and restore["skipped_snapshots"] == []
    assert "restore_mode=trainer_checkpoint" in restore["snapshot_reason"]
    assert restore["restored_turn"] == 0 and "restored_rollout_ids" not in restore

    import json

    final = json.loads((dirs.ckpt / "step_2" / "recording_trainer.json").read_text())
    groups = [g for b in final["batches"] for g in b["groups"]]
    assert len(groups) == len(set(groups)) == 2 * 2
    rollouts = [r for b in final["batches"] for r in b["rollout_ids"]]
    assert len(rollouts) == len(set(rollouts)) == 2 * 2 * 4
    # Nothing continued from a Gym save (those come back as attempt -a1): step 2 started from its prompts.
    assert not any(r.endswith("-a1") for r in rollouts)
    assert all(r == 1.0 for b in final["batches"] for r in b["rewards"].values())


def test_stall_under_block_fails_after_max_consecutive_failures(dirs):
    proc = run_grpo(
        MIXED + SCRIPTED + replies(0.6) + dirs.overrides() + [
            # More steps than the failures need: the run must stop on them, not end first. A snapshot taken
            # while no restart-only rollout is in flight commits and starts the count again.
            "grpo.max_num_steps=20",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
            "rollout_checkpointing.max_consecutive_failures=3",
            "rollout_recovery.gym_prepare_timeout_s=0.5",
        ],
        env=env_for(extra={SKIP_RESTART_ONLY_ENV: "1"}),  # the test entry's hooks: log the refusal, go on
    )
    assert proc.returncode != 0
    assert f"TEST-ONLY: {SKIP_RESTART_ONLY_ENV}=1, running a setup the restart-only check refuses" in proc.stderr
    assert "3 consecutive rollout snapshots failed" in proc.stderr
    assert "workplace_restart_only_agent" in proc.stderr or "python_sandbox" in proc.stderr
    snaps = dirs.records("snapshots.jsonl")
    last = snaps[-3:]
    assert len(last) == 3 and not any(s["committed"] for s in last), snaps
    assert all(s["reason"] == "gym_unavailable" for s in last)
    # Each failed for the restart-only servers: they blocked its prepare, or (under load) the replica was still
    # not prepared at the deadline and left the snapshot; at least one names them as the blockers.
    restart_only = {"workplace_restart_only_agent", "python_sandbox"}
    assert all(set(s["blocking_servers"]) & restart_only or s.get("left_out") for s in last), last
    assert any(set(s["blocking_servers"]) & restart_only for s in last), last


def test_checkpointing_disabled_writes_no_checkpoint_and_metrics_go_where_asked(dirs):
    args = WORKPLACE + SCRIPTED + dirs.overrides() + [
        "checkpointing.enabled=false", "rollout_checkpointing.snapshot_attempt_interval_s=null",
        "grpo.max_num_steps=1", "grpo.num_prompts_per_step=2", "logger.metrics_file=steps.jsonl",
    ]
    for _ in range(2):  # a second start is a new run, not a resume
        proc = run_grpo(args, env=env_for())
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert not dirs.ckpt.exists() or not any(dirs.ckpt.rglob("manifest.json"))
    assert not (dirs.logs / "restore.json").exists()
    assert [m["step"] for m in dirs.records("steps.jsonl")] == [1, 1]
    assert not (dirs.logs / "metrics.jsonl").exists()


def test_validation_reward_at_start_and_every_val_period_steps(dirs):
    proc = run_grpo(
        MIXED + SCRIPTED + dirs.overrides() + [
            "rollout_recovery.allow_restart_only_gym_servers=true", "grpo.max_num_steps=3", "grpo.val_period=2",
            "grpo.val_at_start=true", "grpo.max_val_samples=5",
        ],
        env=env_for(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = dirs.records("metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    validated = {m["step"]: m for m in metrics if "val_reward_mean" in m}
    assert sorted(validated) == [0, 2]  # at start, then every 2 steps
    assert all(m["val_samples"] == 5 and m["val_reward_mean"] == 1.0 for m in validated.values())
    assert "reward_mean" not in validated[0]  # the start record is validation only
    assert re.search(r"\| validation reward, first -> last +\| 1\.000 \(step 0\) -> 1\.000 \(step 2\) \|",
                     proc.stdout), proc.stdout[-2000:]
    assert (dirs.logs / "reward_curve.png").stat().st_size > 1000


def test_validation_without_val_data_is_a_config_error(dirs):
    proc = run_grpo(WORKPLACE + SCRIPTED + dirs.overrides() + ["data.val_data_path=null", "grpo.val_period=1"],
                    env=env_for())
    assert proc.returncode == 2
    assert "grpo.val_period / grpo.val_at_start ask for validation but data.val_data_path is not set" in proc.stderr


def _sealed_siblings_in_flight(snapshot_path: str) -> int:
    """Sealed siblings of still-generating groups in a published snapshot (0 if it was pruned)."""
    import json
    from pathlib import Path

    try:
        state = json.loads((Path(snapshot_path) / "controller_state.json").read_text())
    except (OSError, ValueError):
        return 0
    return sum(
        1 for g in state["ledger"]["groups"] if g["status"] == "generating"
        for s in g["siblings"] if s["attempts"][-1]["status"] == "sealed"
    )


def test_sibling_level_snapshots_keep_sealed_siblings_after_a_kill(dirs):
    marker = uuid.uuid4().hex
    # replies wait 0.2-1.0 s, so siblings of one group finish at different times
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = MIXED + SCRIPTED + replies(0.2, jitter_s=0.8) + dirs.overrides() + [
        "rollout_recovery.target_level=sibling", "grpo.max_num_steps=6",
        "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
    ]

    def newest_snapshot_holds_sealed_siblings() -> bool:
        committed = [s for s in dirs.records("snapshots.jsonl") if s["committed"]]
        return bool(committed) and committed[-1]["step"] >= 1 and _sealed_siblings_in_flight(committed[-1]["path"]) > 0

    run_until_then_kill(args, env=env, until=newest_snapshot_holds_sealed_siblings)
    assert wait_for_no_processes(marker) == []
    snaps = dirs.records("snapshots.jsonl")
    assert all(s["commit_mode"] == "ledger_only" and s["saved"] == 0 for s in snaps)  # Gym was never asked
    newest = [s for s in snaps if s["committed"]][-1]
    sealed_in_flight = _sealed_siblings_in_flight(newest["path"])  # before the rerun prunes it
    assert sealed_in_flight > 0

    proc = run_grpo(args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restore = dirs.restore_json()
    assert restore["snapshot"] == newest["path"]
    assert restore["kept_siblings"] >= sealed_in_flight
    assert restore["restored_turn"] == 0
    import json

    batches = json.loads((dirs.ckpt / "step_6" / "recording_trainer.json").read_text())["batches"]
    groups = [g for b in batches for g in b["groups"]]
    assert len(groups) == len(set(groups)) == 6 * 4
    trained = {r for b in batches for r in b["rollout_ids"]}
    assert len(trained) == 6 * 4 * 4
    assert set(restore["kept_rollout_ids"]) <= trained and set(restore["restarted_rollout_ids"]) <= trained


def test_a_checkpoint_dir_of_another_run_is_refused_naming_what_differs(dirs):
    base = WORKPLACE + SCRIPTED + dirs.overrides() + ["grpo.num_prompts_per_step=2"]
    proc = run_grpo(base + ["grpo.max_num_steps=1"], env=env_for())
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = time.monotonic()
    proc = run_grpo(base + [
        "grpo.max_num_steps=2", "grpo.num_generations_per_prompt=2", "data.train_data_path=examples/data/mixed_train.jsonl",
        "env.nemo_gym.shards=[{name: renamed, replicas: 2}]",
    ], env=env_for())
    assert proc.returncode == 1 and time.monotonic() - started < 30
    err = proc.stderr
    assert "holds checkpoints of a different run" in err
    for what in ("other training data", "another group size (grpo.num_generations_per_prompt 4, this run's 2)",
                 "Gym shard 'nemo_gym' was renamed to 'renamed'", "checkpointing.allow_different_run=true"):
        assert what in err, err[-2000:]
    assert "another model" not in err
    assert "Gym ready" not in proc.stdout  # refused before Ray or any Gym server started
    assert [m["step"] for m in dirs.records("metrics.jsonl")] == [1]
    # Another replica count is the same run (elastic restore, design §5.7): it goes ahead without a flag.
    proc = run_grpo(base + ["grpo.max_num_steps=2", "env.nemo_gym.shards=[{name: nemo_gym, replicas: 2}]"],
                    env=env_for())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming anyway" not in proc.stderr
    assert [m["step"] for m in dirs.records("metrics.jsonl")] == [1, 2]


def test_a_shard_asking_for_ray_resources_no_node_offers_fails_at_once(dirs):
    started = time.monotonic()
    proc = run_grpo(WORKPLACE + SCRIPTED + dirs.overrides() + [
        "env.nemo_gym.shards=[{name: nemo_gym, replicas: 2, ray_resources: {gym_slot: 1}}]"], env=env_for())
    assert proc.returncode == 1
    assert "Gym shards nemo_gym (2 x 1) ask for 2 of Ray resource 'gym_slot', but the cluster offers 0" in proc.stderr
    assert time.monotonic() - started < 60  # not the spin-up timeout
