"""Config loading: inheritance, overrides, and errors that name the bad key."""

from __future__ import annotations

import textwrap

import pytest

from nemo_rl.algorithms.single_controller_utils.config import (
    ConfigError,
    MasterConfig,
    RolloutRecoveryConfig,
    apply_overrides,
    embedded_default_config,
    load_config,
)
from nemo_rl.experience.rollout_recovery import RecoveryTargetLevel as L


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_embedded_default_is_valid_turn_recovery():
    cfg = load_config(None, [])
    assert cfg.rollout_recovery.target_level is L.TURN
    assert cfg.rollout_recovery.turn_checkpointing_enabled
    assert cfg.rollout_recovery.allow_restart_only_gym_servers is False
    assert cfg.env.nemo_gym.instance_ids() == ["nemo_gym/replica-0"]
    assert cfg.cluster.gpus_per_node == 0
    # The default dict is not shared with callers.
    embedded_default_config()["grpo"]["seed"] = -1
    assert load_config(None).grpo.seed == 42


def test_yaml_inheritance_relative_to_file(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    _write(
        tmp_path / "base.yaml",
        """
        data: {train_data_path: base.jsonl, seed: 1}
        grpo: {num_prompts_per_step: 3, max_num_steps: 7}
        env:
          nemo_gym:
            config: {policy_model: {base_url: "${policy_base_url}"}}
        """,
    )
    _write(
        sub / "child.yaml",
        """
        defaults: ../base.yaml
        grpo: {num_prompts_per_step: 5}
        logger: {log_dir: "${checkpointing.checkpoint_dir}/logs"}
        checkpointing: {checkpoint_dir: out}
        """,
    )
    cfg = load_config(sub / "child.yaml", [])
    assert cfg.grpo.num_prompts_per_step == 5  # child wins
    assert cfg.grpo.max_num_steps == 7  # inherited
    assert cfg.data.train_data_path == "base.jsonl"
    assert cfg.logger.log_dir == "out/logs"  # RL interpolation resolved
    # Gym interpolations are Gym's business: carried verbatim.
    assert cfg.env.nemo_gym.config["policy_model"]["base_url"] == "${policy_base_url}"


def test_inheritance_cycle_and_missing_parent_name_the_file(tmp_path):
    _write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    _write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    _write(tmp_path / "c.yaml", "defaults: nope.yaml\n")
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "c.yaml")


def test_overrides_parse_yaml_values():
    cfg = load_config(
        None,
        [
            "grpo.num_prompts_per_step=8",
            "rollout_checkpointing.snapshot_attempt_interval_s=null",
            "env.nemo_gym.config_paths=[a.yaml, b.yaml]",
            "++env.nemo_gym.config.agent.max_steps=6",
            "rollout_recovery.gym_prepare_timeout_s=2.5",
            "data.val_data_path=",
            "grpo.val_period=0",
        ],
    )
    assert cfg.grpo.num_prompts_per_step == 8
    assert cfg.rollout_checkpointing.snapshot_attempt_interval_s is None
    assert cfg.env.nemo_gym.config_paths == ["a.yaml", "b.yaml"]
    assert cfg.env.nemo_gym.config["agent"] == {"max_steps": 6}
    assert cfg.rollout_recovery.gym_prepare_timeout_s == 2.5
    assert cfg.data.val_data_path == ""


def test_override_of_schema_field_absent_from_yaml(tmp_path):
    _write(tmp_path / "min.yaml", "data: {train_data_path: x.jsonl}\n")
    cfg = load_config(tmp_path / "min.yaml", ["rollout_recovery.target_level=turn"])
    assert cfg.rollout_recovery.target_level is L.TURN


def test_override_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"key 'rollout_recovery\.allow_restart_only' does not exist"):
        load_config(None, ["rollout_recovery.allow_restart_only=true"])
    # Inside a free-form dict a new key needs ++.
    with pytest.raises(ConfigError, match=r"rollout_recovery\.agent_target_level_overrides\.x"):
        load_config(None, ["rollout_recovery.agent_target_level_overrides.x=sibling"])


def test_forced_unknown_key_fails_validation_with_dotted_path():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["++rollout_recovery.allow_restart_only=true"])
    assert "rollout_recovery.allow_restart_only: unknown key" in str(exc.value)


def test_plus_refuses_existing_key_and_bad_syntax():
    with pytest.raises(ConfigError, match="already exists"):
        apply_overrides(embedded_default_config(), ["+grpo.seed=3"])
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides(embedded_default_config(), ["grpo.seed"])


