"""The metric backends read back with each one's own reader, from real run_grpo processes.

One run directory, two launches (scripted backend, turn recovery, snapshots every 0.3 s): the first
trains step 1 and stops, the second resumes from the step-1 trainer checkpoint and trains step 2 with
validation. Every installed backend is enabled in both (W&B offline). Each test then checks one
backend against the run's own files: the reward and the loss at steps 1 and 2, validation at step 2,
one snapshot row per step that had attempts (the last attempt's timings, cumulative outcome counts),
and the resumed launch's recovery counts at step 1.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.functional.rl_run import RunDirs, env_for, replies, run_grpo

pytestmark = pytest.mark.functional

BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # config name -> package
ARGS = ["--config", "examples/configs/grpo_workplace_turn.yaml", "policy.model_name=scripted-test-backend",
        "rollout_checkpointing.snapshot_attempt_interval_s=0.3", "rollout_checkpointing.keep_latest_k=10",
        "grpo.val_period=2", "grpo.max_val_samples=4", "logger.plot=false"]
TRAIN = ("train/reward_mean", "train/loss", "train/weight_version", "train/generation_s")
SNAPSHOT = ("timing/rollout_checkpoint/total_save_seconds", "timing/rollout_checkpoint/exclusive_hold_seconds",
            "rollout/checkpoint_outcome/completed", "rollout/checkpoint/saved_rollouts")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _need(package: str) -> None:
    if not _installed(package):
        pytest.skip(f"{package} is not installed (pip install '.[{package}]')")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    enabled = [name for name, package in BACKENDS.items() if _installed(package)]
    if not enabled:
        pytest.skip("none of tensorboard, wandb, mlflow is installed (pip install '.[tensorboard,wandb,mlflow]')")
    dirs = RunDirs(tmp_path_factory.mktemp("loggers"))
    flags = [f"logger.{name}_enabled=true" for name in enabled]
    env = env_for(extra={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    for steps in (1, 2):
        proc = run_grpo([*ARGS, *replies(0.3), *dirs.overrides(), *flags, f"grpo.max_num_steps={steps}"], env=env,
                        timeout_s=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "nemo_rl.utils.loggers" not in proc.stderr, proc.stderr[-3000:]  # no backend warned
    return dirs


def _expected_snapshot_rows(dirs: RunDirs) -> dict[int, dict[str, float]]:
    """Per step of snapshots.jsonl: its last attempt's values and the committed count so far."""
    out: dict[int, dict[str, float]] = {}
    committed = 0
    for row in dirs.records("snapshots.jsonl"):
        committed += bool(row["committed"])
        out[row["step"]] = {
            "timing/rollout_checkpoint/exclusive_hold_seconds": row["pause_s"],
            "timing/rollout_checkpoint/total_save_seconds": row["pause_s"] + row["persist_s"],
            "rollout/checkpoint_outcome/completed": committed,
            "rollout/checkpoint/saved_rollouts": row["saved"],
        }
    return out


def _check(series: dict[str, dict[int, float]], dirs: RunDirs) -> None:
    """``series``: name -> {step: value} as the backend's reader returned it (one value per step)."""
    metrics = {m["step"]: m for m in dirs.records("metrics.jsonl")}
    assert sorted(metrics) == [1, 2]
    for name in TRAIN:
        key = name.removeprefix("train/")
        assert series[name] == pytest.approx({s: float(metrics[s][key]) for s in (1, 2)}), name
    assert series["validation/reward_mean"] == pytest.approx({2: metrics[2]["val_reward_mean"]})
    expected = _expected_snapshot_rows(dirs)
    assert expected and 1 in expected, "the resumed launch took no snapshot of step 1"
    for name in SNAPSHOT:
        assert series[name] == pytest.approx({s: row[name] for s, row in expected.items()}, abs=1e-3), name
    restore = dirs.restore_json()
    assert restore["trainer_step"] == 1
    for key in ("restored_turn", "restarted_from_prompt", "kept_siblings"):
        assert series[f"rollout/recovery/{key}"] == {1: restore[key]}, key
    assert set(series["timing/rollout_recovery/total_seconds"]) == {1}


