"""Hung-server detection, the pieces: the agents' call-timeout keys, the activity
board, the summary a person reads, and ``ServerLoopIO``'s errors against small
in-process HTTP servers (one that hangs, one that fails, a port with nobody)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
from aiohttp import web

from gym_patches.activity import ActivityBoard, group_runs, summary_lines
from gym_patches.config import GymConfigError, ServerInstanceConfig, parse_gym_config
from gym_patches.responses_api_agents.loop import LoopAgentConfig, LoopError, ServerLoopIO, UpstreamTimeout
from gym_patches.responses_api_agents.plain_loop_agent.app import PlainLoopAgent
from gym_patches.responses_api_agents.simple_agent.app import SimpleAgent
from gym_patches.server_utils import ServerClient
from gym_patches.utils.processes import free_port
from gym_patches.wire_models import AgentActivity, RunActivity, RunErrorBody

REFS = {"model_server": {"type": "responses_api_models", "name": "policy_model"},
        "resources_server": {"type": "resources_servers", "name": "tools"}}


# -- config -------------------------------------------------------------------------------------
def test_call_timeouts_default_to_long_model_and_shorter_resources_calls():
    cfg = LoopAgentConfig(**REFS)
    assert (cfg.model_call_timeout_s, cfg.resources_call_timeout_s) == (1800.0, 300.0)
    cfg = LoopAgentConfig(**REFS, model_call_timeout_s=90, resources_call_timeout_s=0.5)
    assert (cfg.model_call_timeout_s, cfg.resources_call_timeout_s) == (90.0, 0.5)


@pytest.mark.parametrize("server_cls", [SimpleAgent, PlainLoopAgent])
@pytest.mark.parametrize("key", ["model_call_timeout_s", "resources_call_timeout_s"])
@pytest.mark.parametrize("value, message", [
    (0, "Input should be greater than 0"),
    (-5, "Input should be greater than 0"),
    (math.inf, "Input should be a finite number"),
    (math.nan, "Input should be a finite number"),
    (True, "Input should be a valid number"),
    ("300", "Input should be a valid number"),
    (None, "Input should be a valid number"),
])
def test_bad_call_timeouts_are_named_by_key(server_cls, key, value, message):
    impl = "simple_agent" if server_cls is SimpleAgent else "plain_loop_agent"
    inst = ServerInstanceConfig(name="agent_a", server_type="responses_api_agents", implementation=impl,
                                config={**REFS, key: value})
    with pytest.raises(GymConfigError) as info:
        server_cls.validate_instance_config(inst)
    assert str(info.value) == f"agent_a.responses_api_agents.{impl}: {key}: {message}", str(info.value)


# -- the board ----------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_board_shows_each_run_in_its_current_call_and_forgets_it_when_done():
    clock = Clock()
    board = ActivityBoard("agent_a", clock)
    with board.track("r1") as r1, board.track("r2") as r2:
        r1.enter("seeding", "tools")
        clock.now += 3
        r2.enter("tool_call", "tools", "lookup")
        clock.now += 1
        assert board.snapshot() == AgentActivity(agent="agent_a", runs=[
            RunActivity(capture_key="r1", phase="seeding", server="tools", since_s=4.0),
            RunActivity(capture_key="r2", phase="tool_call", server="tools", tool="lookup", since_s=1.0),
        ])
        r1.leave()
        clock.now += 0.5
        snap = board.snapshot().runs  # longest in its phase first
        assert [(r.capture_key, r.phase, r.server, r.since_s) for r in snap] == [
            ("r2", "tool_call", "tools", 1.5), ("r1", "between_calls", None, 0.5)]
    assert board.snapshot().runs == [] and len(board) == 0


def test_board_entries_go_on_error_and_runs_sharing_a_key_do_not_hide_each_other():
    board = ActivityBoard("a", Clock())
    with pytest.raises(RuntimeError):
        with board.track("r1"):
            raise RuntimeError("boom")
    assert len(board) == 0
    with board.track("dup") as first:
        with board.track("dup") as second:
            second.enter("model_call", "m")
            assert sorted(r.phase for r in board.snapshot().runs) == ["between_calls", "model_call"]
        assert [r.phase for r in board.snapshot().runs] == ["between_calls"]
        first.enter("verify", "tools")
        assert [r.phase for r in board.snapshot().runs] == ["verify"]


# -- the summary --------------------------------------------------------------------------------
def _run(key: str, phase: str, server: str | None, since_s: float, tool: str | None = None) -> RunActivity:
    return RunActivity(capture_key=key, phase=phase, server=server, tool=tool, since_s=since_s)


ACTIVITIES: dict[str, AgentActivity | str] = {
    "wp_agent": AgentActivity(agent="wp_agent", runs=[
        _run("a1", "tool_call", "workplace_assistant", 240.2, "email_send"),
        _run("a2", "model_call", "policy_model", 3.0),
        _run("a3", "tool_call", "workplace_assistant", 12.0, "tasks_update"),
        _run("a4", "between_calls", None, 0.2),
    ]),
    "plain_agent": AgentActivity(agent="plain_agent", runs=[
        _run("p1", "tool_call", "workplace_assistant", 241.0, "email_send"),
        _run("p2", "seeding", "sandbox", 1.04),
    ]),
    "sb_agent": "no reply within 2s",
    "idle_agent": AgentActivity(agent="idle_agent"),
}


def test_runs_are_grouped_by_phase_and_server_longest_waiting_first():
    groups = group_runs(ACTIVITIES)
    assert [(g.phase, g.server, g.count, g.oldest_s) for g in groups] == [
        ("tool_call", "workplace_assistant", 3, 241.0),
        ("model_call", "policy_model", 1, 3.0),
        ("seeding", "sandbox", 1, 1.04),
        ("between_calls", "wp_agent", 1, 0.2),
    ]
    tools = groups[0]
    assert tools.capture_keys == ["p1", "a1", "a3"]  # longest waiting first
    assert tools.agents == ["wp_agent", "plain_agent"] and tools.tools == ["email_send", "tasks_update"]


def test_summary_lines_name_silent_agents_then_each_group():
    assert summary_lines(ACTIVITIES) == [
        "agent 'sb_agent' did not answer: no reply within 2s",
        "3 rollouts in a tool call to 'workplace_assistant' (oldest 241 s, tools: email_send, tasks_update)",
        "1 rollout in a model call to 'policy_model' (oldest 3.0 s)",
        "1 rollout seeding a session on 'sandbox' (oldest 1.0 s)",
        "1 rollout between calls in agent 'wp_agent' (oldest 0.2 s)",
    ]
    assert summary_lines(ACTIVITIES, older_than_s=10, max_keys=2) == [
        "agent 'sb_agent' did not answer: no reply within 2s",
        "3 rollouts in a tool call to 'workplace_assistant' (oldest 241 s, tools: email_send, tasks_update): "
        "p1, a1 and 1 more",
    ]
    assert summary_lines({"idle_agent": AgentActivity(agent="idle_agent")}) == []


def test_run_error_body_reads_the_old_shape_and_the_new():
    old = RunErrorBody.model_validate({"error": {"code": "admission_closed", "detail": "closed"}})
    assert old.error.server is None
    new = RunErrorBody.model_validate({"error": {"code": "upstream_timeout", "detail": "d", "server": "tools"}})
    assert new.error.server == "tools"


# -- ServerLoopIO against real (in-process) servers -----------------------------------------------
class Upstreams:
    """A resources server whose tool hangs or fails, and a model server that hangs."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> "Upstreams":
        async def hang(_: web.Request) -> web.Response:
            await self.release.wait()
            return web.json_response({"output": "late"})

        async def fail(_: web.Request) -> web.Response:
            return web.json_response({"error": {"code": "internal_error", "detail": "sandbox died"}}, status=500)

        app = web.Application()
        app.router.add_post("/slow_tool", hang)
        app.router.add_post("/bad_tool", fail)
        app.router.add_post("/seed_session", fail)
        app.router.add_post("/ng-rollout/r1/v1/responses", hang)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def upstreams():
    servers = await Upstreams().start()
    yield servers
    await servers.stop()


