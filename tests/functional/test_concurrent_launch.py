"""One writer per run directory, on real ``run_grpo.py`` launches (scripted backend).

The same command started twice at once on the same directories: one run
trains, the other exits within seconds, before Ray starts, with one ``error:``
line naming the directory and the winner's pid; each step is in
``metrics.jsonl`` once and no ``.tmp-`` directory is left. And a finished
run's leftover ``.tmp-`` directories go when the same command runs again and
says the run is complete, but only once it holds the lock.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest

from nemo_rl.utils.run_lock import LOCK_FILE, DirLock
from nemo_rl.utils.snapshot_store import list_trainer_steps
from testkit.run_harness import kill_group, new_marker, reap, start_run
from tests.functional.rl_run import RunDirs, env_for, processes_with_marker, replies, run_grpo

pytestmark = [pytest.mark.functional, pytest.mark.timeout(150)]

STEPS = 2


def _args(config: str, dirs: RunDirs) -> list[str]:
    return ["--config", f"examples/configs/{config}", "policy.model_name=scripted-test-backend", *replies(0.2),
            f"grpo.max_num_steps={STEPS}", "rollout_checkpointing.snapshot_attempt_interval_s=0.3", *dirs.overrides()]


def _refusal(directory: Path, keys: str, pid: int) -> re.Pattern:
    return re.compile(rf"error: {re.escape(str(directory.resolve()))} \({re.escape(keys)}\) is in use by another run: "
                      rf"pid {pid} on host \S+, started \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00\. Wait for it to end, "
                      rf"or use another {re.escape(keys.split(' and ')[0])}")


@pytest.mark.parametrize("config", ["grpo_workplace_turn.yaml", "grpo_workplace_two_replicas_turn.yaml"])
def test_two_launches_at_once_one_trains_the_other_is_refused_before_ray(tmp_path, config):
    dirs = RunDirs(tmp_path / "run")
    args = _args(config, dirs)
    markers = [new_marker(), new_marker()]
    outs = [tmp_path / f"launch-{i}" for i in range(2)]
    files = contextlib.ExitStack()
    started = time.monotonic()
    procs = [start_run(args, env=env_for(extra={"NEMO_RL_TEST_RUN_ID": m}),
                       stdout=files.enter_context(open(f"{o}.out", "wb")),
                       stderr=files.enter_context(open(f"{o}.err", "wb"))) for m, o in zip(markers, outs)]
    ended: dict[int, float] = {}
    left_at_exit: dict[int, list[int]] = {}
    try:
        while len(ended) < 2 and time.monotonic() - started < 120:
            for i, proc in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.monotonic() - started
                    left_at_exit[i] = processes_with_marker(markers[i])
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
        for marker in markers:
            reap(marker)
        files.close()
    codes = sorted((proc.returncode, i) for i, proc in enumerate(procs))
    assert [c for c, _ in codes] == [0, 1], [(c, Path(f"{outs[i]}.err").read_text()[-2000:]) for c, i in codes]
    winner, loser = codes[0][1], codes[1][1]
    err = Path(f"{outs[loser]}.err").read_text()
    print(f"\n[{config}] refused launch exited after {ended[loser]:.2f}s; the winner ran {ended[winner]:.1f}s")
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one error line, nothing else
    assert _refusal(dirs.ckpt, "checkpointing.checkpoint_dir", procs[winner].pid).fullmatch(err.strip()), err
    loser_out = Path(f"{outs[loser]}.out").read_text()  # the start banner only: no "Gym ready", no summary
    assert "checkpoint dir:" in loser_out and "Gym ready" not in loser_out and "| what" not in loser_out, loser_out
    assert ended[loser] < 10 and ended[loser] < ended[winner]  # at once, while the winner still ran
    assert left_at_exit[loser] == []  # it started nothing: no Ray, no Gym server, no reaper
    assert "Gym ready" in Path(f"{outs[winner]}.out").read_text()

    assert [m["step"] for m in dirs.records("metrics.jsonl")] == list(range(1, STEPS + 1))
    assert list_trainer_steps(dirs.ckpt)[-1] == STEPS
    assert any(s["committed"] for s in dirs.records("snapshots.jsonl"))
    assert sorted(tmp_path.rglob(".tmp-*")) == [] and sorted(tmp_path.rglob(LOCK_FILE)) == []


def test_a_finished_run_removes_leftover_tmp_dirs_when_run_again_but_only_under_the_lock(tmp_path):
    dirs = RunDirs(tmp_path)
    args = _args("grpo_workplace_turn.yaml", dirs)
    first = run_grpo(args, env=env_for())
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = (dirs.logs / "metrics.jsonl").read_text()
    anchor = dirs.ckpt / f"step_{STEPS}"
    leftovers = [dirs.ckpt / ".tmp-step_1", anchor / "rollout_snapshots" / ".tmp-snapshot_000007"]
    for path in leftovers:
        path.mkdir(parents=True)
        (path / "half-written.json").write_text("{")

    # Another process holds the log dir: the command is refused and removes nothing, in either directory.
    held = DirLock.acquire(dirs.logs, ["logger.log_dir"])
    try:
        refused = run_grpo(args, env=env_for(), timeout_s=60)
    finally:
        held.release()
    assert refused.returncode == 1
    assert _refusal(dirs.logs, "logger.log_dir", os.getpid()).fullmatch(refused.stderr.strip()), refused.stderr
    assert all(path.is_dir() for path in leftovers)
    assert not (dirs.ckpt / LOCK_FILE).exists()  # the checkpoint dir it had taken first was given back

    started = time.monotonic()
    again = run_grpo(args, env=env_for(), timeout_s=60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "The run is complete" in again.stdout and "Gym ready" not in again.stdout
    assert time.monotonic() - started < 30
    for path in leftovers:
        assert not path.exists()
        assert f"removed a half-written checkpoint directory left by a crash: {path}" in again.stderr
    assert (dirs.logs / "metrics.jsonl").read_text() == metrics
    assert sorted(tmp_path.rglob(".tmp-*")) == [] and sorted(tmp_path.rglob(LOCK_FILE)) == []
