"""Coordination library against real control planes on loopback ports."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gym_patches.checkpoint import calls
from gym_patches.checkpoint import coordination as co
from gym_patches.checkpoint.control import ParticipantControlPlane
from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.storage import FileSystemWriter
from gym_patches.checkpoint.identity import EpisodeId, next_attempt
from gym_patches.checkpoint.participant import CheckpointParticipant
from gym_patches.checkpoint.wire import PrepareReport, RenewRequest
from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointAdapter, GymCheckpointInstance

TOKEN = "coord-token-81b2"


class FakeParticipant(CheckpointParticipant):
    """Test-only participant: ``live`` keys block (or are unsaved when
    restart-only under best_effort); ``saved`` is what export returns."""

    def __init__(self, kind: str, log: list[str], name: str, *, restart_only: bool = False):
        super().__init__()
        self.kind = kind  # type: ignore[misc]
        self.log, self.name, self.restart_only = log, name, restart_only
        self.live: set[str] = set()
        self.saved: dict[str, dict] = {}
        self.installed: list[dict] = []
        self.closes = 0
        self.fail_install = False
        self.reopen_after: asyncio.Event | None = None  # open_admission waits for it (a slow resume)
        self.reopened = asyncio.Event()

    async def close_admission(self, policy):
        self.log.append(f"prepare:{self.name}")
        self.closes += 1
        self.accepting = False

    async def open_admission(self):
        if self.reopen_after is not None:
            await self.reopen_after.wait()
        self.log.append(f"resume:{self.name}")
        self.accepting = True
        self.reopened.set()

    def readiness(self):
        if self.accepting:
            return PrepareReport.build([])
        if self.restart_only and self.policy == "best_effort":
            return PrepareReport.build([], unsaved=sorted(self.live))
        return PrepareReport.build(sorted(self.live))

    async def export(self, episodes):
        keys = None if episodes is None else {e.capture_key for e in episodes}
        return [r for k, r in sorted(self.saved.items()) if keys is None or k in keys]

    async def install(self, records):
        if self.fail_install:
            raise CheckpointError(f"{self.name}: fake install refused")
        self.installed.extend(records)
        return [next_attempt(EpisodeId.model_validate(r["episode_id"])).capture_key for r in records]

    async def retire(self, episodes):
        self.log.append(f"retire:{self.name}")
        return await super().retire(episodes)

    def status_extra(self):  # what agents and resources servers report (RL classifies restart-only ones by it)
        if self.kind == "resources":
            return {"mode": "restart_only" if self.restart_only else "exported"}
        return {"restart_only": self.restart_only}


@dataclass(frozen=True)
class InstanceStandIn:
    """Test-only stand-in for one ``ServerClient.instances()`` entry."""

    name: str
    server_type: str
    url: str


class ServerClientStandIn:
    """Test-only stand-in for Gym's ServerClient: just ``instances()`` and ``session``."""

    def __init__(self, instances: list[InstanceStandIn], session: aiohttp.ClientSession):
        self._instances, self.session = instances, session

    def instances(self) -> list[InstanceStandIn]:
        return list(self._instances)


TYPES = {"model": "responses_api_models", "agent": "responses_api_agents", "resources": "resources_servers"}


class Deployment:
    """Real aiohttp servers, each with a control plane around a FakeParticipant."""

    def __init__(self) -> None:
        self.servers: dict[str, TestServer] = {}
        self.fakes: dict[str, FakeParticipant] = {}
        self.planes: dict[str, ParticipantControlPlane] = {}
        self.instances: list[InstanceStandIn] = []
        self.log: list[str] = []
        self.session = aiohttp.ClientSession()

    async def add(self, name: str, kind: str, *, server_type: str | None = None, participant: bool = True,
                  restart_only: bool = False) -> None:
        app = web.Application()
        if participant:
            fake = FakeParticipant(kind, self.log, name, restart_only=restart_only)
            plane = ParticipantControlPlane(fake, instance=name, auth_token=TOKEN, writer=FileSystemWriter())
            plane.install(app)
            self.fakes[name], self.planes[name] = fake, plane
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        self.servers[name] = server
        self.instances.append(InstanceStandIn(name, server_type or TYPES[kind], str(server.make_url("")).rstrip("/")))

    def client(self) -> ServerClientStandIn:
        return ServerClientStandIn(self.instances, self.session)

    async def close(self) -> None:
        await self.session.close()
        for server in self.servers.values():
            await server.close()


