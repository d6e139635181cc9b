"""The metric backends: config keys and their errors, upstream's series names, one row per step for
snapshots, and a backend that breaks mid-run (one warning; metrics.jsonl keeps every step)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import subprocess
import sys

import pytest

from nemo_rl.algorithms.single_controller_utils.config import ConfigError, load_config
from nemo_rl.algorithms.single_controller_utils.run_records import RunRecords
from nemo_rl.utils.loggers import LoggerStartError, MetricLoggers, open_loggers, tensorboard_dir
from nemo_rl.utils.loggers.names import SnapshotSeries, restore_metrics, step_metrics


def _need(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install '.[{package}]')")


def _logger_config(tmp_path, *overrides: str):
    return load_config(None, [f"logger.log_dir={tmp_path / 'logs'}", *overrides]).logger


# ----------------------------------------------------------------------------- config
def test_upstream_logger_keys_load_and_default_off():
    cfg = load_config(None, []).logger
    assert (cfg.tensorboard_enabled, cfg.wandb_enabled, cfg.mlflow_enabled) == (False, False, False)
    cfg = load_config(None, ["logger.tensorboard_enabled=true", "logger.tensorboard={}", "logger.wandb.project=p",
                             "logger.wandb.name=n", "logger.mlflow.experiment_name=e", "logger.mlflow.run_name=r",
                             "logger.mlflow.tracking_uri=sqlite:///x.db"]).logger
    assert cfg.tensorboard_enabled and cfg.tensorboard.log_dir == "tensorboard"
    assert (cfg.wandb.project, cfg.wandb.name) == ("p", "n")
    assert (cfg.mlflow.experiment_name, cfg.mlflow.run_name, cfg.mlflow.tracking_uri) == ("e", "r", "sqlite:///x.db")
    assert load_config(None, ["logger.tensorboard=null", "logger.wandb=null"]).logger.wandb.project == "nemo-rl"


@pytest.mark.parametrize("override, key", [
    ("++logger.wandb.entity=team", "logger.wandb.entity"),
    ("++logger.tensorboard.flush_secs=3", "logger.tensorboard.flush_secs"),
    ("logger.mlflow_enabled=maybe", "logger.mlflow_enabled"),
])
def test_a_bad_logger_key_is_named_by_its_dotted_path(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_the_tensorboard_dir_is_under_log_dir_unless_absolute(tmp_path):
    assert tensorboard_dir(_logger_config(tmp_path)) == tmp_path / "logs" / "tensorboard"
    assert tensorboard_dir(_logger_config(tmp_path, f"logger.tensorboard.log_dir={tmp_path / 'tb'}")) == tmp_path / "tb"


@pytest.mark.parametrize("flag, package", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")])
def test_an_enabled_backend_that_is_not_installed_names_its_key_and_extra(tmp_path, monkeypatch, flag, package):
    # What ``import`` sees when the package is absent; submodules already imported (by earlier tests)
    # would be found directly, so they go too, and torch's writer that imports it.
    for name in [m for m in sys.modules if m.startswith((f"{package}.", "torch.utils.tensorboard"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(LoggerStartError) as caught:
        open_loggers(_logger_config(tmp_path, f"logger.{flag}_enabled=true"))
    assert f"logger.{flag}_enabled=true but {package} is not installed: pip install '.[{package}]'" in str(caught.value)


def test_a_tracking_uri_mlflow_cannot_open_names_the_key_and_closes_what_had_started(tmp_path):
    _need("mlflow")
    _need("tensorboard")
    cfg = _logger_config(tmp_path, "logger.tensorboard_enabled=true", "logger.mlflow_enabled=true",
                         "logger.mlflow.tracking_uri=nosuchscheme://host/x")
    with pytest.raises(LoggerStartError, match=r"logger\.mlflow\.tracking_uri: MLflow cannot open tracking store "
                                               r"'nosuchscheme://host/x'"):
        open_loggers(cfg)
    events = list(tensorboard_dir(cfg).glob("events.out.tfevents.*"))
    assert len(events) == 1  # the TensorBoard writer that had started was closed (its file is complete)


# ----------------------------------------------------------------------------- names
def test_step_metrics_use_upstream_prefixes_and_keep_numbers_only():
    record = {"step": 3, "reward_mean": 0.5, "loss": 1.25, "weight_version": 3, "groups": ["g1"], "generation_s": 2.0,
              "val_reward_mean": 0.75, "val_samples": 4, "validation_s": 1.5, "note": "x", "lr": float("nan"),
              "val_x": None}
    assert step_metrics(record) == {
        "train/reward_mean": 0.5, "train/loss": 1.25, "train/weight_version": 3.0, "train/generation_s": 2.0,
        "validation/reward_mean": 0.75, "validation/samples": 4.0, "validation/seconds": 1.5,
    }


def _attempt(step, pause, persist=0.1, committed=True, reason="committed", saved=2):
    return {"step": step, "pause_s": pause, "persist_s": persist, "committed": committed, "reason": reason,
            "saved": saved, "unsaved": 0}


def test_snapshot_rows_fold_into_one_row_per_step_with_cumulative_outcomes():
    series = SnapshotSeries(earlier_rows=[_attempt(0, 0.1)])  # a resumed run counts on
    assert series.add(_attempt(1, 0.2)) == []
    assert series.add(_attempt(1, 0.5, committed=False, reason="gym_unavailable")) == []
    assert series.add(_attempt(1, 0.3, saved=7)) == []
    [(step, row)] = series.add(_attempt(2, 0.05, committed=False, reason="superseded"))
    assert step == 1
    assert row["timing/rollout_checkpoint/exclusive_hold_seconds"] == 0.3  # the step's last attempt
    assert row["timing/rollout_checkpoint/total_save_seconds"] == pytest.approx(0.4)
    assert row["timing/rollout_checkpoint/persist_seconds"] == 0.1
    assert row["timing/rollout_checkpoint/max_exclusive_hold_seconds"] == 0.5
    assert row["rollout/checkpoint/attempts"] == 3 and row["rollout/checkpoint/saved_rollouts"] == 7
    assert {k: v for k, v in row.items() if k.startswith("rollout/checkpoint_outcome/")} == {
        "rollout/checkpoint_outcome/completed": 3, "rollout/checkpoint_outcome/skipped": 0,
        "rollout/checkpoint_outcome/failed": 1, "rollout/checkpoint_outcome/reason_gym_unavailable": 1}
    [(step, row)] = series.flush()
    assert step == 2 and row["rollout/checkpoint_outcome/skipped"] == 1
    assert row["rollout/checkpoint_outcome/reason_superseded"] == 1 and row["rollout/checkpoint/attempts"] == 1
    assert series.flush() == []


def test_restore_metrics_name_the_recovery_counts_and_timing():
    record = {"trainer_step": 4, "snapshot": "/s", "skipped_snapshots": [{"path": "p", "reason": "r"}],
              "restored_turn": 3, "restarted_from_prompt": 1, "kept_siblings": 2, "restored_rollout_ids": ["a"]}
    assert restore_metrics(record, 1.5) == {
        "rollout/recovery/restored_turn": 3.0, "rollout/recovery/restarted_from_prompt": 1.0,
        "rollout/recovery/kept_siblings": 2.0, "rollout/recovery/from_snapshot": 1.0,
        "rollout/recovery/skipped_snapshots": 1.0, "timing/rollout_recovery/total_seconds": 1.5,
    }


# ----------------------------------------------------------------------------- through RunRecords
def _tb_series(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_run_records_write_the_files_then_the_backends_and_hand_over_the_last_snapshot_row_at_close(tmp_path):
    _need("tensorboard")
    cfg = _logger_config(tmp_path, "logger.tensorboard_enabled=true")
    with open_loggers(cfg) as loggers:
        records = RunRecords(cfg.log_dir, loggers=loggers)
        records.restore({"trainer_step": 0, "snapshot": None, "skipped_snapshots": [], "restored_turn": 0,
                         "restarted_from_prompt": 2, "kept_siblings": 0})
        for step in (1, 2):
            records.snapshot_attempt(checkpoint_id=f"c{step}", committed=True, reason="committed", saved=step,
                                     unsaved=0, pause_s=0.01, persist_s=0.02, step=step - 1)
            records.metrics({"step": step, "reward_mean": step / 10, "loss": 1.0 / step, "groups": ["g"]})
        assert "rollout/checkpoint/saved_rollouts" in _tb_series(tensorboard_dir(cfg))  # step 0's row: step 1 began
    series = _tb_series(tensorboard_dir(cfg))
    assert series["train/reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert series["rollout/checkpoint/saved_rollouts"] == [(0, 1.0), (1, 2.0)]  # step 1's row came at close
    assert series["rollout/checkpoint_outcome/completed"] == [(0, 1.0), (1, 2.0)]
    assert series["rollout/recovery/restarted_from_prompt"] == [(0, 2.0)]
    assert [r["step"] for r in records.read("metrics.jsonl")] == [1, 2]


# ----------------------------------------------------------------------------- a backend that breaks mid-run
def _warnings_about(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and f"logger.{name}:" in
            r.getMessage()]


def test_a_finished_wandb_run_mid_run_gives_one_warning_and_every_step_stays_in_metrics_jsonl(
        tmp_path, monkeypatch, caplog):
    _need("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _logger_config(tmp_path, "logger.wandb_enabled=true")
    with open_loggers(cfg) as loggers:
        records = RunRecords(cfg.log_dir, loggers=loggers)
        records.metrics({"step": 1, "reward_mean": 0.1})
        [backend] = loggers.backends
        backend.run.finish()  # the run ends under the logger: wandb refuses every later log
        with caplog.at_level(logging.WARNING):
            for step in range(2, 6):
                records.metrics({"step": step, "reward_mean": step / 10})
    assert [r["step"] for r in records.read("metrics.jsonl")] == [1, 2, 3, 4, 5]
    [message] = _warnings_about(caplog, "wandb")
    assert "writing step 2 failed" in message and "is finished" in message and "metrics.jsonl keeps every step" in message
    assert loggers.failed.keys() == {"wandb"}


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 64 KiB tmpfs on ``tmp_path/disk`` (root only; skipped elsewhere), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here: this test needs a real tmpfs to fill")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
    yield disk
    if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# The writer's own thread dies on the failed write (Python prints its traceback once); the row's flush
# then raises the same error here, which is what the fan-out warns about.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_on_a_disk_that_fills_mid_run_gives_one_warning_and_every_step_stays_in_metrics_jsonl(
        tmp_path, full_tmpfs, caplog):
    _need("tensorboard")
    cfg = _logger_config(tmp_path, "logger.tensorboard_enabled=true", f"logger.tensorboard.log_dir={full_tmpfs}")
    wide = {f"m{i:03d}": float(i) for i in range(100)}  # ~5 KiB of events per step: the disk's last page fills fast
    with open_loggers(cfg) as loggers:
        records = RunRecords(cfg.log_dir, loggers=loggers)
        records.metrics({"step": 1, **wide})
        with open(full_tmpfs / "filler", "ab", buffering=0) as f, contextlib.suppress(OSError):
            while f.write(b"\0" * 4096):
                pass
        with caplog.at_level(logging.WARNING):
            for step in range(2, 21):
                records.metrics({"step": step, **wide})
    assert [r["step"] for r in records.read("metrics.jsonl")] == list(range(1, 21))
    [message] = _warnings_about(caplog, "tensorboard")
    assert "No space left on device" in message and "gets no more metrics" in message
    assert loggers.failed.keys() == {"tensorboard"}
