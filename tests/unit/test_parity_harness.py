"""The parity harness's command line (``examples/recovery_parity.py``): what it refuses before starting any
run, each with one ``error:`` line naming the bad option, key or directory, exit 2."""

from __future__ import annotations

import pytest

from nemo_rl.parity.harness import main

CONFIG = "examples/configs/grpo_workplace_two_replicas_turn.yaml"


@pytest.mark.parametrize("argv, says", [
    (["--faults", "explode"], "--faults: unknown fault 'explode'"),
    (["--faults", "kill", "rollout_checkpointing.snapshot_attempt_interval_s=null"],
     "rollout_checkpointing.snapshot_attempt_interval_s"),
    (["--faults", "worker", "rollout_recovery.in_run.enabled=false"], "rollout_recovery.in_run.enabled=true"),
    (["--faults", "kill", "async_rl.min_groups_for_streaming_train=2"], "async_rl.min_groups_for_streaming_train"),
    (["--faults", "kill", "grpo.no_such_key=1"], "grpo.no_such_key"),
    (["--bogus"], "unknown option --bogus"),
])
def test_bad_arguments_are_refused_before_any_run_naming_them(tmp_path, capsys, argv, says):
    assert main(["--config", CONFIG, "--workdir", str(tmp_path / "w"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err, err
    assert not (tmp_path / "w").exists()  # nothing started, nothing written


def test_a_workdir_holding_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "faulted" / "logs").mkdir(parents=True)
    assert main(["--config", CONFIG, "--workdir", str(tmp_path), "--faults", "kill"]) == 2
    assert f"{tmp_path / 'faulted'} is not empty" in capsys.readouterr().err
