"""Which restart-only servers matter to turn recovery, given per-agent and per-task-source levels.

Pure logic: ``turn_level_users``, the prepare-policy overrides and the setup
check's error and warnings (``restart_only_check``) over several instances.
"""

from __future__ import annotations

import warnings

import pytest

from nemo_rl.algorithms.single_controller_utils.config import load_config
from nemo_rl.algorithms.single_controller_utils.gym_server_levels import (
    agent_levels,
    coarser_level_override,
    prepare_policy_overrides,
    turn_level_users,
)
from nemo_rl.algorithms.single_controller_utils.setup import restart_only_check
from nemo_rl.experience.rollout_recovery import RecoveryTargetLevel as L

AGENTS = {"wp_agent": "workplace", "plain_agent": "workplace", "sb_agent": "sandbox", "math_agent": "verifier"}
ROWS = [
    {"agent_ref": {"name": "wp_agent"}, "task_source": "workplace"},
    {"agent_ref": {"name": "plain_agent"}, "task_source": "workplace"},
    {"agent_ref": {"name": "sb_agent"}, "task_source": "python_sandbox"},
    {"agent_ref": {"name": "math_agent"}, "task_source": "arithmetic"},
]
TYPES = {"wp_agent": "responses_api_agents", "plain_agent": "responses_api_agents", "sb_agent": "responses_api_agents",
         "math_agent": "responses_api_agents", "workplace": "resources_servers", "sandbox": "resources_servers",
         "verifier": "resources_servers"}
RESTART_ONLY = {"mixed/replica-0": ["plain_agent", "sandbox"], "mixed/replica-1": ["plain_agent", "sandbox"]}


def cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_every_agent_is_turn_level_by_default():
    users = turn_level_users(cfg().rollout_recovery, ROWS, AGENTS)
    assert users["workplace"] == ["plain_agent", "wp_agent"]
    assert users["sandbox"] == ["sb_agent"] and users["plain_agent"] == ["plain_agent"]


def test_coarser_agent_and_task_source_levels_exempt_their_servers():
    recovery = cfg("++rollout_recovery.agent_target_level_overrides.plain_agent=sibling",
                   "++rollout_recovery.task_source_target_level_overrides.python_sandbox=prompt_group").rollout_recovery
    users = turn_level_users(recovery, ROWS, AGENTS)
    assert "plain_agent" not in users and "sandbox" not in users
    assert users["workplace"] == ["wp_agent"]  # still used at turn level by the saving agent
    assert prepare_policy_overrides(["plain_agent", "sandbox"], users) == {
        "plain_agent": "best_effort", "sandbox": "best_effort"}


def test_an_agent_with_some_turn_level_rows_still_counts():
    recovery = cfg("++rollout_recovery.task_source_target_level_overrides.python_sandbox=sibling").rollout_recovery
    rows = ROWS + [{"agent_ref": {"name": "sb_agent"}, "task_source": "other"}]
    assert agent_levels(recovery, rows, ["sb_agent"])["sb_agent"] == {L.SIBLING, L.TURN}
    assert turn_level_users(recovery, rows, AGENTS)["sandbox"] == ["sb_agent"]


def test_an_agent_without_rows_gets_its_own_level():
    recovery = cfg("++rollout_recovery.agent_target_level_overrides.idle_agent=sibling").rollout_recovery
    levels = agent_levels(recovery, [], ["idle_agent", "other_agent"])
    assert levels == {"idle_agent": {L.SIBLING}, "other_agent": {L.TURN}}


def test_the_suggested_override_keeps_existing_ones_and_parses():
    recovery = cfg("++rollout_recovery.agent_target_level_overrides.a=prompt_group").rollout_recovery
    text = coarser_level_override(recovery, ["b", "c"])
    assert text == "'rollout_recovery.agent_target_level_overrides={a: prompt_group, b: sibling, c: sibling}'"
    again = cfg(text.strip("'")).rollout_recovery.agent_target_level_overrides
    assert again == {"a": L.PROMPT_GROUP, "b": L.SIBLING, "c": L.SIBLING}


def _turn_users(recovery):
    users = turn_level_users(recovery, ROWS, AGENTS)
    return {iid: users for iid in RESTART_ONLY}


def test_setup_error_names_each_server_with_its_replicas_and_the_override():
    config = cfg()
    with pytest.raises(ValueError) as exc:
        restart_only_check(config, RESTART_ONLY, TYPES, _turn_users(config.rollout_recovery))
    msg = str(exc.value)
    assert "agent 'plain_agent' (on mixed/replica-0, mixed/replica-1)" in msg
    assert "resources server 'sandbox' (on mixed/replica-0, mixed/replica-1)" in msg
    assert msg.index("agent 'plain_agent'") < msg.index("resources server 'sandbox'")  # agents first
    assert "'rollout_recovery.agent_target_level_overrides={plain_agent: sibling, sb_agent: sibling}'" in msg


def test_the_suggested_override_passes_the_check_with_the_setting_false():
    config = cfg("rollout_recovery.agent_target_level_overrides={plain_agent: sibling, sb_agent: sibling}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restart_only_check(config, RESTART_ONLY, TYPES, _turn_users(config.rollout_recovery))


def test_best_effort_warns_naming_only_turn_level_restart_only_servers():
    config = cfg("rollout_recovery.allow_restart_only_gym_servers=true",
                 "++rollout_recovery.agent_target_level_overrides.plain_agent=sibling")
    with pytest.warns(UserWarning) as record:
        restart_only_check(config, RESTART_ONLY, TYPES, _turn_users(config.rollout_recovery))
    msg = str(record[0].message)
    assert "resources server 'sandbox' (on mixed/replica-0, mixed/replica-1)" in msg
    assert "plain_agent" not in msg


def test_best_effort_without_turn_level_restart_only_servers_says_set_it_false():
    config = cfg("rollout_recovery.allow_restart_only_gym_servers=true",
                 "rollout_recovery.agent_target_level_overrides={plain_agent: sibling, sb_agent: sibling}")
    with pytest.warns(UserWarning, match="set it to false"):
        restart_only_check(config, RESTART_ONLY, TYPES, _turn_users(config.rollout_recovery))