def _io(resources_port: int, model_port: int, **kw: Any) -> ServerLoopIO:
    cfg = parse_gym_config({
        "tools": {"resources_servers": {"workplace_assistant": {"host": "127.0.0.1", "port": resources_port}}},
        "policy_model": {"responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": model_port}}},
    })
    return ServerLoopIO(ServerClient(cfg), "policy_model", "tools", **kw)


async def test_a_hung_tool_call_times_out_naming_server_route_and_setting(upstreams):
    io = _io(upstreams.port, upstreams.port, resources_call_timeout_s=0.3)
    board = ActivityBoard("agent_a")
    try:
        with board.track("r1") as run:
            call = asyncio.create_task(io.for_run(run).call_tool("slow_tool", {}, {}))
            await asyncio.sleep(0.1)
            (seen,) = board.snapshot().runs
            assert (seen.phase, seen.server, seen.tool) == ("tool_call", "tools", "slow_tool")
            started = time.monotonic()
            with pytest.raises(UpstreamTimeout) as info:
                await call
            assert time.monotonic() - started < 1.0
            assert board.snapshot().runs[0].phase == "between_calls"  # the call is over, the run is not
    finally:
        await io.client.close()
    exc = info.value
    assert (exc.server, exc.route, exc.timeout_s) == ("tools", "/slow_tool", 0.3)
    assert str(exc) == "Gym server 'tools' did not answer POST /slow_tool within 0.3s (resources_call_timeout_s)"


