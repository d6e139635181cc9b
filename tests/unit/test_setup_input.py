"""Bad setup input fails before any rollout with an error naming the server, key or file.

Pure logic (no sockets): status classification (``_is_restart_only``), every
config field given a value of the wrong type or a key that does not exist, the
Gym config RL passes to each replica, and the test hooks (crash points, write
faults, the restart-only switch) with their test-only variables.
The same inputs against real servers and ``run_grpo`` are in
``tests/functional/test_faults.py``.
"""

from __future__ import annotations

import copy
import enum
import errno
import re
import typing
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gym_patches.checkpoint.wire import StatusReply
from gym_patches.config import GymConfigError
from nemo_rl.algorithms.single_controller_utils.config import (
    ConfigError,
    MasterConfig,
    apply_overrides,
    build_config,
    embedded_default_config,
)
from nemo_rl.algorithms.single_controller_utils.setup import check_gym_configs
from nemo_rl.environments.gym_checkpoint_adapter import GymStatusError, _is_restart_only
from nemo_rl.environments.nemo_gym import build_gym_actor_config
from nemo_rl.utils.run_hooks import PHASES, RunHooks
from testkit import crash_points, write_faults
from testkit import run_grpo as testkit_run_grpo

REPORT = {"ready": True, "blockers": [], "blocker_count": 0, "unsaved": [], "counts": {}}


def status(kind: str, **extra: Any) -> StatusReply:
    return StatusReply.model_validate({"kind": kind, "instance": "x", "phase": "idle", "report": REPORT, **extra})


# -- status replies ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, extra, restart_only",
    [
        ("agent", {"restart_only": True}, True),
        ("agent", {"restart_only": False}, False),
        ("resources", {"mode": "restart_only"}, True),
        ("resources", {"mode": "replayed", "replayable": True}, True),  # restart-only, declared replayable
        ("resources", {"mode": "exported"}, False),
        ("resources", {"mode": "stateless"}, False),
        ("model", {}, False),
    ],
)
def test_status_classification(kind, extra, restart_only):
    assert _is_restart_only("srv", status(kind, **extra)) is restart_only


@pytest.mark.parametrize(
    "kind, extra, expected",
    [
        ("resources", {"mode": "sometimes"}, r"Gym resources server 'tools_7': unknown checkpoint mode 'sometimes'"),
        ("resources", {}, r"Gym resources server 'tools_7': unknown checkpoint mode None"),
        ("resources", {"mode": 3}, r"Gym resources server 'tools_7': unknown checkpoint mode 3"),
        ("resources", {"restart_only": True}, r"'tools_7': unknown checkpoint mode None"),  # the agent's field
        ("agent", {}, r"Gym agent 'tools_7': status has no boolean 'restart_only' field \(got None\)"),
        ("agent", {"restart_only": "yes"}, r"Gym agent 'tools_7': status has no boolean 'restart_only' field"),
        ("agent", {"mode": "restart_only"}, r"Gym agent 'tools_7'"),  # the resources field
    ],
)
def test_unclassifiable_status_names_the_server(kind, extra, expected):
    with pytest.raises(GymStatusError, match=expected) as info:
        _is_restart_only("tools_7", status(kind, **extra))
    assert isinstance(info.value, ValueError)  # setup reports it as a setup error, not a retry


@pytest.mark.parametrize(
    "body, field",
    [
        ({"kind": "robot", "instance": "x", "phase": "idle", "report": REPORT}, "kind"),
        ({"instance": "x", "phase": "idle", "report": REPORT}, "kind"),
        ({"kind": "agent", "instance": "x", "phase": "asleep", "report": REPORT}, "phase"),
        ({"kind": "agent", "instance": "x", "phase": "idle"}, "report"),
        ({"kind": "agent", "instance": "x", "phase": "idle", "report": {"blockers": []}}, "report.ready"),
    ],
)
def test_malformed_status_is_rejected_naming_the_field(body, field):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        StatusReply.model_validate(body)
    locs = {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}
    assert field in locs


