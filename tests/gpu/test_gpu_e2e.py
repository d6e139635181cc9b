"""End to end on a GPU: the Workplace and the mixed simple_agent/restart-only setups,
real tiny policy with generation on CUDA, turn recovery, a SIGKILL and a restore."""

from __future__ import annotations

import uuid

import pytest

from tests.functional.rl_run import RunDirs, env_for, run_grpo, run_until_then_kill

pytestmark = [pytest.mark.gpu, pytest.mark.functional]

GPU = ["policy.device=cuda", "cluster.gpus_per_node=1", "grpo.max_num_steps=3",
       "rollout_checkpointing.snapshot_attempt_interval_s=0.5"]


def _check_run(dirs: RunDirs, steps: int) -> None:
    metrics = dirs.records("metrics.jsonl")  # a killed run may have logged a step it redid later
    assert {m["step"] for m in metrics} == set(range(1, steps + 1)) and metrics[-1]["step"] == steps
    assert all(m["weight_version"] == m["step"] for m in metrics)
    assert any(s["committed"] for s in dirs.records("snapshots.jsonl"))


def test_workplace_turn_on_gpu(tmp_path):
    dirs = RunDirs(tmp_path)
    proc = run_grpo(["--config", "examples/configs/grpo_workplace_turn.yaml", *dirs.overrides(), *GPU],
                    env=env_for(), timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(dirs, 3)


def test_mixed_best_effort_on_gpu_survives_sigkill(tmp_path):
    dirs = RunDirs(tmp_path)
    args = ["--config", "examples/configs/grpo_mixed_turn.yaml", *dirs.overrides(), *GPU,
            "rollout_recovery.allow_restart_only_gym_servers=true"]
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": uuid.uuid4().hex})
    run_until_then_kill(args, env=env, until=lambda: any(
        s["committed"] and s["step"] >= 1 for s in dirs.records("snapshots.jsonl")), timeout_s=900)
    proc = run_grpo(args, env=env, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(dirs, 3)
    restore = dirs.restore_json()
    assert restore["snapshot"] is not None
    assert restore["restored_turn"] + restore["restarted_from_prompt"] + restore["kept_siblings"] > 0
