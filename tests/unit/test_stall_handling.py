"""Stalls without sockets: the ``async_rl`` keys, the watchdog, the cut without left-out replicas,
replica health, and the coordination calls that must not wait on a hung server (real loopback
HTTP servers that never answer, built here to isolate the client)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from gym_patches.checkpoint import coordination as co
from gym_patches.checkpoint.calls import ProbeCall, ResumeCall
from gym_patches.checkpoint.wire import StatusReply
from gym_patches.wire_models import AgentActivity, RunActivity
from nemo_rl.algorithms.single_controller_utils.config import ConfigError, StallWatchdogConfig, load_config
from nemo_rl.algorithms.single_controller_utils.rollout_snapshot.planner import plan_snapshot
from testkit.snapshot_checks import check_ownership_now, count_snapshot_now
from nemo_rl.algorithms.single_controller_utils.stall_watchdog import (
    RolloutStallError,
    StallWatchdog,
    describe_stall,
    latest_call_start,
)
from nemo_rl.environments.gym_checkpoint_adapter import GymCheckpointInstance
from nemo_rl.environments.nemo_gym import NemoGymShardSet
from nemo_rl.experience.rollout_recovery import RolloutRecoveryLedger


# ----------------------------------------------------------------------------- config
def test_async_rl_defaults_follow_upstream_names():
    cfg = load_config(None)
    assert cfg.async_rl.rollout_failure.max_infra_attempts_per_prompt == 3
    assert cfg.async_rl.rollout_failure.nemo_gym.rollout_timeout_s == 1800.0
    assert cfg.async_rl.stall_watchdog.stall_action == "warn"
    assert cfg.rollout_recovery.gym_park_grace_s == 1.5
    cfg = load_config(None, ["async_rl.stall_watchdog.stall_action=abort",
                             "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=120"])
    assert cfg.async_rl.stall_watchdog.stall_action == "abort"
    assert cfg.async_rl.rollout_failure.nemo_gym.rollout_timeout_s == 120


@pytest.mark.parametrize("override, named", [
    ("async_rl.stall_watchdog.stall_action=explode", "async_rl.stall_watchdog.stall_action"),
    ("async_rl.rollout_failure.nemo_gym.rollout_timeout_s=0", "async_rl.rollout_failure.nemo_gym.rollout_timeout_s"),
    ("async_rl.rollout_failure.max_infra_attempts_per_prompt=0",
     "async_rl.rollout_failure.max_infra_attempts_per_prompt"),
    ("async_rl.stall_watchdog.stall_timeout_s=1", "async_rl.stall_watchdog.stall_timeout_s"),
    ("rollout_recovery.gym_park_grace_s=-1", "rollout_recovery.gym_park_grace_s"),
    ("++async_rl.stall_watchdog.stall_timeout=3", "async_rl.stall_watchdog.stall_timeout"),
])
def test_bad_async_rl_keys_are_named(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert named in str(err.value)


# ----------------------------------------------------------------------------- watchdog
def _activity(agent: str, *runs: tuple[str, str, str | None, float]) -> AgentActivity:
    return AgentActivity(agent=agent, runs=[RunActivity(capture_key=k, phase=p, server=s, since_s=t)
                                            for k, p, s, t in runs])


def test_describe_stall_names_replica_phase_server_and_silent_agents():
    report = {
        "nemo_gym/replica-0": {"agent": _activity("agent", ("r1", "tool_call", "workplace_assistant", 240.0),
                                                  ("r2", "tool_call", "workplace_assistant", 239.0))},
        "nemo_gym/replica-1": {"agent": "no reply within 2s"},
    }
    text = describe_stall(report, 241.0)
    assert text.startswith("no rollout progressed for 241 s")
    assert "nemo_gym/replica-0: 2 rollouts in a tool call to 'workplace_assistant' (oldest 240 s" in text
    assert "r1" in text and "r2" in text
    assert "nemo_gym/replica-1: agent 'agent' did not answer: no reply within 2s" in text
    assert latest_call_start(report, now=1000.0) == 1000.0 - 239.0


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeGymActivity:
    """Stands in for the replicas' activity calls (isolates the watchdog's logic; named as a fake)."""

    def __init__(self, clock: _Clock):
        self.clock, self.started = clock, 0.0  # when the newest call began

    async def __call__(self):
        since = self.clock.t - self.started
        return {"r0": {"agent": _activity("agent", ("k", "tool_call", "tools", since))}}


async def _drive(watchdog: StallWatchdog, clock: _Clock, steps: int, on_step=None):
    """Advance the fake clock one interval per loop of the real ``run``; stop after ``steps``."""
    sleeps = 0
    real_sleep = asyncio.sleep

    async def fake_sleep(_s):
        nonlocal sleeps
        sleeps += 1
        clock.t += watchdog.settings.interval_s
        if on_step:
            on_step(sleeps)
        if sleeps > steps:
            raise asyncio.CancelledError
        await real_sleep(0)

    import nemo_rl.algorithms.single_controller_utils.stall_watchdog as mod

    mod.asyncio.sleep, saved = fake_sleep, mod.asyncio.sleep
    try:
        await watchdog.run()
    except asyncio.CancelledError:
        pass
    finally:
        mod.asyncio.sleep = saved


async def test_watchdog_aborts_when_no_call_begins_and_nothing_seals():
    clock = _Clock()
    gym = FakeGymActivity(clock)
    dog = StallWatchdog(StallWatchdogConfig(interval_s=1, stall_timeout_s=5, stall_action="abort"),
                        in_flight=lambda: 3, transitions=lambda: 0, activity=gym, clock=clock)
    with pytest.raises(RolloutStallError) as err:
        await _drive(dog, clock, steps=20)
    assert "tool call to 'tools'" in str(err.value) and "r0" in str(err.value)
    assert 5 <= clock.t <= 7


async def test_watchdog_sees_progress_in_new_calls_and_transitions():
    clock = _Clock()
    gym = FakeGymActivity(clock)
    transitions = {"n": 0}

    def step(i):  # a new call begins every 3 s, a rollout seals every 4 s: never 5 s without progress
        if i % 3 == 0:
            gym.started = clock.t
        if i % 4 == 0:
            transitions["n"] += 1

    dog = StallWatchdog(StallWatchdogConfig(interval_s=1, stall_timeout_s=5, stall_action="abort"),
                        in_flight=lambda: 3, transitions=lambda: transitions["n"], activity=gym, clock=clock)
    await _drive(dog, clock, steps=30, on_step=step)  # no RolloutStallError


async def test_watchdog_warns_once_per_timeout_and_ignores_idle_time(caplog):
    clock = _Clock()
    gym = FakeGymActivity(clock)
    busy = {"n": 0}
    dog = StallWatchdog(StallWatchdogConfig(interval_s=1, stall_timeout_s=4, stall_action="warn"),
                        in_flight=lambda: busy["n"], transitions=lambda: 0, activity=gym, clock=clock)
    await _drive(dog, clock, steps=10)  # nothing in flight: no stall however long
    assert dog.stalls_reported == 0
    busy["n"] = 2
    await _drive(dog, clock, steps=13)
    assert dog.stalls_reported == 3  # at 4, 8 and 12 s of the stall
    assert "stall_action=warn" in caplog.text


# ----------------------------------------------------------------------------- the cut
def _ledger_with_rollouts_on(iids: list[str]) -> RolloutRecoveryLedger:
    ledger = RolloutRecoveryLedger()
    for i, iid in enumerate(iids):
        group = ledger.reserve_group(f"s1p{i}", f"p{i}", i, None, "agent", "turn", 2, 1, position=i)
        for sibling in group.siblings:
            ledger.mark_dispatched(sibling.current_attempt.rollout_id(group.group_id, sibling.generation_index), iid)
    return ledger


def test_a_left_out_replica_gets_no_scope_and_its_rollouts_are_counted_apart():
    ledger = _ledger_with_rollouts_on(["g/replica-0", "g/replica-1"])
    plan = plan_snapshot(ledger, ["g/replica-0"], {}, left_out=["g/replica-1"])
    assert plan.instance_ids == ("g/replica-0",) and plan.left_out == ("g/replica-1",)
    assert len(plan.scope["g/replica-0"]) == 2 and "g/replica-1" not in plan.scope
    exported = {"g/replica-0": set(plan.scope["g/replica-0"])}
    owned = check_ownership_now(ledger, plan, exported)  # rollouts of the left-out replica are not strays
    assert len(owned["g/replica-1"]) == 2
    counts = count_snapshot_now(ledger, plan, exported, owned=owned)
    assert (counts.saved, counts.unsaved) == (2, 0)
    with pytest.raises(Exception, match="not in the live topology"):
        plan_snapshot(ledger, ["g/replica-0"], {})  # without saying it left, a replica's rollouts are an error


# ----------------------------------------------------------------------------- replica health
def test_new_rollouts_pass_over_an_unhealthy_replica_while_the_shard_has_a_healthy_one():
    instances = {f"s/replica-{i}": GymCheckpointInstance("s", i) for i in range(2)}
    shards = NemoGymShardSet(handles={"s": [object(), object()]}, instances=instances, agent_shards={"a": "s"})
    assert {shards.pick_instance("a") for _ in range(4)} == {"s/replica-0", "s/replica-1"}
    shards.mark_unhealthy("s/replica-1", "a tool call to 'tools' timed out")
    assert {shards.pick_instance("a") for _ in range(6)} == {"s/replica-0"}
    shards.mark_unhealthy("s/replica-0", "it too")
    assert {shards.pick_instance("a") for _ in range(4)} == {"s/replica-0", "s/replica-1"}  # both: spread
    shards.mark_healthy("s/replica-0")
    shards.mark_healthy("s/replica-1")
    assert {shards.pick_instance("a") for _ in range(4)} == {"s/replica-0", "s/replica-1"}


# ----------------------------------------------------------------------------- hung servers
@pytest.fixture
async def hung_and_healthy():
    """Two control-route servers on loopback: 'hung' accepts and never answers, 'ok' answers."""
    never = asyncio.Event()
    seen: list[str] = []

    async def hang(request: web.Request) -> web.Response:
        seen.append(f"hung {request.path.rsplit('/', 1)[-1]}")
        await never.wait()
        return web.json_response({})

    async def ok_status(_):
        return web.json_response(StatusReply(kind="agent", instance="ok", phase="preparing",
                                             checkpoint_id="c", lease_expires_at=None,
                                             report={"ready": False, "blockers": ["k1"], "blocker_count": 1,
                                                     "unsaved": [], "counts": {}}).model_dump(mode="json"))

    async def ok_resume(request: web.Request):
        seen.append("ok resume")
        return web.json_response({"phase": "idle", "idempotent": False})

    runners, urls = [], {}
    for name, routes in (("hung", [web.get("/ng-control/v1/checkpoint/status", hang),
                                   web.post("/ng-control/v1/checkpoint/resume", hang)]),
                         ("ok", [web.get("/ng-control/v1/checkpoint/status", ok_status),
                                 web.post("/ng-control/v1/checkpoint/resume", ok_resume)])):
        app = web.Application()
        app.add_routes(routes)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls[name] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    session = aiohttp.ClientSession()
    control = co.ControlClient(session, "tok")
    dummy = StatusReply(kind="agent", instance="x", phase="idle", checkpoint_id=None, lease_expires_at=None,
                        report={"ready": True, "blockers": [], "blocker_count": 0, "unsaved": [], "counts": {}})
    parts = co.Participants([co.Participant("hung", "resources", urls["hung"], dummy),
                             co.Participant("ok", "agent", urls["ok"], dummy)], control)
    try:
        yield parts, seen
    finally:
        never.set()
        await session.close()
        for runner in runners:
            await runner.cleanup()


async def test_probe_tells_a_silent_server_from_a_slow_one(hung_and_healthy):
    parts, _ = hung_and_healthy
    t0 = time.monotonic()
    probes = await co.call(parts, ProbeCall(timeout_s=0.5))
    assert time.monotonic() - t0 < 2.0
    assert isinstance(probes["hung"], co.CoordinationError) and probes["hung"].code == "timeout"
    assert "'hung'" in str(probes["hung"])
    assert isinstance(probes["ok"], StatusReply) and probes["ok"].report.blocker_count == 1


async def test_resume_with_a_call_timeout_reopens_the_others_past_a_hung_server(hung_and_healthy):
    parts, seen = hung_and_healthy
    t0 = time.monotonic()
    with pytest.raises(co.CoordinationError) as err:
        await co.call(parts, ResumeCall(checkpoint_id="c1", deadline_ts=time.time() + 300, call_timeout_s=0.5))
    assert time.monotonic() - t0 < 3.0  # not the 300 s deadline
    assert "'hung'" in str(err.value) and "resume took over 0.5s" in str(err.value)
    assert seen == ["hung resume", "ok resume"]  # resources first, then the agent: it still reopened


class SlowReplicaShardSet:
    """A fake of ``NemoGymShardSet``'s checkpoint side (isolates the coordinator's prepare loop from
    Ray and the servers): one replica whose prepare takes ``prepare_s`` while every server answers
    each status probe at once; it records every request the coordinator sends."""

    recovering: set[str] = set()  # no replica is being recovered in-run
    control_handles: dict[str, object] = {}  # calls go through ``send_checkpoint``

    def __init__(self, prepare_s: float):
        self.prepare_s = prepare_s
        self.sent: list[object] = []
        self.restart_only_servers: dict[str, list[str]] = {}
        self.prepare_policy_overrides: dict[str, dict] = {}
        self.unhealthy: dict[str, str] = {}

    @property
    def instance_ids(self) -> list[str]:
        return ["nemo_gym/replica-0"]

    def mark_unhealthy(self, iid: str, why: str) -> None:
        self.unhealthy[iid] = why

    def send_checkpoint(self, iid: str, request):
        from gym_patches.checkpoint.calls import PrepareCall, ProbeCall
        from gym_patches.checkpoint.coordination import PrepareResult
        from nemo_rl.environments.gym_checkpoint_adapter import GymServerProbe

        self.sent.append(request)

        async def answer():
            if isinstance(request, PrepareCall):
                await asyncio.sleep(self.prepare_s)
                return PrepareResult(prepared=True)
            assert isinstance(request, ProbeCall), f"not a checkpoint request: {request!r}"
            return {"agent": GymServerProbe(True, "phase preparing, 3 blocking", 3, ["r1", "r2", "r3"])}

        return answer()


async def test_a_slow_replica_that_answers_every_probe_is_probed_again_and_stays_in(monkeypatch):
    """A replica busy for several probe periods (a burst of /run calls) is probed every
    ``PROBE_EVERY_S`` with the same typed request, and its prepare counts when it answers."""
    from gym_patches.checkpoint.calls import ProbeCall
    from nemo_rl.algorithms.single_controller_utils import gym_coordinator as gc

    monkeypatch.setattr(gc, "PROBE_AFTER_S", 0.1)
    monkeypatch.setattr(gc, "PROBE_EVERY_S", 0.3)
    shards = SlowReplicaShardSet(prepare_s=1.2)
    coordinator = gc.GymCheckpointCoordinator(shards, prepare_timeout_s=10.0, restart_only_policy="block")
    left_out: dict[str, str] = {}
    leavers: dict[str, asyncio.Task] = {}
    results = await coordinator._prepare_replicas("c1", ["nemo_gym/replica-0"], time.time() + 10.0, gc.PrepareAsk(),
                                                  left_out, leavers, {})
    probes = [r for r in shards.sent if not hasattr(r, "restart_only_policy")]
    assert len(probes) >= 2 and all(type(p) is ProbeCall and p.timeout_s == 1.5 for p in probes)
    assert results["nemo_gym/replica-0"].prepared and left_out == {} and leavers == {}
    assert shards.unhealthy == {}
