"""The Gym launcher's reading of an RL config (``gym_patches/rl_config.py``) against the RL side's own
(``load_config``, ``shard_gym_config``, ``build_gym_actor_config``): the same Gym instances with the
same configs, for every shipped config and under overrides, without importing NeMo-RL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gym_patches import rl_config
from gym_patches.config import GymConfigError
from nemo_rl.algorithms.single_controller_utils.config import (
    NemoGymEnvConfig,
    ShardConfig,
    load_config,
)
from nemo_rl.algorithms.single_controller_utils.setup import shard_gym_config
from nemo_rl.environments.nemo_gym import build_gym_actor_config
from nemo_rl.experience.rollout_recovery.levels import RecoveryTargetLevel

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "examples" / "configs").glob("*.yaml"))
# Run-specific values: the run makes its own token, points the model server at its policy, and has it send
# calls again while its generation worker restarts (docs/design.md §5.12).
RUN_OWN = ("policy_base_url", "policy_unreachable_retry_s")


def _rl_side(path: str, overrides: list[str]) -> dict[str, dict]:
    """instance id -> the Gym config a training run gives that replica (token and policy URL aside)."""
    config = load_config(REPO / path, overrides)
    env = config.env.nemo_gym
    out = {}
    for shard in env.shards:
        cfg = build_gym_actor_config(shard_gym_config(env, shard), policy_base_url="http://127.0.0.1:1/v1",
                                     control_auth_token="t",
                                     checkpointing=config.rollout_recovery.turn_checkpointing_enabled,
                                     storage_writer=config.checkpointing.storage_writer)
        for i in range(shard.replicas):
            out[f"{shard.name}/replica-{i}"] = _comparable(cfg)
    return out


def _comparable(cfg: dict) -> dict:
    cfg = {k: v for k, v in cfg.items() if k not in RUN_OWN}
    cfg["checkpoint"] = {k: v for k, v in cfg["checkpoint"].items() if k != "control_auth_token"}
    return cfg


@pytest.mark.parametrize("overrides", [
    [],
    ["rollout_recovery.target_level=sibling", "rollout_recovery.allow_restart_only_gym_servers=false"],
    ["env.nemo_gym.spinup_timeout_s=30", "++env.nemo_gym.config.default_host=127.0.0.1"],
    ["checkpointing.storage_writer.class_path=testkit.write_faults:FailingWriter",
     "++checkpointing.storage_writer.kwargs.fault=EIO:records.jsonl:2"],
])
@pytest.mark.parametrize("path", CONFIGS)
def test_the_launcher_starts_what_the_run_would_start(monkeypatch, tmp_path, path, overrides):
    monkeypatch.chdir(tmp_path)  # relative paths fall back to the repository root on both sides
    rl = rl_config.read_rl_gym([path], overrides)
    ours = {i.instance_id: _comparable(i.config) for i in rl.instances}
    assert ours == _rl_side(path, overrides)
    config = load_config(REPO / path, overrides)
    assert rl.checkpointing == config.rollout_recovery.turn_checkpointing_enabled
    assert rl.spinup_timeout_s == config.env.nemo_gym.spinup_timeout_s


def test_replica_overrides_reach_the_instances():
    rl = rl_config.read_rl_gym(["examples/configs/grpo_mixed_two_shards_turn.yaml"],
                               ["env.nemo_gym.shards.1.replicas=3"])
    assert [i.instance_id for i in rl.instances] == [
        "saving/replica-0", "saving/replica-1", "mixed/replica-0", "mixed/replica-1", "mixed/replica-2"]
    assert len({i.config["checkpoint"]["control_auth_token"] for i in rl.instances}) == 1


def test_the_restated_schema_matches_the_rl_schema():
    assert set(rl_config.SECTION_KEYS) == set(NemoGymEnvConfig.model_fields)
    assert set(rl_config.SHARD_KEYS) == set(ShardConfig.model_fields)
    assert rl_config.DEFAULT_SHARD == ShardConfig().name
    assert rl_config.DEFAULT_SPINUP_TIMEOUT_S == NemoGymEnvConfig().spinup_timeout_s
    assert set(rl_config.LEVELS) == {level.value for level in RecoveryTargetLevel}
    assert set(rl_config.CHECKPOINTED_LEVELS) == {lv.value for lv in RecoveryTargetLevel if lv.requires_gym_checkpoint}
    assert rl_config.DEFAULT_LEVEL == load_config(REPO / "examples/configs/grpo_workplace_turn.yaml",
                                                  ["rollout_recovery={}"]).rollout_recovery.target_level.value


@pytest.mark.parametrize("overrides, named", [
    (["env.nemo_gym.shards.0.replica=2"], "env.nemo_gym.shards.0.replica: unknown key (did you mean "
                                           "'env.nemo_gym.shards.0.replicas'?)"),
    (["env.nemo_gym.config_path=[a.yaml]"], "did you mean 'env.nemo_gym.config_paths'?"),
    (["env.nemo_gym.config_paths=[nope.yaml]"], "env.nemo_gym.config_paths.0=nope.yaml: no such file"),
    (["env.nemo_gym.shards.0.replicas=0"], "env.nemo_gym.shards.0.replicas must be a whole number >= 1"),
    (["rollout_recovery.target_level=turns"], "rollout_recovery.target_level='turns': must be one of"),
    (["env.nemo_gym.shards.2.replicas=1"], "env.nemo_gym.shards has no item 2"),
])
def test_bad_gym_keys_are_named(overrides, named):
    with pytest.raises(GymConfigError) as err:
        rl_config.read_rl_gym(["examples/configs/grpo_workplace_two_replicas_turn.yaml"], overrides)
    assert named in str(err.value)


def test_only_files_with_rl_sections_are_taken_for_rl_configs(tmp_path):
    assert rl_config.looks_like_rl_config(["examples/configs/grpo_workplace_turn.yaml"])
    assert not rl_config.looks_like_rl_config(["examples/gym_configs/workplace.yaml"])
    assert not rl_config.looks_like_rl_config(["no/such/file.yaml"])
    gym = tmp_path / "gym.yaml"  # a Gym server named like an RL section is still a Gym config
    gym.write_text("policy:\n  responses_api_models:\n    vllm_model: {}\n")
    assert not rl_config.looks_like_rl_config([str(gym)])


def test_the_launcher_imports_nothing_from_nemo_rl():
    code = ("import sys, gym_patches.launch, gym_patches.rl_config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'nemo_rl'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
