"""Which rollouts come back by replay, and what a snapshot writes and counts for them (docs/design.md §4.8).

Pure logic over real parsed Gym configs and the real ledger: the one rule (``server_catalog.replay_agents``)
and the record switch it drives (``with_call_records``); the planner's ``replayed`` keys (the model server's
scope only), the snapshot's counts; ``gym_checkpoint.json``'s ``replayed``; the setup check, which names only
the restart-only servers that neither save nor are replayable.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import yaml

from gym_patches.config import parse_gym_config
from gym_patches.server_catalog import replay_agents, with_call_records
from nemo_rl.algorithms.single_controller_utils.config import load_config
from nemo_rl.algorithms.single_controller_utils.gym_server_levels import prepare_policy_overrides, turn_level_users
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import (
    plan_snapshot,
    server_scopes,
)
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.store import GymCheckpointIndex
from nemo_rl.algorithms.single_controller_utils.setup import restart_only_check
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger
from testkit.snapshot_checks import check_ownership_now, count_snapshot_now

GYM_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "gym_configs"
REFS = {"model_server": {"type": "responses_api_models", "name": "policy_model"}}


def gym(name: str) -> dict:
    return yaml.safe_load((GYM_CONFIGS / name).read_text())


def agent(impl: str, resources: str | None, **settings) -> dict:
    refs = copy.deepcopy(REFS)
    if resources:
        refs["resources_server"] = {"type": "resources_servers", "name": resources}
    return {"responses_api_agents": {impl: {**refs, **settings}}}


# ----------------------------------------------------------------------------- the rule
def test_the_shipped_replayed_configs_replay_exactly_the_rollouts_on_restart_only_servers():
    replayed = replay_agents(parse_gym_config(gym("mixed_replayed.yaml")))
    # workplace_simple_agent saves and its resources server saves: it continues at its turn, not by replay
    assert replayed == {"workplace_restart_only_agent": "policy_model", "sandbox_simple_agent": "policy_model"}
    assert replay_agents(parse_gym_config(gym("restart_only_replayed_shard.yaml"))) == replayed
    assert replay_agents(parse_gym_config(gym("mixed.yaml"))) == {}  # nothing declared: as before
    assert replay_agents(parse_gym_config(gym("saving_shard.yaml"))) == {}


def test_every_server_a_rollout_touches_must_be_replayable_and_one_restart_only():
    raw = {
        "policy_model": {"responses_api_models": {"vllm_model": {}}},
        "second_model": {"responses_api_models": {"vllm_model": {}}},
        "sandbox": {"resources_servers": {"python_sandbox": {"replayable": True}}},
        "sandbox_undeclared": {"resources_servers": {"python_sandbox": {}}},
        "workplace": {"resources_servers": {"workplace_assistant": {}}},  # saves, not declared replayable
        "verifier": {"resources_servers": {"arithmetic_verifier": {}}},  # stateless: replayable by nature
        "on_sandbox": agent("simple_agent", "sandbox", replayable=True),
        "undeclared_agent_on_sandbox": agent("simple_agent", "sandbox"),
        "on_undeclared_sandbox": agent("simple_agent", "sandbox_undeclared", replayable=True),
        "plain_on_verifier": agent("plain_loop_agent", "verifier", replayable=True),
        "plain_on_saving_undeclared": agent("plain_loop_agent", "workplace", replayable=True),
        "saving_on_verifier": agent("simple_agent", "verifier", replayable=True),  # nothing restart-only
    }
    raw["other_model_agent"] = agent("plain_loop_agent", "verifier", replayable=True)
    raw["other_model_agent"]["responses_api_agents"]["plain_loop_agent"]["model_server"]["name"] = "second_model"
    assert replay_agents(parse_gym_config(raw)) == {
        "on_sandbox": "policy_model", "plain_on_verifier": "policy_model",
        "other_model_agent": "second_model"}


def test_call_records_are_turned_on_only_where_replay_needs_them():
    raw = gym("mixed_replayed.yaml")
    raw["idle_model"] = {"responses_api_models": {"vllm_model": {"return_token_id_information": True}}}
    before = copy.deepcopy(raw)
    out = with_call_records(raw, parse_gym_config(raw))
    assert raw == before  # the caller's dict is not changed
    assert out["policy_model"]["responses_api_models"]["vllm_model"] == {
        "return_token_id_information": True, "record_calls": True}
    assert out["idle_model"] == raw["idle_model"]
    assert {k: v for k, v in out.items() if k != "policy_model"} == \
        {k: v for k, v in raw.items() if k != "policy_model"}
    parse_gym_config(out)  # still a valid config: record_calls is the model server's own key
    plain = gym("mixed.yaml")
    assert with_call_records(plain, parse_gym_config(plain)) == plain  # no replayed agent: nothing recorded


# ----------------------------------------------------------------------------- the planner
IID = "mixed/replica-0"
SERVERS = {IID: {"simple": ["simple", "policy_model", "workplace"], "plain": ["plain", "policy_model", "workplace"],
                 "sb": ["sb", "policy_model", "sandbox"], "undeclared": ["undeclared", "policy_model", "sandbox2"]}}


def ledger_with(*agents: str) -> tuple[RolloutRecoveryLedger, dict[str, list[str]]]:
    """One group of two turn-level rollouts per agent, dispatched to ``IID``; agent -> its rollouts' keys."""
    ledger = RolloutRecoveryLedger()
    keys = {}
    for i, name in enumerate(agents):
        group = ledger.reserve_group(f"s1p{i}", f"p{i}", i, None, name, "turn", 2, 1, position=i)
        keys[name] = [s.current_attempt.rollout_id(group.group_id, s.generation_index) for s in group.siblings]
        for key in keys[name]:
            ledger.mark_dispatched(key, IID)
    return ledger, keys


