"""The main job (embedded default config), shortened: real tiny policy, generation worker,
GRPO, Gym on loopback, turn recovery. CI runs a two-step version and a kill/resume."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.functional.rl_run import RunDirs, env_for, run_grpo, run_until_then_kill

pytestmark = pytest.mark.functional

SHORT = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.warm_start.steps=30",
         "rollout_checkpointing.snapshot_attempt_interval_s=1.0"]


def test_main_job_two_steps(tmp_path):
    dirs = RunDirs(tmp_path)
    proc = run_grpo([*dirs.overrides(), *SHORT, "grpo.max_num_steps=2"], env=env_for(), timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = dirs.records("metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["weight_version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["loss"] == m["loss"]  # finite, not NaN
        assert m["generation_s"] > 0 and m["training_s"] >= 0
    assert (dirs.logs / "reward_curve.png").stat().st_size > 1000
    assert "reward, last fifth of steps" in proc.stdout
    assert (dirs.ckpt / "step_2" / "policy.pt").exists()


def test_main_job_resumes_from_newest_trainer_checkpoint_after_kill(tmp_path):
    dirs = RunDirs(tmp_path)
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": uuid.uuid4().hex})
    args = [*dirs.overrides(), *SHORT, "grpo.max_num_steps=3"]
    run_until_then_kill(args, env=env, until=lambda: (dirs.ckpt / "step_1" / "manifest.json").exists(), timeout_s=300)
    proc = run_grpo(args, env=env, timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restore = dirs.restore_json()
    assert restore["trainer_step"] >= 1
    state = json.loads((dirs.ckpt / "step_3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["weight_version"] == 3
    metrics = dirs.records("metrics.jsonl")
    assert metrics[-1]["step"] == 3 and {m["step"] for m in metrics} == {1, 2, 3}