async def test_a_hung_model_call_times_out_on_the_model_timeout(upstreams):
    io = _io(upstreams.port, upstreams.port, model_call_timeout_s=0.2, resources_call_timeout_s=30)
    try:
        with pytest.raises(UpstreamTimeout) as info:
            await io.call_model("r1", {"input": "hi"})
    finally:
        await io.client.close()
    assert info.value.server == "policy_model"
    assert str(info.value).endswith("within 0.2s (model_call_timeout_s)")


async def test_failed_and_refused_calls_name_their_server(upstreams):
    io = _io(upstreams.port, free_port())  # nothing listens on the model's port
    try:
        with pytest.raises(LoopError) as failed:
            await io.call_tool("bad_tool", {}, {})
        with pytest.raises(LoopError) as refused:
            await io.call_model("r1", {"input": "hi"})
    finally:
        await io.client.close()
    assert type(failed.value) is LoopError and failed.value.server == "tools"
    assert str(failed.value).startswith("Gym server 'tools' /bad_tool returned 500: ")
    assert type(refused.value) is LoopError and refused.value.server == "policy_model"
    assert "Gym server 'policy_model' /ng-rollout/r1/v1/responses returned 0: connection failed" in str(refused.value)


async def test_run_answers_502_upstream_error_naming_the_failed_server(upstreams):
    """The agent's own ``/run`` route: a resources server that answers 500 to the seed."""
    gym = parse_gym_config({
        "tools": {"resources_servers": {"workplace_assistant": {"host": "127.0.0.1", "port": upstreams.port}}},
        "policy_model": {"responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": upstreams.port}}},
        "agent_a": {"responses_api_agents": {"plain_loop_agent": REFS}},
    })
    agent = PlainLoopAgent(gym.instances["agent_a"], gym)
    runner = web.AppRunner(agent.build_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = ServerClient(parse_gym_config({"agent_a": {"responses_api_agents": {"plain_loop_agent": {
        "host": "127.0.0.1", "port": port}}}}))
    try:
        row = {"responses_create_params": {"input": "hi"}, "_ng_rollout_id": "r9"}
        resp = await client.post("agent_a", "/run", json=row, timeout_s=10)
        bad = await client.post("agent_a", "/run", json={"responses_create_params": {"input": "hi"}}, timeout_s=10)
    finally:
        await client.close()
        await runner.cleanup()
    assert resp.status == 502, resp.text
    error = RunErrorBody.model_validate(resp.body).error
    assert (error.code, error.server) == ("upstream_error", "tools")
    assert error.detail.startswith("agent_a: Gym server 'tools' /seed_session returned 500: "), error.detail
    assert bad.status == 400 and RunErrorBody.model_validate(bad.body).error.server == "agent_a"  # its own error