# -- RL config: every field, wrong type; keys that do not exist -----------------------------
def _leaves(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted paths of every field that is not itself a section, with their annotation."""
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaves(ann, path + ".")
        else:
            out.append((path, ann))
    return out


def _wrong_value(annotation: Any) -> Any:
    """A value no field of this annotation accepts (pydantic's lax mode coerces '1' and 'yes')."""
    origin = typing.get_origin(annotation)
    if origin is dict:
        return [1, 2]
    if origin in (list, tuple):
        return {"not": "a list"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "not-a-level"
    return {"not": ["a scalar"]}


LEAVES = [(p, a) for p, a in _leaves(MasterConfig) if p not in ("env.nemo_gym.config",)]


def _set(data: dict, path: str, value: Any) -> dict:
    data = copy.deepcopy(data)
    node = data
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return data


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(LEAVES))
def test_every_field_with_a_wrong_type_is_named(leaf):
    path, annotation = leaf
    data = _set(embedded_default_config(), path, _wrong_value(annotation))
    with pytest.raises(ConfigError) as info:
        build_config(data, "test.yaml")
    assert re.search(rf"^  - {re.escape(path)}(\.|:)", str(info.value), re.M), str(info.value)


_KEY = st.from_regex(r"^[a-z][a-z_]{2,15}$", fullmatch=True)
_SECTIONS = sorted({p.rsplit(".", 1)[0] for p, _ in LEAVES if "." in p})


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(_SECTIONS), _KEY)
def test_a_key_that_does_not_exist_is_named(section, key):
    data = embedded_default_config()
    node: Any = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    assume(key not in node and key not in _field_names(section))  # a real key is not an error
    node[key] = 1
    with pytest.raises(ConfigError, match=rf"{re.escape(section)}\.{key}: unknown key"):
        build_config(data, "test.yaml")
    with pytest.raises(ConfigError, match=rf"key '{re.escape(section)}\.{key}' does not exist"):
        apply_overrides(embedded_default_config(), [f"{section}.{key}=1"])


def _field_names(section: str) -> set[str]:
    model: Any = MasterConfig
    for part in section.split("."):
        model = model.model_fields[part].annotation
    return set(model.model_fields)


# -- the Gym config RL gives each replica ------------------------------------------------------
GYM = {
    "policy_model": {"responses_api_models": {"vllm_model": {"return_token_id_information": True}}},
    "workplace_assistant": {"resources_servers": {"workplace_assistant": {}}},
    "agent_a": {"responses_api_agents": {"simple_agent": {
        "model_server": {"type": "responses_api_models", "name": "policy_model"},
        "resources_server": {"type": "resources_servers", "name": "workplace_assistant"},
    }}},
}


def _actor_config(gym: dict) -> dict:
    return build_gym_actor_config(gym, policy_base_url="http://127.0.0.1:1/v1", control_auth_token="t",
                                  checkpointing=True)


def test_gym_actor_config_injects_the_checkpoint_block():
    cfg = _actor_config({**GYM, "checkpoint": {"lease_grace_seconds": 5}})
    assert cfg["checkpoint"] == {"enabled": True, "control_auth_token": "t", "lease_grace_seconds": 5.0}
    assert _actor_config(GYM)["checkpoint"]["lease_grace_seconds"] == 600.0


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"checkpoint": {"lease_grace_secs": 5}}, r"checkpoint\.lease_grace_secs do not exist"),
        ({"checkpoint": {"lease_grace_seconds": "soon"}}, r"checkpoint\.lease_grace_seconds must be a positive"),
        ({"checkpoint": {"lease_grace_seconds": -1}}, r"checkpoint\.lease_grace_seconds must be a positive"),
        ({"checkpoint": {"lease_grace_seconds": True}}, r"checkpoint\.lease_grace_seconds must be a positive"),
        ({"checkpoint": [1]}, r"'checkpoint' must be a mapping"),
        ({"agent_a": {"responses_api_agents": {"simple_agent": {**GYM["agent_a"]["responses_api_agents"][
            "simple_agent"], "max_stepz": 3}}}}, r"agent_a\.responses_api_agents\.simple_agent: max_stepz"),
        ({"agent_a": {"responses_api_agents": {"simple_agent": {**GYM["agent_a"]["responses_api_agents"][
            "simple_agent"], "max_steps": "x"}}}}, r"agent_a\.responses_api_agents\.simple_agent: max_steps"),
        ({"agent_a": {"responses_api_agents": {"no_such_agent": {}}}}, r"no Gym server implementation"),
        ({"agent_a": {"responses_api_agents": {"simple_agent": {
            "model_server": {"type": "responses_api_models", "name": "policy_modle"},
            "resources_server": {"type": "resources_servers", "name": "workplace_assistant"},
        }}}}, r"agent_a\.model_server refers to responses_api_models/policy_modle"),
    ],
)
def test_bad_gym_config_is_named_in_the_driver(change, expected):
    with pytest.raises(GymConfigError, match=expected):
        _actor_config({**GYM, **change})


def test_check_gym_configs_runs_before_anything_starts():
    data = embedded_default_config()
    data["env"]["nemo_gym"]["config"] = {"checkpoint": {"lease_grace_secs": 1}}
    config = build_config(data)
    with pytest.raises(GymConfigError, match=r"Gym config \(env\.nemo_gym\): .*checkpoint\.lease_grace_secs"):
        check_gym_configs(config)
    data["env"]["nemo_gym"]["config_paths"] = ["examples/gym_configs/no_such.yaml"]
    data["env"]["nemo_gym"]["config"] = {}
    with pytest.raises(GymConfigError, match=r"'examples/gym_configs/no_such\.yaml' cannot be read"):
        check_gym_configs(build_config(data))
    check_gym_configs(build_config(embedded_default_config()))  # the default is fine