@pytest.fixture
async def dep():
    d = Deployment()
    await d.add("policy", "model")
    await d.add("b_agent", "agent")
    await d.add("a_agent", "agent", restart_only=True)
    await d.add("tools", "resources", restart_only=True)
    await d.add("judge", "resources", participant=False)  # no control routes: 404
    yield d
    await d.close()


def deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


def ep(key: str) -> EpisodeId:
    return EpisodeId.from_capture_key(key)


# -- discover -------------------------------------------------------------------
async def test_discover_orders_and_skips_non_participants(dep):
    parts = await co.discover(dep.client(), TOKEN, timeout_s=5)
    assert parts.names == ["policy", "a_agent", "b_agent", "tools"]
    assert [p.kind for p in parts] == ["model", "agent", "agent", "resources"]
    assert [p.name for p in parts.by_kind("agent")] == ["a_agent", "b_agent"]
    a_agent = parts.by_kind("agent")[0]
    assert a_agent.status.phase == "idle" and a_agent.status.model_extra == {"restart_only": True}


async def test_discover_errors_name_the_server(dep):
    with pytest.raises(co.CoordinationFailures, match="policy") as info:
        await co.discover(dep.client(), "wrong-token", timeout_s=5)
    assert set(info.value.failures) == {"policy", "a_agent", "b_agent", "tools"}
    assert all(e.status == 401 and e.code == "unauthorized" for e in info.value.failures.values())
    assert "wrong-token" not in str(info.value)

    await dep.add("odd", "agent", server_type="resources_servers")  # status says agent
    with pytest.raises(co.CoordinationError, match="kind_mismatch") as info:
        await co.discover(dep.client(), TOKEN, timeout_s=5)
    assert info.value.server == "odd"


async def test_discover_unreachable_and_no_model():
    d = Deployment()
    try:
        await d.add("tools", "resources")
        with pytest.raises(co.CoordinationError, match="no_model"):
            await co.discover(d.client(), TOKEN, timeout_s=5)
        d.instances.append(InstanceStandIn("gone", "responses_api_models", "http://127.0.0.1:9"))
        with pytest.raises(co.CoordinationError, match="unreachable") as info:
            await co.discover(d.client(), TOKEN, timeout_s=5)
        assert info.value.server == "gone"
    finally:
        await d.close()


def test_call_timeout_follows_deadline():
    control = co.ControlClient(object(), "t", clock=lambda: 100.0)  # type: ignore[arg-type]
    assert control.timeout_for(130.0) == 35.0
    assert control.timeout_for(50.0) == 5.0


# -- prepare --------------------------------------------------------------------
async def test_prepare_commit_resume_cycle(dep, tmp_path):
    parts = await co.discover(dep.client(), TOKEN)
    dep.fakes["b_agent"].saved["r1"] = {"episode_id": ep("r1").model_dump(), "turn": 3}
    result = await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline()))
    assert result.prepared and result.blockers == {} and result.unsaved == {}
    assert set(result.replies) == {"policy", "a_agent", "b_agent", "tools"}
    assert dep.log.index("prepare:policy") < dep.log.index("prepare:a_agent") < dep.log.index("prepare:tools")
    replies = await co.call(parts, calls.CommitCall(checkpoint_id="c1", deadline_ts=deadline(),
                                                    checkpoint_dir=str(tmp_path), episode_ids=[ep("r1")]))
    assert replies["b_agent"].episode_ids == ["r1"] and replies["policy"].episode_ids == []
    assert all((tmp_path / "gym" / p.kind / p.name / "manifest.json").exists() for p in parts)
    renewed = await co.call(parts, calls.RenewCall(checkpoint_id="c1", deadline_ts=deadline(20)))
    assert all(r.lease_expires_at is not None for r in renewed.values())
    dep.log.clear()
    resumed = await co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline()))
    assert all(not r.idempotent for r in resumed.values())
    assert sorted(dep.log) == sorted(f"resume:{name}" for name in dep.fakes)
    assert all(f.accepting for f in dep.fakes.values())