def test_every_bad_key_is_listed_with_its_path():
    with pytest.raises(ConfigError) as exc:
        load_config(
            None,
            [
                "grpo.num_prompts_per_step=0",
                "rollout_checkpointing.keep_latest_k=0",
                "rollout_recovery.target_level=bogus",
            ],
        )
    msg = str(exc.value)
    assert "grpo.num_prompts_per_step" in msg
    assert "rollout_checkpointing.keep_latest_k" in msg
    assert "rollout_recovery.target_level" in msg
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("level", ["sibling", "prompt_group"])
def test_allow_restart_only_rejected_without_gym_saves(level):
    with pytest.raises(ConfigError) as exc:
        load_config(
            None,
            [f"rollout_recovery.target_level={level}", "rollout_recovery.allow_restart_only_gym_servers=true"],
        )
    msg = str(exc.value)
    assert "rollout_recovery.allow_restart_only_gym_servers" in msg
    assert "rollout_recovery.target_level" in msg


def test_allow_restart_only_accepted_with_gym_saves():
    cfg = load_config(
        None, ["rollout_recovery.target_level=turn", "rollout_recovery.allow_restart_only_gym_servers=true"]
    )
    assert cfg.rollout_recovery.allow_restart_only_gym_servers
    assert cfg.rollout_recovery.turn_checkpointing_enabled


@pytest.mark.parametrize("level", ["sibling", "prompt_group"])
def test_allow_restart_only_message_names_turn_only(level):
    with pytest.raises(ConfigError) as exc:
        load_config(
            None, [f"rollout_recovery.target_level={level}", "rollout_recovery.allow_restart_only_gym_servers=true"]
        )
    msg = str(exc.value)
    assert "target_level is turn or prefix" in msg and f"(it is {level})" in msg


def test_prefix_target_turns_on_gym_saves_and_generation_cuts():
    cfg = load_config(None, ["rollout_recovery.target_level=prefix", "rollout_recovery.allow_restart_only_gym_servers=true"])
    recovery = cfg.rollout_recovery
    assert recovery.target_level is L.PREFIX and recovery.allow_restart_only_gym_servers
    assert recovery.turn_checkpointing_enabled and recovery.generation_cuts_enabled


def test_turn_checkpointing_enabled_per_level():
    on = {lvl.value for lvl in L if RolloutRecoveryConfig(target_level=lvl).turn_checkpointing_enabled}
    cuts = {lvl.value for lvl in L if RolloutRecoveryConfig(target_level=lvl).generation_cuts_enabled}
    assert on == {"prefix", "turn"} and cuts == {"prefix"}


def test_overrides_may_only_be_coarser():
    ok = RolloutRecoveryConfig(
        target_level="turn",
        task_source_target_level_overrides={"math": "turn", "code": "sibling"},
        agent_target_level_overrides={"plain_agent": "prompt_group"},
    )
    assert ok.agent_target_level_overrides["plain_agent"] is L.PROMPT_GROUP
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["rollout_recovery.target_level=sibling", "++rollout_recovery.agent_target_level_overrides.fast_agent=turn"])
    assert "rollout_recovery.agent_target_level_overrides.fast_agent=turn" in str(exc.value)
    with pytest.raises(ConfigError, match=r"task_source_target_level_overrides\.wp=prefix"):
        load_config(None, ["++rollout_recovery.task_source_target_level_overrides.wp=prefix"])


def test_resolve_for_precedence():
    cfg = RolloutRecoveryConfig(
        target_level="turn",
        task_source_target_level_overrides={"workplace": "sibling"},
        agent_target_level_overrides={"plain_agent": "prompt_group"},
    )
    assert cfg.resolve_for("workplace", "plain_agent") is L.PROMPT_GROUP
    assert cfg.resolve_for("workplace", "simple_agent") is L.SIBLING
    assert cfg.resolve_for("other", None) is L.TURN
    assert cfg.resolve_for(None, None) is L.TURN


def test_removed_legacy_keys_are_named():
    with pytest.raises(ConfigError, match=r"rollout_recovery\.default_granularity"):
        load_config(None, ["++rollout_recovery.default_granularity=sibling"])


def test_gym_prepare_timeout_must_be_positive():
    with pytest.raises(ConfigError, match=r"rollout_recovery\.gym_prepare_timeout_s"):
        load_config(None, ["rollout_recovery.gym_prepare_timeout_s=0"])


def test_cross_section_rules_name_both_keys():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["checkpointing.enabled=false"])
    assert "rollout_checkpointing.snapshot_attempt_interval_s" in str(exc.value)
    assert "checkpointing.enabled" in str(exc.value)