# -- the test hooks: crash points, write faults, the restart-only switch --------------------------
@pytest.mark.parametrize("spec, expected", [(None, None), ("", None), ("  ", None), ("commit", ("commit", 1)),
                                            ("train:3", ("train", 3)), ("restore:1", ("restore", 1))])
def test_crash_spec_parses(spec, expected):
    assert crash_points.parse_crash_spec(spec) == expected


@pytest.mark.parametrize("spec, expected", [("comit", "unknown phase 'comit'"), ("commit:x", "'x' is not an integer"),
                                            ("commit:0", "count must be >= 1"), ("train:-2", "count must be >= 1")])
def test_bad_crash_spec_names_the_variable(spec, expected):
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        crash_points.parse_crash_spec(spec)
    assert crash_points.CRASH_ENV in str(info.value)


def test_crash_point_counts_its_phase_per_scope_and_nothing_else(monkeypatch):
    assert crash_points.CrashAt.from_env({}) is None
    crash = crash_points.CrashAt.from_env({crash_points.CRASH_ENV: " commit:2 "})
    assert (crash.phase, crash.nth, crash.spec) == ("commit", 2, "commit:2")
    fired: list[dict] = []
    monkeypatch.setattr(crash, "kill_run", lambda: fired.append(dict(crash.reaches)))
    crash.reached("train")  # another phase: no effect, no count
    for step in (1, 2):
        crash.reached("commit", step)  # the first reach of each step
    assert fired == [] and "train" not in crash.reaches
    crash.reached("commit", 2)  # the second reach of step 2
    assert fired == [{1: 1, 2: 2}]
    with pytest.raises(ValueError, match="not one of"):
        crash.reached("comit")
    with pytest.raises(ValueError, match="not one of"):
        crash_points.CrashAt("comit")


def test_the_product_hooks_do_nothing_and_fail_a_refused_setup():
    hooks = RunHooks()
    for phase in PHASES:
        hooks.reached(phase, 1)
    refused = ValueError("restart-only: 'python_sandbox'")
    with pytest.raises(ValueError) as info:
        hooks.on_restart_only_servers(refused)
    assert info.value is refused


def test_test_entry_hooks_from_the_environment(capsys):
    refused = ValueError("restart-only: 'python_sandbox'")
    plain = testkit_run_grpo.hooks_from_env({})
    assert plain.crash is None
    with pytest.raises(ValueError):
        plain.on_restart_only_servers(refused)
    accepting = testkit_run_grpo.hooks_from_env({testkit_run_grpo.SKIP_RESTART_ONLY_ENV: "1",
                                                 crash_points.CRASH_ENV: "train:2"})
    assert accepting.crash.phase == "train"
    accepting.on_restart_only_servers(refused)  # logged, the run goes on
    assert "restart-only: 'python_sandbox'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=testkit_run_grpo.SKIP_RESTART_ONLY_ENV):
        testkit_run_grpo.hooks_from_env({testkit_run_grpo.SKIP_RESTART_ONLY_ENV: "yes"})


def test_write_fault_spec_parses():
    assert write_faults.parse_write_fault(None) is None and write_faults.parse_write_fault("") is None
    fault = write_faults.parse_write_fault("ENOSPC:controller_state.json:3")
    assert (fault.code, fault.fragment, fault.nth) == (errno.ENOSPC, "controller_state.json", 3)
    assert write_faults.parse_write_fault("EIO:x").nth == 1


@pytest.mark.parametrize("spec, expected", [("EIO:", "must look like"), ("ENOSPACE:x", "must look like"),
                                            ("EIO:x:0", "positive integer"), ("EIO:x:y", "positive integer"),
                                            ("EIO:x:1:2", "must look like")])
def test_bad_write_fault_quotes_the_spec(spec, expected):
    with pytest.raises(ValueError, match=expected) as info:
        write_faults.parse_write_fault(spec)
    assert f"fault={spec!r}" in str(info.value)


def test_a_failing_writer_fails_the_nth_matching_write_before_writing(tmp_path):
    writer = write_faults.FailingWriter("EIO:records.jsonl:2")
    other, first, second = (tmp_path / n for n in ("manifest.json", "a.records.jsonl.tmp", "b.records.jsonl.tmp"))
    writer.write(other, b"m")  # no match: written, not counted
    writer.write(first, b"1")  # the first match: written
    with pytest.raises(OSError) as info:
        writer.write(second, b"2")
    assert info.value.errno == errno.EIO and info.value.filename == str(second)
    assert "test-only fault injected by testkit.write_faults:FailingWriter" in str(info.value)
    assert not second.exists() and first.read_bytes() == b"1" and other.read_bytes() == b"m"
    writer.write(second, b"2")  # only the nth fails
    assert second.read_bytes() == b"2"
