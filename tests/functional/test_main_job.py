"""The main job (embedded default config), shortened: the embedded Hugging Face model (built and cached
locally), generation worker, GRPO, Gym on loopback, turn recovery. Also: the cached second run, a
finished run, kill/resume without a warm start, another architecture from a directory, and a hub id
that cannot be fetched."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from tests.functional.rl_run import RunDirs, env_for, run_grpo, run_until_then_kill

pytestmark = pytest.mark.functional

SHORT = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.warm_start.steps=30",
         "rollout_checkpointing.snapshot_attempt_interval_s=1.0"]


def _cache(tmp_path) -> str:
    return f"policy.cache_dir={tmp_path / 'model_cache'}"


@pytest.mark.alone  # CPU-bound (training, decoding): shares no core under xdist
def test_main_job_two_steps_then_cached_then_complete(tmp_path):
    dirs = RunDirs(tmp_path)
    args = [*dirs.overrides(), *SHORT, _cache(tmp_path), "grpo.max_num_steps=2"]
    proc = run_grpo(args, env=env_for(), timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained a" in proc.stdout and "Warm start done" in proc.stdout
    metrics = dirs.records("metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["weight_version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["loss"] == m["loss"]  # finite, not NaN
        assert m["generation_s"] > 0 and m["training_s"] >= 0
    assert (dirs.logs / "reward_curve.png").stat().st_size > 1000
    assert "reward, last fifth of steps" in proc.stdout
    step2 = dirs.ckpt / "step_2"
    assert {"config.json", "model.safetensors", "tokenizer.json", "optimizer.pt", "trainer_state.json"} <= {
        p.name for p in step2.iterdir()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(step2)  # a plain Hugging Face checkpoint
    assert type(model).__name__ == "Qwen3ForCausalLM" and AutoTokenizer.from_pretrained(step2).chat_template

    # the same command again: the run is complete, nothing starts
    t0 = time.monotonic()
    again = run_grpo(args, env=env_for(), timeout_s=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "The run is complete" in again.stdout and "Gym ready" not in again.stdout
    assert time.monotonic() - t0 < 60

    # a new run (fresh checkpoint dir) reuses the cached tokenizer, init and warm start, and says so
    fresh = RunDirs(tmp_path / "second")
    proc = run_grpo([*fresh.overrides(), *SHORT, _cache(tmp_path), "grpo.max_num_steps=1"], env=env_for(), timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reusing the cached warm start" in proc.stdout
    assert "trained a" not in proc.stdout and "Warm start:" not in proc.stdout
    assert [m["step"] for m in fresh.records("metrics.jsonl")] == [1]


@pytest.mark.alone  # CPU-bound (training, decoding): shares no core under xdist
def test_main_job_resumes_from_newest_trainer_checkpoint_after_kill_without_warm_start(tmp_path, embedded_model_cache):
    import shutil

    # the first launch starts from a copy of the session's warm-started model (this test is about the relaunch)
    shutil.copytree(embedded_model_cache, tmp_path / "model_cache")
    dirs = RunDirs(tmp_path)
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": uuid.uuid4().hex})
    args = [*dirs.overrides(), *SHORT, _cache(tmp_path), "grpo.max_num_steps=3"]
    run_until_then_kill(args, env=env, until=lambda: (dirs.ckpt / "step_1" / "manifest.json").exists(), timeout_s=300)
    # the relaunch must not need the cached warm start: take it away
    shutil.rmtree(tmp_path / "model_cache")
    proc = run_grpo(args, env=env, timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resuming: the policy comes from trainer checkpoint" in proc.stdout
    assert "Warm start" not in proc.stdout and "trained a" not in proc.stdout
    restore = dirs.restore_json()
    assert restore["trainer_step"] >= 1
    state = json.loads((dirs.ckpt / "step_3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["weight_version"] == 3
    metrics = dirs.records("metrics.jsonl")
    assert metrics[-1]["step"] == 3 and {m["step"] for m in metrics} == {1, 2, 3}


@pytest.mark.alone  # CPU-bound (training, decoding): shares no core under xdist
def test_another_architecture_from_a_directory_trains_two_steps_with_turn_snapshots(tmp_path):
    from tests.model_fixtures import llama_dir

    model = llama_dir(tmp_path / "my-llama")
    dirs = RunDirs(tmp_path)
    args = [*dirs.overrides(), f"policy.model_name={model}", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=8", "grpo.max_num_steps=2",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.2"]
    proc = run_grpo(args, env=env_for(), timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warm start" not in proc.stdout
    metrics = dirs.records("metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and [m["weight_version"] for m in metrics] == [1, 2]
    assert any(s["committed"] for s in dirs.records("snapshots.jsonl"))
    cfg = json.loads((dirs.ckpt / "step_2" / "config.json").read_text())
    assert cfg["model_type"] == "llama"


def test_unfetchable_hub_id_fails_at_setup_naming_the_setting(tmp_path):
    dirs = RunDirs(tmp_path)
    env = env_for(extra={"HF_HOME": str(tmp_path / "hf")})
    t0 = time.monotonic()
    proc = run_grpo([*dirs.overrides(), "policy.model_name=nobody-xyz/no-such-model-123"], env=env, timeout_s=120)
    assert proc.returncode != 0
    assert "policy.model_name='nobody-xyz/no-such-model-123'" in proc.stderr
    assert "Gym ready" not in proc.stdout
    assert time.monotonic() - t0 < 60
