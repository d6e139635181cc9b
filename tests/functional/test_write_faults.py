"""A snapshot whose files cannot be written (injected ENOSPC / EIO) fails alone.

Real run_grpo processes whose config names a storage writer
(``checkpointing.storage_writer``: ``testkit/write_faults.py``'s ``FailingWriter``)
that makes one write fail the way a full or broken disk does: in the
controller's own files (the driver installs it), or in a Gym server's records
(staged persist, after resume; each Gym server installs it from its config).
The attempt is recorded as ``io_error`` with the file named, rollouts resume,
the run finishes, and the snapshots committed before it stay valid and
restorable.
"""

from __future__ import annotations

import pytest

from nemo_rl.utils.snapshot_store import verify_directory
from testkit.write_faults import write_fault_overrides
from tests.functional.rl_run import RunDirs, env_for, replies, run_grpo

pytestmark = pytest.mark.functional

ARGS = ["--config", "examples/configs/grpo_workplace_turn.yaml", "policy.model_name=scripted-test-backend",
        "grpo.max_num_steps=2", "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
        "rollout_checkpointing.keep_latest_k=10", "rollout_checkpointing.max_consecutive_failures=2"]


@pytest.mark.parametrize("spec, where, errno_text", [
    ("ENOSPC:controller_state.json:2", "controller_state.json", "No space left on device"),
    ("EIO:records.jsonl:2", "gym/agent/workplace_simple_agent", "Input/output error"),
])
def test_a_failed_write_fails_that_snapshot_only_naming_the_file(tmp_path, spec, where, errno_text):
    dirs = RunDirs(tmp_path)
    proc = run_grpo(ARGS + replies(0.3) + dirs.overrides() + write_fault_overrides(spec), env=env_for())
    assert proc.returncode == 0, proc.stderr[-3000:]
    snaps = dirs.records("snapshots.jsonl")
    failed = [s for s in snaps if not s["committed"] and s["reason"] != "superseded"]  # superseded: not a failure
    assert len(failed) == 1, snaps  # only the write that was made to fail
    assert failed[0]["reason"] == "io_error"
    assert where in failed[0]["error"] and errno_text in failed[0]["error"], failed[0]["error"]
    assert snaps.index(failed[0]) >= 1  # an earlier snapshot committed before it ...
    for s in snaps:
        if s["committed"] and s["path"]:
            from pathlib import Path

            if Path(s["path"]).exists():  # ... and every snapshot still on disk verifies
                verify_directory(s["path"], "rollout_snapshot")
    assert any(s["committed"] for s in snaps[snaps.index(failed[0]) + 1:])  # snapshots go on after it
    assert [m["step"] for m in dirs.records("metrics.jsonl")] == [1, 2]  # and so does training


def test_a_malformed_fault_spec_is_refused_at_start(tmp_path):
    dirs = RunDirs(tmp_path)
    proc = run_grpo(ARGS + dirs.overrides() + write_fault_overrides("ENOSPACE:x"), env=env_for())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "checkpointing.storage_writer" in proc.stderr and "fault='ENOSPACE:x'" in proc.stderr, proc.stderr
