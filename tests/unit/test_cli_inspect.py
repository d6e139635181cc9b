"""The inspector on directories made with the store's own writers: torn and temporary directories are
listed as such, the restart's choice skips them as the relaunch does, and nothing is written.
(The counts against a real relaunch: ``tests/functional/test_cli.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

from nemo_rl.algorithms.recording_trainer import STATE_FILE
from nemo_rl.cli.inspect import inspect, render
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from nemo_rl.utils.atomic_write import write_json_atomic
from nemo_rl.utils.snapshot_store import ensure_bootstrap_anchor, prepare_trainer_step, publish_trainer_step


def _step(root: Path, step: int) -> None:
    tmp, final = prepare_trainer_step(root, step)
    bookkeeping = {"step": step, "dataloader": {}, "ledger": RolloutRecoveryLedger().state_dict()}
    write_json_atomic(tmp / STATE_FILE, {"weight_version": step, "batches": [], "extra_state": bookkeeping})
    publish_trainer_step(tmp, final)


def _tree(root: Path) -> list[tuple[str, int]]:
    return sorted((str(Path(d, f).relative_to(root)), Path(d, f).stat().st_mtime_ns)
                  for d, _, files in os.walk(root) for f in files)


def test_torn_and_temporary_directories_are_listed_and_skipped(tmp_path):
    ensure_bootstrap_anchor(tmp_path)
    _step(tmp_path, 1)
    torn = tmp_path / "step_2"
    torn.mkdir()
    (torn / STATE_FILE).write_text("{}")  # no manifest: a crash before the seal
    (tmp_path / ".tmp-step_3").mkdir()
    before = _tree(tmp_path)

    report = inspect(str(tmp_path))

    assert _tree(tmp_path) == before  # nothing written, nothing removed
    by_name = {Path(a["path"]).name: a for a in report["anchors"]}
    assert set(by_name) == {"bootstrap", "step_1", "step_2", ".tmp-step_3"}
    assert by_name["step_1"]["valid"] and by_name["bootstrap"]["valid"]
    assert not by_name["step_2"]["valid"] and "manifest.json: missing" in by_name["step_2"]["reason"]
    assert by_name[".tmp-step_3"]["kind"] == "temporary"
    record = report["restore"]
    assert record["trainer_step"] == 1 and record["snapshot"] is None
    assert record["snapshot_reason"] == "no valid rollout snapshot"
    assert [s["path"] for s in record["skipped_trainer_steps"]] == [str(torn)]
    assert report["restore_anchor"] == str(tmp_path / "step_1")
    text = render(report)
    assert "step_1" in text and "<- a restart uses this step" in text and "INVALID" in text


def test_an_empty_directory_starts_a_new_run(tmp_path):
    report = inspect(str(tmp_path))
    assert report["restore"] is None and report["anchors"] == []
    assert "starts a new run" in render(report)