def test_replayed_rollouts_are_written_by_their_model_server_alone_and_counted_apart():
    ledger, keys = ledger_with("simple", "plain", "sb", "undeclared")
    plan = plan_snapshot(ledger, [IID], {IID: keys["sb"]}, unsavable_agents={IID: {"plain", "sb", "undeclared"}},
                         replay_models={IID: {"plain": "policy_model", "sb": "policy_model"}})
    replayed = keys["plain"] + keys["sb"]
    assert plan.replayed[IID] == {k: "policy_model" for k in replayed}
    assert plan.unsaved[IID] == set(replayed + keys["undeclared"])  # none of them in an agent's commit scope
    assert set(plan.scope[IID]) == set(keys["simple"])
    scopes = server_scopes(plan, SERVERS)[IID]
    assert sorted(scopes["policy_model"]) == sorted(keys["simple"] + replayed)  # the record of each
    assert sorted(scopes["simple"]) == sorted(scopes["workplace"]) == sorted(keys["simple"])
    assert "plain" not in scopes and "sb" not in scopes and "sandbox" not in scopes and "undeclared" not in scopes
    exported = {IID: set(keys["simple"])}
    counts = count_snapshot_now(ledger, plan, exported, owned=check_ownership_now(ledger, plan, exported))
    assert (counts.saved, counts.replayed, counts.unsaved, counts.not_admitted) == (2, 4, 2, 0)


def test_without_replay_models_nothing_is_replayed():
    ledger, keys = ledger_with("simple", "plain")
    plan = plan_snapshot(ledger, [IID], {}, unsavable_agents={IID: {"plain"}})
    assert plan.replayed == {IID: {}} and plan.unsaved[IID] == set(keys["plain"])
    assert sorted(server_scopes(plan, SERVERS)[IID]["policy_model"]) == sorted(keys["simple"])
    counts = count_snapshot_now(ledger, plan, {IID: set(keys["simple"])})
    assert (counts.saved, counts.replayed, counts.unsaved) == (2, 0, 2)