async def test_resume_reaches_every_server_at_once(dep):
    """The resources server's resume ends only once the model has reopened, and the agents' only once
    the resources server has: in stages (resources, agents, model) this never ends."""
    parts = await co.discover(dep.client(), TOKEN)
    assert (await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline()))).prepared
    fakes = dep.fakes
    fakes["tools"].reopen_after = fakes["policy"].reopened
    fakes["a_agent"].reopen_after = fakes["b_agent"].reopen_after = fakes["tools"].reopened
    dep.log.clear()
    await asyncio.wait_for(co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline(),
                                                           call_timeout_s=5.0)), 8.0)
    assert dep.log[:2] == ["resume:policy", "resume:tools"] and len(dep.log) == 4
    assert all(f.accepting for f in fakes.values()) and all(p.phase == "idle" for p in dep.planes.values())


async def test_prepare_stops_at_first_unprepared_stage(dep):
    parts = await co.discover(dep.client(), TOKEN)
    dep.fakes["a_agent"].live = {"r7", "r8"}
    result = await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline(0.3)))
    assert not result.prepared
    assert result.blockers == {"a_agent": ["r7", "r8"]}
    assert set(result.replies) == {"policy", "a_agent", "b_agent"}
    assert dep.fakes["tools"].closes == 0 and dep.planes["tools"].phase == "idle"
    assert "prepare:tools" not in dep.log
    await co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline()))
    assert all(f.accepting for f in dep.fakes.values())
    assert all(p.phase == "idle" for p in dep.planes.values())
    with pytest.raises(co.CoordinationError, match="stale_checkpoint"):
        await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline()))


async def test_best_effort_reports_unsaved(dep, tmp_path):
    parts = await co.discover(dep.client(), TOKEN)
    dep.fakes["a_agent"].live = {"r1"}
    dep.fakes["tools"].live = {"r1", "r3"}
    dep.fakes["b_agent"].saved["r2"] = {"episode_id": ep("r2").model_dump()}
    result = await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline(),
                                                    restart_only_policy="best_effort"))
    assert result.prepared
    assert result.unsaved == {"a_agent": ["r1"], "tools": ["r1", "r3"]}
    assert result.unsaved_keys() == {"r1", "r3"}
    scope = result.continued([ep("r1"), ep("r2"), ep("r3")])
    assert [e.capture_key for e in scope] == ["r2"]
    replies = await co.call(parts, calls.CommitCall(checkpoint_id="c1", deadline_ts=deadline(),
                                                    checkpoint_dir=str(tmp_path), episode_ids=scope))
    assert replies["b_agent"].episode_ids == ["r2"]
    await co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline()))
    # committing an unsaved rollout is refused by every server that reported it
    assert (await co.call(parts, calls.PrepareCall(checkpoint_id="c2", deadline_ts=deadline(),
                                                   restart_only_policy="best_effort"))).prepared
    with pytest.raises(co.CoordinationFailures, match="restart_in_scope") as info:
        await co.call(parts, calls.CommitCall(checkpoint_id="c2", deadline_ts=deadline(),
                                              checkpoint_dir=str(tmp_path / "c2"), episode_ids=[ep("r1"), ep("r2")]))
    assert set(info.value.failures) == {"a_agent", "tools"}
    await co.call(parts, calls.ResumeCall(checkpoint_id="c2", deadline_ts=deadline()))


# -- restore --------------------------------------------------------------------
async def _checkpoint(dep, parts, tmp_path) -> None:
    for name in ("policy", "b_agent", "tools"):
        for key in ("r1", "r2"):
            dep.fakes[name].saved[key] = {"episode_id": ep(key).model_dump(), "by": name}
    assert (await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline()))).prepared
    await co.call(parts, calls.CommitCall(checkpoint_id="c1", deadline_ts=deadline(), checkpoint_dir=str(tmp_path),
                                          episode_ids=None))
    await co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline()))


