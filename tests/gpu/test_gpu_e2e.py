"""End to end on one GPU with the vLLM backend (``policy.generation.backend=vllm``).

* The Workplace setup on two replicas (every Gym server saves).
* The mixed simple_agent / restart-only setup with
  ``rollout_recovery.allow_restart_only_gym_servers=true``.

Each runs the real tiny policy (trainer on CUDA, generation in vLLM on the
same GPU), is SIGKILLed after a committed snapshot that holds turn-level
rollouts, is restored, and finishes; each must take under 8 minutes, and every
step's ``gen_logprob_abs_err`` (vLLM's logprobs against the trainer's) is
reported and bounded. Run them with ``tests/gpu/run.sh`` on a GPU box; without
CUDA (or without vLLM) they are collected and skipped with the reason.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.functional.rl_run import RunDirs, env_for, run_grpo, run_until_then_kill, wait_for_no_processes


def _why_skip() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA GPU (marker 'gpu'); on a GPU box run tests/gpu/run.sh"
    except Exception as e:  # noqa: BLE001
        return f"needs a CUDA GPU (torch: {e})"
    from nemo_rl.models.generation.vllm_worker import vllm_available

    why = vllm_available()
    return None if why is None else f"{why} (the GPU tests need the '[vllm]' extra; tests/gpu/run.sh installs it)"


WHY_SKIP = _why_skip()
pytestmark = [pytest.mark.gpu, pytest.mark.functional, pytest.mark.skipif(WHY_SKIP is not None, reason=str(WHY_SKIP))]

BUDGET_S = 8 * 60
# float32 on the GPU, but vLLM's and the trainer's CUDA kernels differ (TF32 matmuls, fused attention).
GPU_LOGPROB_TOLERANCE = 1e-2
GPU = ["policy.device=cuda", "cluster.gpus_per_node=1", "policy.generation.backend=vllm",
       "policy.generation.vllm_cfg.gpu_memory_utilization=0.3", "policy.warm_start.steps=200",
       "grpo.max_num_steps=3", "rollout_checkpointing.snapshot_attempt_interval_s=0.5"]


def _check_run(dirs: RunDirs, steps: int, report: list[str]) -> None:
    metrics = dirs.records("metrics.jsonl")  # a killed run may have logged a step it redid later
    assert {m["step"] for m in metrics} == set(range(1, steps + 1)) and metrics[-1]["step"] == steps
    assert all(m["weight_version"] == m["step"] for m in metrics)
    assert any(s["committed"] for s in dirs.records("snapshots.jsonl"))
    for m in metrics:
        report.append(f"step {m['step']}: gen_logprob_abs_err {m['gen_logprob_abs_err']:.2e}")
        assert m["gen_logprob_tokens"] > 0 and m["gen_logprob_abs_err"] < GPU_LOGPROB_TOLERANCE, m
    restore = dirs.restore_json()
    assert restore["snapshot"] is not None
    assert restore["restored_turn"] + restore["restarted_from_prompt"] + restore["kept_siblings"] > 0


def _kill_restore_finish(tmp_path, config: str, extra: list[str]) -> None:
    t0 = time.monotonic()
    dirs = RunDirs(tmp_path)
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = ["--config", config, *dirs.overrides(), f"policy.cache_dir={tmp_path / 'model_cache'}", *GPU, *extra]
    run_until_then_kill(args, env=env, until=lambda: any(
        s["committed"] and s["saved"] > 0 for s in dirs.records("snapshots.jsonl")), timeout_s=BUDGET_S)
    assert wait_for_no_processes(marker) == [], "processes of the killed run (vLLM included) outlived it"
    proc = run_grpo(args, env=env, timeout_s=max(BUDGET_S - (time.monotonic() - t0), 30))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: list[str] = []
    _check_run(dirs, 3, report)
    elapsed = time.monotonic() - t0
    print(f"\n{config}: {elapsed:.0f} s; " + "; ".join(report))
    assert elapsed < BUDGET_S


def test_workplace_two_replicas_vllm_kill_and_restore(tmp_path):
    _kill_restore_finish(tmp_path, "examples/configs/grpo_workplace_two_replicas_turn.yaml", [])


def test_mixed_restart_only_allowed_vllm_kill_and_restore(tmp_path):
    _kill_restore_finish(tmp_path, "examples/configs/grpo_mixed_turn.yaml",
                         ["rollout_recovery.allow_restart_only_gym_servers=true"])