# ----------------------------------------------------------------------------- the index
def test_the_index_keeps_a_replayed_rollout_only_where_a_model_server_wrote_its_record():
    written = {IID: {"simple": ["a"], "workplace": ["a"], "policy_model": ["a", "r1", "stray"]},
               "mixed/replica-1": {"policy_model": ["r3"]}}
    index = GymCheckpointIndex.from_written(
        "c1", written, {IID: {"a"}, "mixed/replica-1": set()}, {IID: ["u"], "mixed/replica-1": []},
        {IID: {"a": 5, "r1": 7, "stray": 9}}, {IID: {"r1", "r2"}, "mixed/replica-1": {"r3"}})
    assert index.instances[IID] == {"simple": ["a"], "workplace": ["a"], "policy_model": ["a", "r1"]}
    assert index.turn_level == {IID: ["a"], "mixed/replica-1": []}  # replayed ones do not continue at their turn
    assert index.replayed == {IID: ["r1"], "mixed/replica-1": ["r3"]}  # r2: no model server wrote its record
    assert index.replayed_keys(IID) == {"r1"} and index.replayed_keys("nemo_gym/replica-0") == set()
    assert index.cut_tokens == {IID: {"a": 5, "r1": 7}}  # a cut after the replayed calls is kept with them
    assert index.exported()["mixed/replica-1"] == {"policy_model": ["r3"]}
    again = GymCheckpointIndex.model_validate_json(index.model_dump_json())
    assert again == index
    without = GymCheckpointIndex.from_written("c2", {IID: {"policy_model": ["a"]}}, {IID: {"a"}}, {IID: []})
    assert without.replayed == {} and "replayed" in without.model_dump()


# ----------------------------------------------------------------------------- the setup check
AGENTS = {"wp_agent": "workplace", "plain_agent": "workplace", "sb_agent": "sandbox"}
ROWS = [{"agent_ref": {"name": a}, "task_source": t} for a, t in
        (("wp_agent", "workplace"), ("plain_agent", "workplace"), ("sb_agent", "python_sandbox"))]
TYPES = {"wp_agent": "responses_api_agents", "plain_agent": "responses_api_agents",
         "sb_agent": "responses_api_agents", "workplace": "resources_servers", "sandbox": "resources_servers"}
RESTART_ONLY = {"mixed/replica-0": ["plain_agent", "sandbox"], "mixed/replica-1": ["plain_agent", "sandbox"]}


def users(config, replayed) -> dict[str, dict[str, list[str]]]:
    by_server = turn_level_users(config.rollout_recovery, ROWS, AGENTS, replayed=replayed)
    return {iid: by_server for iid in RESTART_ONLY}


def test_with_every_restart_only_server_replayable_the_setting_false_passes_silently():
    config = load_config(None, [])
    assert not config.rollout_recovery.allow_restart_only_gym_servers
    turn_users = users(config, {"plain_agent": "policy_model", "sb_agent": "policy_model"})
    assert "plain_agent" not in turn_users["mixed/replica-0"] and "sandbox" not in turn_users["mixed/replica-0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restart_only_check(config, RESTART_ONLY, TYPES, turn_users)
    # and they prepare best_effort: a replayed rollout's restart-only servers never block a snapshot
    assert prepare_policy_overrides(["plain_agent", "sandbox"], turn_users["mixed/replica-0"]) == {
        "plain_agent": "best_effort", "sandbox": "best_effort"}


def test_with_one_not_replayable_the_error_names_only_it_and_the_agent_that_uses_it():
    config = load_config(None, [])
    with pytest.raises(ValueError) as exc:
        restart_only_check(config, RESTART_ONLY, TYPES, users(config, {"plain_agent": "policy_model"}))
    msg = str(exc.value)
    assert "resources server 'sandbox' (on mixed/replica-0, mixed/replica-1)" in msg
    assert "plain_agent" not in msg and "'workplace'" not in msg
    assert "'rollout_recovery.agent_target_level_overrides={sb_agent: sibling}'" in msg
    assert "declare them replayable" in msg and "§4.8" in msg


def test_the_setting_true_with_every_restart_only_server_replayable_says_set_it_false():
    config = load_config(None, ["rollout_recovery.allow_restart_only_gym_servers=true"])
    with pytest.warns(UserWarning, match="set it to false") as record:
        restart_only_check(config, RESTART_ONLY, TYPES,
                           users(config, {"plain_agent": "policy_model", "sb_agent": "policy_model"}))
    assert "come back by replay" in str(record[0].message)
    assert "plain_agent" not in str(record[0].message) and "'sandbox'" not in str(record[0].message)