async def test_restore_with_per_server_scope(dep, tmp_path):
    parts = await co.discover(dep.client(), TOKEN)
    await _checkpoint(dep, parts, tmp_path)
    scope = {"policy": [ep("r1"), ep("r2")], "b_agent": [ep("r1"), ep("r2")], "tools": [ep("r2")]}
    replies = await co.call(parts, calls.RestoreCall(checkpoint_id="c2", deadline_ts=deadline(),
                                                     checkpoint_dir=str(tmp_path), episode_ids=scope,
                                                     source_checkpoint_id="c1"))
    assert replies["policy"].restored == ["r1-a1", "r2-a1"]
    assert replies["tools"].restored == ["r2-a1"] and replies["a_agent"].restored == []
    assert all(dep.planes[n].phase == "restored" for n in replies)
    await co.call(parts, calls.ResumeCall(checkpoint_id="c2", deadline_ts=deadline()))
    with pytest.raises(ValueError, match="nobody"):
        await co.call(parts, calls.RestoreCall(checkpoint_id="c3", deadline_ts=deadline(), checkpoint_dir=str(tmp_path),
                                               episode_ids={"nobody": []}, source_checkpoint_id="c1"))


async def test_restore_failure_retires_next_attempts_and_resumes(dep, tmp_path):
    parts = await co.discover(dep.client(), TOKEN)
    await _checkpoint(dep, parts, tmp_path)
    dep.fakes["tools"].fail_install = True
    dep.log.clear()
    scope = {"policy": [ep("r1")], "b_agent": [ep("r1")], "tools": [ep("r1")]}
    with pytest.raises(co.CoordinationError, match="fake install refused") as info:
        await co.call(parts, calls.RestoreCall(checkpoint_id="c2", deadline_ts=deadline(), checkpoint_dir=str(tmp_path),
                                               episode_ids=scope, source_checkpoint_id="c1"))
    assert info.value.server == "tools"
    for fake in dep.fakes.values():
        assert fake.retired == {"r1": 1}, fake.name  # next attempt of r1, everywhere
    assert all(p.phase == "idle" for p in dep.planes.values())
    assert dep.log.index("retire:b_agent") < dep.log.index("retire:policy")
    with pytest.raises(co.CoordinationError, match="stale_checkpoint"):  # the failed id is spent
        await co.call(parts, calls.RestoreCall(checkpoint_id="c2", deadline_ts=deadline(), checkpoint_dir=str(tmp_path),
                                               episode_ids=scope, source_checkpoint_id="c1"))


async def test_restore_of_missing_checkpoint_cleans_up(dep, tmp_path):
    parts = await co.discover(dep.client(), TOKEN)
    with pytest.raises(co.CoordinationFailures) as info:
        await co.call(parts, calls.RestoreCall(checkpoint_id="c2", deadline_ts=deadline(), checkpoint_dir=str(tmp_path),
                                               episode_ids=[ep("r1")], source_checkpoint_id="c-none"))
    assert set(info.value.failures) == {"policy", "a_agent", "b_agent", "tools"}
    assert "manifest.json is missing" in str(info.value)
    assert all(f.retired == {"r1": 1} for f in dep.fakes.values())


# -- resume / retire ------------------------------------------------------------
async def test_resume_continues_past_a_dead_server(dep):
    parts = await co.discover(dep.client(), TOKEN)
    assert (await co.call(parts, calls.PrepareCall(checkpoint_id="c1", deadline_ts=deadline()))).prepared
    await dep.servers["b_agent"].close()
    with pytest.raises(co.CoordinationFailures) as info:
        await co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline()))
    assert list(info.value.failures) == ["b_agent"] and "b_agent" in str(info.value)
    for name in ("policy", "a_agent", "tools"):
        assert dep.fakes[name].accepting and dep.planes[name].phase == "idle"


async def test_retire_callers_first(dep):
    parts = await co.discover(dep.client(), TOKEN)
    replies = await co.call(parts, calls.RetireCall(checkpoint_id="c1", deadline_ts=deadline(),
                                                    episode_ids=[ep("r4-a2")]))
    assert all(r.retired == ["r4-a2"] for r in replies.values())
    agent_calls = [i for i, e in enumerate(dep.log) if e in ("retire:a_agent", "retire:b_agent")]
    callee_calls = [i for i, e in enumerate(dep.log) if e in ("retire:policy", "retire:tools")]
    assert max(agent_calls) < min(callee_calls)


