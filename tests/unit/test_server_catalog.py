"""The catalog a config check reads instead of importing the servers (what imports what: docs/design.md §3): it covers every
implementation in the tree and agrees with each one's ``SERVER`` class, so the driver's check and a Gym
server judge a config the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_patches.config import GymConfigError, parse_gym_config
from gym_patches.server_catalog import CATALOG, DeclaredCheckpoint, check_servers, declared_checkpoint, spec_of
from gym_patches.server_main import server_class

GYM = Path(__file__).resolve().parents[2] / "gym_patches"
TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")


def _implementations() -> set[tuple[str, str]]:
    return {(t, app.parent.name) for t in TYPES for app in (GYM / t).glob("*/app.py")}


def test_every_implementation_in_the_tree_has_an_entry_and_no_entry_is_stale():
    assert _implementations() == set(CATALOG) and len(CATALOG) >= 6


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_each_entry_agrees_with_its_server_class(key):
    spec, cls = CATALOG[key], server_class(*key)
    assert cls.config_model is spec.config_model
    assert cls.checkpoint_mode_label() == spec.checkpoint_mode


def test_check_servers_names_each_mode_and_refuses_a_bad_key_naming_it():
    config = {
        "policy_model": {"responses_api_models": {"vllm_model": {}}},
        "sandbox": {"resources_servers": {"python_sandbox": {"exec_timeout_s": 5}}},
        "agent": {"responses_api_agents": {"plain_loop_agent": {
            "model_server": {"type": "responses_api_models", "name": "policy_model"},
            "resources_server": {"type": "resources_servers", "name": "sandbox"}}}},
    }
    assert check_servers(parse_gym_config(config)) == {
        "policy_model": "saves", "sandbox": "restart-only", "agent": "restart-only"}
    config["sandbox"]["resources_servers"]["python_sandbox"]["exec_timeout_s"] = 0
    with pytest.raises(GymConfigError, match=r"sandbox\.resources_servers\.python_sandbox: exec_timeout_s"):
        check_servers(parse_gym_config(config))


def test_a_config_declares_replayable_and_the_catalog_shows_it_without_importing_a_server():
    refs = {"model_server": {"type": "responses_api_models", "name": "policy_model"},
            "resources_server": {"type": "resources_servers", "name": "sandbox"}}
    config = {
        "policy_model": {"responses_api_models": {"vllm_model": {"record_calls": True}}},
        "sandbox": {"resources_servers": {"python_sandbox": {"replayable": True}}},
        "workplace": {"resources_servers": {"workplace_assistant": {"replayable": True}}},
        "verifier": {"resources_servers": {"arithmetic_verifier": {}}},
        "plain": {"responses_api_agents": {"plain_loop_agent": {**refs, "replayable": True}}},
        "simple": {"responses_api_agents": {"simple_agent": {**refs, "replayable": True}}},
        "plain_undeclared": {"responses_api_agents": {"plain_loop_agent": refs}},
    }
    parsed = parse_gym_config(config)
    assert check_servers(parsed) == {
        "policy_model": "saves", "sandbox": "replayed", "workplace": "saves, replayable", "verifier": "stateless",
        "plain": "replayed", "simple": "saves, replayable", "plain_undeclared": "restart-only"}
    declared = {name: declared_checkpoint(inst) for name, inst in parsed.instances.items()}
    assert declared["sandbox"] == DeclaredCheckpoint("replayed", True, True)
    assert declared["plain_undeclared"] == DeclaredCheckpoint("restart-only", True, False)
    assert declared["verifier"] == DeclaredCheckpoint("stateless", False, True)
    assert declared["policy_model"] == DeclaredCheckpoint("saves", False, False)
    config["sandbox"]["resources_servers"]["python_sandbox"]["replayable"] = "yes"
    with pytest.raises(GymConfigError, match=r"sandbox\.resources_servers\.python_sandbox: replayable"):
        check_servers(parse_gym_config(config))


def test_an_unknown_implementation_is_named():
    with pytest.raises(GymConfigError, match=r"no Gym server implementation responses_api_agents/nope"):
        spec_of("responses_api_agents", "nope")