def _leaves(data, schema, prefix=""):
    """(dotted key, value, schema default); free-form mappings (e.g. Gym config) are one leaf."""
    for key, value in data.items():
        default = schema[key]
        if isinstance(value, dict) and value and isinstance(default, dict) and default:
            yield from _leaves(value, default, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value, default


def test_the_embedded_default_only_sets_what_differs_from_the_schema():
    from nemo_rl.algorithms.single_controller_utils.config import DEFAULT_CONFIG

    schema = MasterConfig.model_validate({"data": {"train_data_path": "x"}}).to_dict()
    for key, value, default in _leaves(DEFAULT_CONFIG, schema):
        if key != "data.train_data_path":
            assert default != value, f"{key}={value!r} repeats the schema default: drop it from DEFAULT_CONFIG"


def test_metrics_file_must_be_a_plain_name():
    assert load_config(None, ["logger.metrics_file=steps.jsonl"]).logger.metrics_file == "steps.jsonl"
    with pytest.raises(ConfigError, match="logger.metrics_file"):
        load_config(None, ["logger.metrics_file=../x.jsonl"])


def test_shards_and_instance_ids():
    cfg = load_config(
        None,
        ["env.nemo_gym.shards=[{name: a, replicas: 2}, {name: b, replicas: 1, config_paths: [x.yaml]}]"],
    )
    assert cfg.env.nemo_gym.instance_ids() == ["a/replica-0", "a/replica-1", "b/replica-0"]
    with pytest.raises(ConfigError, match=r"env\.nemo_gym\.shards\.0\.replicas"):
        load_config(None, ["env.nemo_gym.shards.0.replicas=0"])
    with pytest.raises(ConfigError, match="unique"):
        load_config(None, ["env.nemo_gym.shards=[{name: a}, {name: a}]"])


def test_missing_required_and_bad_file(tmp_path):
    _write(tmp_path / "empty.yaml", "grpo: {seed: 1}\n")
    with pytest.raises(ConfigError, match=r"data: Field required"):
        load_config(tmp_path / "empty.yaml")
    _write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_round_trip_through_dict_and_yaml():
    cfg = load_config(None, ["rollout_recovery.target_level=sibling"])
    again = MasterConfig.model_validate(cfg.to_dict())
    assert again == cfg
    assert "target_level: sibling" in cfg.to_yaml()


# ----- upstream NeMo-RL keys ----------------------------------------------------
def test_should_use_nemo_gym_true_is_accepted_and_false_is_refused(tmp_path):
    assert load_config(None, ["env.should_use_nemo_gym=true"]).env.should_use_nemo_gym is True
    _write(tmp_path / "up.yaml", "data: {train_data_path: x.jsonl}\nenv: {should_use_nemo_gym: true}\n")
    assert load_config(tmp_path / "up.yaml").env.should_use_nemo_gym is True
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["env.should_use_nemo_gym=false"])
    msg = str(exc.value)
    assert "env.should_use_nemo_gym" in msg and "every rollout in Gym (env.nemo_gym)" in msg


def test_keep_top_k_with_null_metric_keeps_the_latest_k():
    cfg = load_config(None, [])
    assert cfg.checkpointing.keep_top_k == 3 and cfg.checkpointing.metric_name is None
    cfg = load_config(None, ["checkpointing.keep_top_k=5", "checkpointing.metric_name=null"])
    assert cfg.checkpointing.keep_top_k == 5
    assert load_config(None, ["checkpointing.keep_top_k=null"]).checkpointing.keep_top_k is None  # keep all
    with pytest.raises(ConfigError, match=r"checkpointing\.keep_top_k"):
        load_config(None, ["checkpointing.keep_top_k=0"])


def test_a_metric_name_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["checkpointing.metric_name=val_reward_mean"])
    msg = str(exc.value)
    assert "checkpointing.metric_name" in msg and "only null (keep the latest k) is supported" in msg


def test_checkpointing_keep_latest_k_names_its_new_key(tmp_path):
    renamed = ("checkpointing.keep_latest_k was renamed checkpointing.keep_top_k "
               "(with metric_name: null it keeps the latest k)")
    _write(tmp_path / "old.yaml", "data: {train_data_path: x.jsonl}\ncheckpointing: {keep_latest_k: 2}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "old.yaml")
    assert renamed in str(exc.value)
    for override in ("checkpointing.keep_latest_k=2", "++checkpointing.keep_latest_k=2"):
        with pytest.raises(ConfigError) as exc:
            load_config(None, [override])
        assert renamed in str(exc.value)
    # The snapshot one keeps its name.
    assert load_config(None, ["rollout_checkpointing.keep_latest_k=4"]).rollout_checkpointing.keep_latest_k == 4


def test_restore_mode_values():
    assert load_config(None, []).rollout_checkpointing.restore_mode == "latest"
    cfg = load_config(None, ["rollout_checkpointing.restore_mode=trainer_checkpoint"])
    assert cfg.rollout_checkpointing.restore_mode == "trainer_checkpoint"
    with pytest.raises(ConfigError, match=r"rollout_checkpointing\.restore_mode"):
        load_config(None, ["rollout_checkpointing.restore_mode=newest"])