async def test_retire_stops_at_failing_stage(dep):
    parts = await co.discover(dep.client(), TOKEN)
    await dep.servers["b_agent"].close()
    with pytest.raises(co.CoordinationError, match="b_agent"):
        await co.call(parts, calls.RetireCall(checkpoint_id="c1", deadline_ts=deadline(), episode_ids=[ep("r1")]))
    assert dep.log == ["retire:a_agent"]  # models and resources were never asked
    with pytest.raises(co.CoordinationFailures) as info:
        await co.call(parts, calls.RetireCall(checkpoint_id="c2", deadline_ts=deadline(), episode_ids=[ep("r2")],
                                              best_effort=True))
    assert list(info.value.failures) == ["b_agent"]
    assert dep.fakes["tools"].retired == {"r2": 0} and dep.fakes["policy"].retired == {"r2": 0}


# -- typed calls: one request per verb, one body per server ----------------------
def _sample_calls() -> list[Any]:
    """One call of each verb with every field set away from its default."""
    scope = {"a_agent": [ep("r1")], "tools": [ep("r2-a1")]}
    base = {"checkpoint_id": "c9", "deadline_ts": deadline()}
    return [
        calls.PrepareCall(**base, restart_only_policy="best_effort", capture=True,
                          policy_overrides={"tools": "block"}),
        calls.RenewCall(**base),
        calls.RetireCall(**base, episode_ids=[ep("r4-a2")], best_effort=True),
        calls.ForgetCall(**base, rollout_ids=["r5"]),
        calls.CommitCall(**base, checkpoint_dir="/ckpt", episode_ids=scope),
        calls.PersistCall(**base, checkpoint_dir="/ckpt", episode_ids=[ep("r3")]),
        calls.RestoreCall(**base, checkpoint_dir="/ckpt", episode_ids=scope, source_checkpoint_id="c8"),
        calls.ResumeCall(**base, call_timeout_s=2.0),
    ]


