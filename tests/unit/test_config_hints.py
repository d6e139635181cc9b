"""Config errors that say what to write instead, and the one rule for relative paths (issue 31)."""

from __future__ import annotations

import os

import pytest

from nemo_rl.algorithms.single_controller_utils.config import REPO_ROOT, ConfigError, load_config, unknown_key_hint
from nemo_rl.cli.preflight import check_output_dir, prepare


@pytest.mark.parametrize("key, hint", [
    ("rollout_recovery.allow_restart_only_gym_server", "did you mean 'rollout_recovery.allow_restart_only_gym_servers'?"),
    ("rollout_recovry.target_level", "did you mean 'rollout_recovery.target_level'?"),
    ("env.nemo_gym.shards.0.replica", "did you mean 'env.nemo_gym.shards.0.replicas'?"),
    ("policy.generation.bakend", "did you mean 'policy.generation.backend'?"),
    ("cluster.zzz", "cluster has only the keys gpus_per_node, num_cpus, ray_address"),
    ("env.nemo_gym.config.anything", None),  # a free-form mapping: ++ adds it there
    ("rollout_recovery.agent_target_level_overrides.my_agent", None),
])
def test_unknown_key_hints(key, hint):
    assert unknown_key_hint(key.split(".")) == hint


def test_plus_plus_is_advised_only_where_it_works():
    with pytest.raises(ConfigError) as forbidden:
        load_config(None, ["checkpointing.keep_top_kk=2"])
    assert "did you mean 'checkpointing.keep_top_k'?" in str(forbidden.value) and "++" not in str(forbidden.value)
    with pytest.raises(ConfigError) as free:
        load_config(None, ["env.nemo_gym.config.new_key=1"])
    assert "use '++env.nemo_gym.config.new_key=...' to add it" in str(free.value)
    assert load_config(None, ["++env.nemo_gym.config.new_key=1"]).env.nemo_gym.config["new_key"] == 1


def test_inputs_resolve_from_the_current_directory_then_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jsonl").write_text("{}\n")
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    config = prepare(load_config("examples/configs/grpo_workplace_turn.yaml",  # from the repository root
                                 ["data.train_data_path=mine.jsonl", "policy.model_name=models/tiny",
                                  f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt"]))
    assert config.data.train_data_path == str(tmp_path / "mine.jsonl")
    assert config.data.val_data_path == str(REPO_ROOT / "examples/data/workplace_val.jsonl")
    assert config.env.nemo_gym.config_paths == [str(REPO_ROOT / "examples/gym_configs/workplace.yaml")]
    assert config.policy.model_name == str(model)  # a directory here, not a hub id
    hub = prepare(load_config(None, ["policy.model_name=Qwen/Qwen3-0.6B", f"logger.log_dir={tmp_path}/l",
                                     f"checkpointing.checkpoint_dir={tmp_path}/c"]))
    assert hub.policy.model_name == "Qwen/Qwen3-0.6B"
    with pytest.raises(ConfigError, match=r"policy.model_name=./gone: no such directory"):
        prepare(load_config(None, ["policy.model_name=./gone"]))
    assert not (tmp_path / "logs").exists()  # checked, not created


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_output_dir_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"logger.log_dir=.*locked/logs: .* cannot be created: .* not writable"):
            check_output_dir("logger.log_dir", str(locked / "logs"))
        with pytest.raises(ConfigError, match=r"is not writable by this user"):
            check_output_dir("logger.log_dir", str(locked))
    finally:
        locked.chmod(0o700)
