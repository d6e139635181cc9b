"""The end-of-run summary counts distinct rollouts: a real run (scripted backend, real Ray and Gym,
restart-only servers accepted best effort) whose every committed snapshot is kept on disk, so the
test can take the union of what they saved (``gym_checkpoint.json``) and compare (docs/design.md §5.4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.functional.rl_run import RunDirs, env_for, replies, run_grpo

pytestmark = pytest.mark.functional


def _summary(stdout: str) -> dict[str, str]:
    rows = [line for line in stdout.splitlines() if line.startswith("| ")][1:]  # after the header
    return dict(tuple(c.strip() for c in line.strip().strip("|").split("|", 1)) for line in rows)


def test_summary_counts_each_saved_rollout_once_however_many_snapshots_held_it(tmp_path):
    dirs = RunDirs(tmp_path)
    proc = run_grpo(
        ["--config", "examples/configs/grpo_mixed_turn.yaml", "policy.model_name=scripted-test-backend"]
        + replies(0.25) + dirs.overrides()
        + ["rollout_recovery.allow_restart_only_gym_servers=true", "grpo.max_num_steps=2",
           "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
           "rollout_checkpointing.keep_latest_k=1000", "checkpointing.keep_top_k=null"],
        env=env_for(), timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _summary(proc.stdout)
    committed = [s for s in dirs.records("snapshots.jsonl") if s["committed"]]
    assert len(committed) >= 2, committed

    saved, unsaved = set(), set()  # what the committed snapshots hold, each rollout once
    for row in committed:
        index = json.loads((Path(row["path"]) / "gym_checkpoint.json").read_text())
        saved |= {k for keys in index["turn_level"].values() for k in keys}
        unsaved |= {k for keys in index["unsaved"].values() for k in keys}
    distinct = int(table["rollouts saved at turn level (distinct)"])
    distinct_unsaved = int(table["rollouts unsaved on restart-only servers (distinct)"])
    saves = int(table["rollout saves, all snapshots (one per rollout per snapshot)"])
    print(f"\n{len(committed)} snapshots: {saves} saves of {distinct} distinct rollouts; "
          f"{distinct_unsaved} distinct unsaved")
    assert distinct == len(saved) > 0
    assert saves == sum(s["saved"] for s in committed) >= distinct
    # the index also lists, as unsaved, runs a saving server had not started: at most that many
    assert 0 < distinct_unsaved <= len(unsaved)
    assert distinct + distinct_unsaved <= 2 * 4 * 4  # never more than the run's rollouts (2 steps x 4 x 4)


def test_rollouts_continued_after_a_kill_are_not_counted_again(tmp_path):
    """SIGKILL once a committed snapshot saved rollouts, then the same command to the end: the summary,
    over both starts' rows, counts each saved rollout once, though the relaunch saves the restored
    ones again under attempt 1 (``-a1``)."""
    import re
    import uuid

    from tests.functional.rl_run import run_until_then_kill, wait_for_no_processes

    dirs = RunDirs(tmp_path)
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = (["--config", "examples/configs/grpo_mixed_turn.yaml", "policy.model_name=scripted-test-backend"]
            + replies(0.3) + dirs.overrides()
            + ["rollout_recovery.allow_restart_only_gym_servers=true", "grpo.max_num_steps=2",
               "rollout_checkpointing.snapshot_attempt_interval_s=0.3",
               "rollout_checkpointing.keep_latest_k=1000", "checkpointing.keep_top_k=null"])
    run_until_then_kill(args, env=env, until=lambda: any(
        s["committed"] and s["saved"] > 0 for s in dirs.records("snapshots.jsonl")))
    assert wait_for_no_processes(marker) == []
    proc = run_grpo(args, env=env, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = dirs.restore_json()["restored_rollout_ids"]
    table = _summary(proc.stdout)

    rollouts = set()  # each saved rollout once, whichever attempt a snapshot saved it under
    for row in (s for s in dirs.records("snapshots.jsonl") if s["committed"]):
        index = json.loads((Path(row["path"]) / "gym_checkpoint.json").read_text())
        rollouts |= {re.sub(r"-a[1-9][0-9]*$", "", k) for keys in index["turn_level"].values() for k in keys}
    distinct = int(table["rollouts saved at turn level (distinct)"])
    print(f"\nrestored at their turn: {len(restored)}; distinct saved over both starts: {distinct}")
    assert restored and distinct == len(rollouts)