@pytest.mark.parametrize("call", _sample_calls(), ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("server", ["a_agent", "tools", "policy"])
def test_every_wire_field_of_a_call_reaches_each_servers_body(call, server):
    body = call.body_for(server)
    assert type(body) is call.wire  # the server's own request model: no client-only field on the wire
    if isinstance(call, calls.PrepareCall):
        per_server = {"restart_only_policy": (call.policy_overrides or {}).get(server, call.restart_only_policy)}
    elif isinstance(call, (calls.CommitCall, calls.PersistCall, calls.RestoreCall)):
        per_server = {"episode_ids": call.scope_for(server)}
    else:
        per_server = {}
    assert body == call.wire(**({name: getattr(call, name) for name in call.wire.model_fields} | per_server))
    assert set(call.wire.model_fields) <= set(type(call).model_fields)  # a wire field is a call field for free


def test_per_server_fields_pick_each_servers_part():
    prepare, _, _, _, commit, persist, restore, _ = _sample_calls()
    assert prepare.body_for("tools").restart_only_policy == "block"
    assert prepare.body_for("a_agent").restart_only_policy == "best_effort"
    assert commit.body_for("tools").episode_ids == [ep("r2-a1")]
    assert commit.body_for("policy").episode_ids == []  # a server the mapping leaves out gets nothing
    assert calls.CommitCall(checkpoint_id="c", deadline_ts=deadline(), checkpoint_dir="/d").body_for("x") \
        .episode_ids is None  # None: everything the server can export
    assert persist.body_for("policy").episode_ids == [ep("r3")]  # one list: every server
    assert restore.servers_named() == {"a_agent", "tools"} and prepare.servers_named() == {"tools"}
    assert prepare.replace(capture=False).capture is False and prepare.capture is True
    with pytest.raises(ValueError, match="policy_overrides"):
        prepare.replace(policy_overrides={"tools": "sometimes"})
    with pytest.raises(ValueError, match="Extra inputs"):
        calls.RenewCall(checkpoint_id="c", deadline_ts=deadline(), capture=True)


async def test_call_runs_a_typed_request_and_checks_the_servers_it_names(dep, tmp_path):
    parts = await co.discover(dep.client(), TOKEN)
    dep.fakes["a_agent"].live = {"r1"}
    prepared = await co.call(parts, calls.PrepareCall(
        checkpoint_id="c1", deadline_ts=deadline(), policy_overrides={"a_agent": "best_effort"}))
    assert prepared.prepared and prepared.unsaved == {"a_agent": ["r1"]}
    dep.fakes["b_agent"].saved["r2"] = {"episode_id": ep("r2").model_dump()}
    replies = await co.call(parts, calls.CommitCall(checkpoint_id="c1", deadline_ts=deadline(),
                                                    checkpoint_dir=str(tmp_path), episode_ids={"b_agent": [ep("r2")]}))
    assert replies["b_agent"].episode_ids == ["r2"] and replies["policy"].episode_ids == []
    with pytest.raises(ValueError, match=r"commit episode_ids names servers that are not participants: \['nobody'\]"):
        await co.call(parts, calls.CommitCall(checkpoint_id="c1", deadline_ts=deadline(),
                                              checkpoint_dir=str(tmp_path), episode_ids={"nobody": []}))
    with pytest.raises(TypeError, match="not a checkpoint call: RenewRequest"):
        await co.call(parts, RenewRequest(checkpoint_id="c1", deadline_ts=deadline()))
    await co.call(parts, calls.ResumeCall(checkpoint_id="c1", deadline_ts=deadline(), call_timeout_s=2.0))
    assert all(p.phase == "idle" for p in dep.planes.values())


# -- RL's adapter: the actor's one checkpoint entry, without Ray --------------------
async def test_the_adapter_answers_each_call_in_rl_terms(dep, tmp_path):
    adapter = GymCheckpointAdapter(GymCheckpointInstance("shard", 1), dep.client(), TOKEN)
    assert await adapter.discover(timeout_s=5) == ["a_agent", "tools"]
    for name in ("policy", "b_agent", "tools"):
        dep.fakes[name].saved["r1"] = {"episode_id": ep("r1").model_dump()}
    target = adapter.instance.checkpoint_dir(tmp_path)
    base = {"checkpoint_id": "c1", "deadline_ts": deadline()}
    assert isinstance(await adapter.checkpoint(calls.PrepareCall(**base)), co.PrepareResult)
    probes = await adapter.checkpoint(calls.ProbeCall(timeout_s=2.0))
    assert set(probes) == set(adapter.participants.names) and all(p.answered for p in probes.values())
    assert probes["policy"].detail == "phase prepared, 0 blocking"
    summary = await adapter.checkpoint(calls.CommitCall(
        **base, checkpoint_dir=str(target), episode_ids={"policy": [ep("r1")], "b_agent": [ep("r1")]}))
    assert target.is_dir() and summary.checkpoint_dir == str(target)  # the directory is made before the write
    assert summary.exported_by_server == {"policy": ["r1"], "a_agent": [], "b_agent": ["r1"], "tools": []}
    assert summary.agent_exported == ["r1"] and summary.episodes_for("b_agent") == [ep("r1")]
    assert await adapter.checkpoint(calls.ResumeCall(**base)) is None
    restored = await adapter.checkpoint(calls.RestoreCall(
        checkpoint_id="r-1", deadline_ts=deadline(), checkpoint_dir=str(target), source_checkpoint_id="c1",
        episode_ids={name: summary.episodes_for(name) for name in ("policy", "b_agent")}))
    assert restored == ["r1-a1"]  # the agents' new keys
    await adapter.checkpoint(calls.ResumeCall(checkpoint_id="r-1", deadline_ts=deadline()))
    assert await adapter.checkpoint(calls.RetireCall(checkpoint_id="t-1", deadline_ts=deadline(),
                                                     episode_ids=[ep("r7")])) is None
    assert await adapter.checkpoint(calls.ForgetCall(checkpoint_id="f-1", deadline_ts=deadline(),
                                                     rollout_ids=["r7"])) == 4  # its retired mark, on each server
    with pytest.raises(RuntimeError, match=r"shard/replica-1: restore names Gym servers this deployment does not "
                                           r"have: \['gone'\]"):
        await adapter.checkpoint(calls.RestoreCall(
            checkpoint_id="r-2", deadline_ts=deadline(), checkpoint_dir=str(target), source_checkpoint_id="c1",
            episode_ids={"gone": [ep("r1")]}))