def test_tensorboard_event_files_hold_the_series_at_the_trainer_steps(run):
    _need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = run.logs / "tensorboard"
    assert len(list(logs.glob("events.out.tfevents.*"))) == 2  # one per launch, read as one run
    acc = EventAccumulator(str(logs), size_guidance={"scalars": 0})
    acc.Reload()
    series: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), f"{tag}: more than one value at a step"
        series[tag] = {e.step: e.value for e in events}
    _check(series, run)


def test_wandb_offline_runs_hold_the_series_on_the_nemo_rl_step_axis(run):
    _need("wandb")
    run_dirs = sorted((run.logs / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2  # one W&B run per launch
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for run_dir in run_dirs:
        # wandb's own reader of the .wandb transaction log; one JSON record per line
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        defined = [r["metric"] for r in records if r["type"] == "metric"]
        assert {"glob_name": "*", "options": {"defined": True, "step_sync": True},
                "step_metric": "nemo_rl/step"} in defined
        for rec in records:
            if rec["type"] == "history":
                item = rec["history"]["item"]
                step = int(item["nemo_rl/step"])
                for key, value in item.items():
                    if not key.startswith("_") and key != "nemo_rl/step":
                        assert step not in series[key], f"{key}: more than one value at step {step}"
                        series[key][step] = value
    _check(dict(series), run)


def test_mlflow_local_store_holds_the_series_at_the_trainer_steps(run):
    _need("mlflow")
    from mlflow.tracking import MlflowClient

    from nemo_rl.utils.loggers.mlflow_logger import default_tracking_uri

    client = MlflowClient(tracking_uri=default_tracking_uri(run.logs))
    experiment = client.get_experiment_by_name("nemo-rl")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}  # one per launch, both closed
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for mlrun in runs:
        for key in mlrun.data.metrics:
            for metric in client.get_metric_history(mlrun.info.run_id, key):
                assert metric.step not in series[key], f"{key}: more than one value at step {metric.step}"
                series[key][metric.step] = metric.value
    _check(dict(series), run)



def test_a_backend_that_cannot_start_stops_the_launch_before_ray_naming_its_key(tmp_path):
    _need("mlflow")
    dirs = RunDirs(tmp_path)
    t0 = time.monotonic()
    proc = run_grpo([*ARGS, *dirs.overrides(), "grpo.max_num_steps=1", "logger.mlflow_enabled=true",
                     "logger.mlflow.tracking_uri=nosuchscheme://host/x"], env=env_for(), timeout_s=120)
    assert proc.returncode == 1
    assert "error: logger.mlflow.tracking_uri: MLflow cannot open tracking store 'nosuchscheme://host/x'" in proc.stderr
    assert "Gym ready" not in proc.stdout and not dirs.records("metrics.jsonl")
    assert time.monotonic() - t0 < 60


@pytest.mark.alone  # CPU-bound (training, decoding): shares no core under xdist
def test_the_main_job_with_its_embedded_config_logs_the_real_trainers_series_to_tensorboard(tmp_path,
                                                                                             embedded_model_cache):
    """The embedded default (tiny Hugging Face policy, generation worker, GRPO trainer) shortened like
    tests/functional/test_main_job.py, on the session's warm-started model."""
    _need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dirs = RunDirs(tmp_path)
    proc = run_grpo([*dirs.overrides(), "grpo.max_num_steps=2", "grpo.num_prompts_per_step=2",
                     "grpo.num_generations_per_prompt=4", "policy.warm_start.steps=30",
                     f"policy.cache_dir={embedded_model_cache}", "rollout_checkpointing.snapshot_attempt_interval_s=0.2",
                     "logger.plot=false", "logger.tensorboard_enabled=true"], env=env_for(), timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = EventAccumulator(str(dirs.logs / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    metrics = {m["step"]: m for m in dirs.records("metrics.jsonl")}
    for key in ("reward_mean", "loss", "grad_norm", "lr", "num_gen_tokens"):  # the GRPO trainer's own metrics too
        got = {e.step: e.value for e in acc.Scalars(f"train/{key}")}
        assert got == pytest.approx({s: metrics[s][key] for s in (1, 2)}, rel=1e-5), key
    steps = {row["step"] for row in dirs.records("snapshots.jsonl")}
    if steps:  # the generation of two short steps may end before the first 0.2 s attempt
        assert {e.step for e in acc.Scalars("timing/rollout_checkpoint/exclusive_hold_seconds")} == steps
