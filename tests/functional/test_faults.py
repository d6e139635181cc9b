"""Faults and bad input, with real processes, real Ray and real HTTP on 127.0.0.1.

1. the controller is SIGKILLed while Gym is prepared: the deployment reopens
   itself when the lease ends, and a new controller's prepare/commit works;
2. a Gym server process dies mid-rollout: the run stops, naming the dead
   server, instead of hanging; nothing of it is left running;
3. control-plane input on a real Gym server: oversized lists, wrong types, and
   the token never in an error body or a server log;
4. setup input: a status reply that cannot be classified, a server that does
   not answer, a config key that does not exist or has the wrong type;
5. the test-only crash hook kills the whole process group (and only that).

Torn and corrupt snapshots are in ``test_crash_matrix.py``, on a crashed run's checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_patches.checkpoint import coordination as co
from gym_patches.checkpoint.calls import CommitCall, PrepareCall, ResumeCall
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.wire import CHECKPOINT_ROUTE_PREFIX, MAX_EPISODES_PER_REQUEST, RetireRequest
from gym_patches.config import parse_gym_config
from gym_patches.launch import GymDeployment
from gym_patches.server_utils import ServerClient
from gym_patches.fakes.scripted_backend import ScriptedBackend, first_user_text
from gym_patches.utils.processes import free_port
from nemo_rl.environments.gym_checkpoint_adapter import (
    GymCheckpointAdapter,
    GymCheckpointInstance,
    GymStatusError,
)
from gym_patches.checkpoint.coordination import CoordinationError
from tests.functional.rl_run import wait_for_no_processes, load_crash_matrix
from testkit.run_harness import gym_server_pid

pytestmark = [pytest.mark.functional, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "run_grpo.py"
TOKEN = "faults-tok-5b1e9d2c7f"


cm = load_crash_matrix()


# =============================================================================== 1. lease
def _workplace_rows(n: int) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (REPO / "examples/data/workplace_train.jsonl").read_text().splitlines() if x]
    users = [first_user_text(r) for r in rows]
    unique = [r for r, u in zip(rows, users) if users.count(u) == 1]
    return unique[:n]


def _small_gym(backend_url: str, lease_grace_s: float) -> dict[str, Any]:
    refs = {"model_server": {"type": "responses_api_models", "name": "policy_model"},
            "resources_server": {"type": "resources_servers", "name": "workplace"}}
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": lease_grace_s},
        "policy_base_url": backend_url,
        "policy_model": {"responses_api_models": {"vllm_model": {"request_timeout_s": 30}}},
        "workplace": {"resources_servers": {"workplace_assistant": {}}},
        "agent": {"responses_api_agents": {"simple_agent": refs}},
    }


CONTROLLER = textwrap.dedent("""
    import asyncio, sys, time
    from gym_patches.checkpoint import coordination as co
    from gym_patches.checkpoint.calls import PrepareCall, RenewCall
    from gym_patches.server_utils import ServerClient

    async def main(head, token, deadline_s):
        client = await ServerClient.load_from_global_config(head)
        parts = await co.discover(client, token, timeout_s=10)
        result = await co.call(parts, PrepareCall(checkpoint_id="dead-controller",
                                                  deadline_ts=time.time() + deadline_s,
                                                  restart_only_policy="block"))
        print("PREPARED" if result.prepared else f"NOT PREPARED {result.blockers}", flush=True)
        while True:  # renew until killed, as the RL coordinator does
            await asyncio.sleep(deadline_s / 3)
            await co.call(parts, RenewCall(checkpoint_id="dead-controller", deadline_ts=time.time() + deadline_s))

    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
""")


DEADLINE_S = 2.0  # the dead controller's prepare deadline; it renewed every DEADLINE_S / 3 while alive


async def test_sigkilled_controller_leaves_gym_prepared_until_the_lease_reopens_it(tmp_path):
    grace = 0.5
    row, row2 = _workplace_rows(2)
    with ScriptedBackend().start() as backend, \
            GymDeployment.start(_small_gym(backend.base_url, grace), log_dir=tmp_path / "gym") as dep:
        backend.plans_from_rows([row, row2])
        backend.configure(respect_max_tokens=False)
        client = await ServerClient.load_from_global_config(dep.head_url)
        try:
            parts = await co.discover(client, TOKEN, timeout_s=10)
            async with aiohttp.ClientSession() as http:
                async def run(r, key):
                    async with http.post(dep.url("agent") + "/run", json={**r, "_ng_rollout_id": key}) as resp:
                        return resp.status, await resp.json()

                async def phases():
                    out = {}
                    for p in parts:
                        async with http.get(f"{p.url}{CHECKPOINT_ROUTE_PREFIX}/status",
                                            headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                            out[p.name] = (await resp.json())["phase"]
                    return out

                backend.hold(first_user_text(row), 1)
                first = asyncio.create_task(run(row, "lease-run-0"))
                await asyncio.to_thread(backend.wait_for_held, first_user_text(row), 1)
                ctl = subprocess.Popen(
                    [sys.executable, "-c", CONTROLLER, dep.head_url, TOKEN, str(DEADLINE_S)], cwd=REPO,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
                try:
                    line = await asyncio.wait_for(asyncio.to_thread(ctl.stdout.readline), 20)
                    assert line.strip() == "PREPARED", (line, ctl.stderr.read() if ctl.poll() is not None else "")
                    await asyncio.sleep(DEADLINE_S + 0.3)  # past the first deadline: renewals keep it prepared
                    assert set((await phases()).values()) == {"prepared"}
                finally:
                    ctl.send_signal(signal.SIGKILL)
                    ctl.wait(timeout=10)
                killed_at = time.time()
                backend.release(first_user_text(row), 1)
                deadline = time.monotonic() + DEADLINE_S + grace + 3.0
                while set((await phases()).values()) != {"idle"}:
                    assert time.monotonic() < deadline, await phases()
                    await asyncio.sleep(0.05)
                reopened_after = time.time() - killed_at
                print(f"\nlease: Gym reopened {reopened_after:.1f}s after the controller was SIGKILLed "
                      f"(deadline {DEADLINE_S}s, renewed every {DEADLINE_S / 3:.2f}s, grace {grace}s)")
                assert reopened_after > grace  # not at once: the lease held it, then let go
                status, reply = await asyncio.wait_for(first, 15)  # the held reply went through
                assert status == 200 and reply["reward"] == 1.0, reply

                # a new controller: prepare, commit a live session, resume
                backend.hold(first_user_text(row2), 1)
                second = asyncio.create_task(run(row2, "lease-run-1"))
                await asyncio.to_thread(backend.wait_for_held, first_user_text(row2), 1)
                result = await co.call(parts, PrepareCall(checkpoint_id="after-lease", deadline_ts=time.time() + 10,
                                                          restart_only_policy="block"))
                assert result.prepared, result
                commits = await co.call(parts, CommitCall(checkpoint_id="after-lease", deadline_ts=time.time() + 10,
                                                          checkpoint_dir=str(tmp_path / "ckpt"),
                                                          episode_ids=[EpisodeId.from_capture_key("lease-run-1")]))
                assert commits["agent"].episode_ids == ["lease-run-1"]
                await co.call(parts, ResumeCall(checkpoint_id="after-lease", deadline_ts=time.time() + 10))
                backend.release(first_user_text(row2), 1)
                status, reply = await asyncio.wait_for(second, 15)
                assert status == 200 and reply["reward"] == 1.0, reply
        finally:
            await client.close()
        logs = {p.name: p.read_text() for p in (tmp_path / "gym").glob("*.log")}
    assert any("lease of 'dead-controller' expired" in text for text in logs.values()), logs.keys()
    assert not any(TOKEN in text for text in logs.values())


# =============================================================================== 2. a Gym server dies
def test_with_in_run_recovery_off_a_dead_gym_server_stops_the_run_naming_it(tmp_path):
    spec = cm.RunSpec(tmp_path, steps=3, extra=["rollout_recovery.in_run.enabled=false"])
    marker = uuid.uuid4().hex
    env = dict(os.environ, NEMO_RL_TEST_RUN_ID=marker)  # the product's command; the backend's delay is in args
    env.setdefault("RAY_AUTH_MODE", "disabled")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *spec.args()], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(s.get("committed") for s in spec.records("snapshots.jsonl")):  # rollouts are in flight
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.05)
        pid = gym_server_pid(marker, "policy_model")
        assert pid is not None
        token = _control_token(pid)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=60)  # never a hang
        stopped_after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 1, err[-3000:]
    last = [line for line in err.splitlines() if line.startswith("error: ")]
    assert last, err[-3000:]
    # whichever notices first, the rollouts (bounded retries from the prompt) or the snapshots
    # (max_consecutive_failures), the error names the dead server
    assert ("Gym server 'policy_model' on nemo_gym/replica-0 keeps failing: " in last[-1]
            or "3 consecutive rollout snapshots failed" in last[-1]), last[-1]
    assert "Gym server 'policy_model' of nemo_gym/replica-0 is dead (its process exited)" in last[-1], last[-1]
    assert "retrying from the prompt" in err  # rollouts were retried first
    assert stopped_after < 30
    print(f"\ndead policy_model: the run stopped {stopped_after:.1f}s after the kill: {last[-1][:160]}")
    assert wait_for_no_processes(marker) == []
    # the run's control token (random per run) is in no output or log of it, errors included
    assert len(token) >= 16 and token not in out and token not in err
    logs = [f for f in spec.logs.rglob("*") if f.is_file()]
    assert any(f.suffix == ".log" for f in logs)  # the Gym servers' logs are there
    assert not [f for f in logs if token in f.read_text(errors="replace")]


def _control_token(pid: int) -> str:
    """The control token a Gym server was started with (from its environment)."""
    import yaml

    env = dict(item.split(b"=", 1) for item in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
               if b"=" in item)
    return yaml.safe_load(env[b"NEMO_GYM_CONFIG_DICT"].decode())["checkpoint"]["control_auth_token"]


# =============================================================================== 3. control-plane input
@pytest.fixture(scope="module")
def gym_dep(tmp_path_factory):
    logs = tmp_path_factory.mktemp("control-logs")
    cfg = _small_gym("http://127.0.0.1:9/v1", 600)
    with GymDeployment.start(cfg, log_dir=logs) as dep:
        yield dep


def _control(dep: GymDeployment, server: str, op: str, body: Any = None, *, token: str | None = TOKEN,
             raw: bytes | None = None) -> tuple[int, dict]:
    url = f"{dep.url(server)}{CHECKPOINT_ROUTE_PREFIX}/{op}"
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (None if op == "status" else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if op == "status" else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _ids(n: int) -> list[dict]:
    return [{"rollout_id": f"r{i}", "attempt": 0} for i in range(n)]


def test_max_episodes_boundary_is_the_wire_limit():
    RetireRequest(checkpoint_id="c", deadline_ts=time.time() + 5, episode_ids=_ids(MAX_EPISODES_PER_REQUEST))


@pytest.mark.parametrize("op, extra, server", [
    ("retire", {}, "agent"),
    ("commit", {"checkpoint_dir": "/tmp/x"}, "workplace"),
    ("restore", {"checkpoint_dir": "/tmp/x", "source_checkpoint_id": "c0"}, "policy_model"),
])
def test_oversized_episode_lists_are_refused_naming_the_field(gym_dep, server, op, extra):
    body = {"checkpoint_id": "big", "deadline_ts": time.time() + 30, "episode_ids": _ids(MAX_EPISODES_PER_REQUEST + 1),
            **extra}
    status, reply = _control(gym_dep, server, op, body)
    assert status == 422 and reply["error"]["code"] == "invalid_request", (status, reply)
    assert "episode_ids" in reply["error"]["detail"] and str(MAX_EPISODES_PER_REQUEST) in reply["error"]["detail"]
    status, st_ = _control(gym_dep, server, "status")
    assert status == 200 and st_["phase"] == "idle" and st_["checkpoint_id"] is None


def test_oversized_strings_are_refused(gym_dep):
    status, reply = _control(gym_dep, "agent", "commit", {"checkpoint_id": "c" * 129, "deadline_ts": time.time() + 5,
                                                          "checkpoint_dir": "/" + "d" * 5000})
    assert status == 422
    assert "checkpoint_id" in reply["error"]["detail"] and "checkpoint_dir" in reply["error"]["detail"]


_OPS = {
    "prepare": {"restart_only_policy": "block"},
    "renew": {},
    "resume": {},
    "retire": {"episode_ids": [{"rollout_id": "r1", "attempt": 0}]},
    "commit": {"checkpoint_dir": "/tmp/never-written", "episode_ids": None},
    "restore": {"checkpoint_dir": "/tmp/never-written", "episode_ids": [], "source_checkpoint_id": "c0"},
}
_WRONG = {  # a JSON value of the wrong type for each field
    "checkpoint_id": st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                               st.lists(st.text(max_size=3), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                          st.integers(), max_size=2)),
    "deadline_ts": st.one_of(st.text(max_size=8), st.none(), st.booleans(), st.lists(st.integers(), max_size=2),
                             st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)),
    "restart_only_policy": st.one_of(st.integers(), st.none(), st.booleans(), st.lists(st.text(max_size=3), max_size=2)),
    "episode_ids": st.one_of(st.integers(), st.text(max_size=5), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                                 max_size=2),
                             st.lists(st.one_of(st.integers(), st.text(max_size=3), st.none()), min_size=1, max_size=3)),
    "checkpoint_dir": st.one_of(st.integers(), st.booleans(), st.lists(st.text(max_size=3), max_size=2)),
    "source_checkpoint_id": st.one_of(st.integers(), st.none(), st.booleans()),
}


@st.composite
def _wrong_typed(draw) -> tuple[str, str, dict[str, Any]]:
    op = draw(st.sampled_from(sorted(_OPS)))
    body = {"checkpoint_id": "typed", "deadline_ts": 4102444800.0, **_OPS[op]}
    fields = [f for f in body if f in _WRONG and not (op == "commit" and f == "episode_ids")]
    field = draw(st.sampled_from(fields))
    body[field] = draw(_WRONG[field])
    return op, field, body


def test_wrong_types_are_422_naming_the_field_and_never_echo_the_token(gym_dep):
    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_wrong_typed(), st.sampled_from(["agent", "workplace", "policy_model"]))
    def check(case, server):
        op, field, body = case
        status, reply = _control(gym_dep, server, op, body)
        assert status == 422 and reply["error"]["code"] == "invalid_request", (op, body, status, reply)
        assert field in reply["error"]["detail"], (field, reply)
        assert TOKEN not in json.dumps(reply)

    check()
    for server in ("agent", "workplace", "policy_model"):
        assert _control(gym_dep, server, "status")[1]["phase"] == "idle"


@pytest.mark.parametrize("token", [None, "", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), f"{TOKEN} {TOKEN}"])
def test_bad_tokens_are_401_and_the_token_is_in_no_body_or_log(gym_dep, token):
    for op, body in (("status", None), ("prepare", {"checkpoint_id": "t", "deadline_ts": time.time() + 5})):
        status, reply = _control(gym_dep, "agent", op, body, token=token)
        assert status == 401 and reply["error"]["code"] == "unauthorized", reply
        assert TOKEN not in json.dumps(reply) and TOKEN[:-1] not in json.dumps(reply)
    # errors with the right token (a bad phase, a bad body) do not show it either
    for raw in (b"{", b'{"checkpoint_id": "x"}', json.dumps({"checkpoint_id": "x", "deadline_ts": 1e10}).encode()):
        status, reply = _control(gym_dep, "agent", "commit", raw=raw)
        assert 400 <= status < 500 and TOKEN not in json.dumps(reply)
    logs = sorted(gym_dep.log_dir.glob("*.log"))
    assert {log.stem for log in logs} >= {"head_server", "agent", "workplace", "policy_model"}
    for log in logs:
        assert TOKEN[:-1] not in log.read_text(errors="replace"), log


# =============================================================================== 4. setup input
class FakeStatusServers:
    """Real aiohttp servers on 127.0.0.1 answering ``GET status`` with whatever a test sets."""

    def __init__(self) -> None:
        self.bodies: dict[str, Any] = {}
        self.hang: set[str] = set()
        self.ports: dict[str, int] = {}
        self._runners: list[web.AppRunner] = []
        self._stopping = asyncio.Event()

    async def start(self, *names: str) -> "FakeStatusServers":
        for name in names:
            app = web.Application()
            app.router.add_get(f"{CHECKPOINT_ROUTE_PREFIX}/status", self._handler(name))
            runner = web.AppRunner(app)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self._runners.append(runner)
            self.ports[name] = port
        return self

    def _handler(self, name: str):
        async def status(request: web.Request) -> web.Response:
            assert request.headers.get("Authorization") == f"Bearer {TOKEN}"
            if name in self.hang:
                await self._stopping.wait()  # never answers while the test runs
            return web.json_response(self.bodies[name])
        return status

    async def stop(self) -> None:
        self._stopping.set()
        for runner in self._runners:
            await runner.cleanup()

    def client(self, types: dict[str, tuple[str, str]], dead: dict[str, int] | None = None) -> ServerClient:
        cfg: dict[str, Any] = {}
        for name, (server_type, impl) in types.items():
            port = (dead or {}).get(name) or self.ports[name]
            cfg[name] = {server_type: {impl: {"host": "127.0.0.1", "port": port}}}
        return ServerClient(parse_gym_config(cfg))


def _status(kind: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "instance": "x", "phase": "idle", "checkpoint_id": None, "lease_expires_at": None,
            "report": {"ready": True, "blockers": [], "blocker_count": 0, "unsaved": [], "counts": {}}, **extra}


TYPES = {"policy_model": ("responses_api_models", "vllm_model"), "tools": ("resources_servers", "workplace_assistant"),
         "agent_a": ("responses_api_agents", "simple_agent")}


@pytest.fixture
async def fake():
    servers = await FakeStatusServers().start(*TYPES)
    servers.bodies = {"policy_model": _status("model"), "tools": _status("resources", mode="exported"),
                      "agent_a": _status("agent", restart_only=False)}
    yield servers
    await servers.stop()


async def _discover(client: ServerClient, timeout_s: float = 5.0) -> list[str]:
    adapter = GymCheckpointAdapter(GymCheckpointInstance("shard", 0), client, TOKEN)
    try:
        return await adapter.discover(timeout_s=timeout_s)
    finally:
        await client.close()


async def test_discover_classifies_good_statuses(fake):
    assert await _discover(fake.client(TYPES)) == []
    fake.bodies["tools"] = _status("resources", mode="restart_only")
    fake.bodies["agent_a"] = _status("agent", restart_only=True)
    assert await _discover(fake.client(TYPES)) == ["agent_a", "tools"]


@pytest.mark.parametrize("server, body, error, expected", [
    ("tools", _status("resources", mode="sometimes"), GymStatusError,
     "Gym resources server 'tools': unknown checkpoint mode 'sometimes'"),
    ("tools", _status("resources"), GymStatusError, "Gym resources server 'tools': unknown checkpoint mode None"),
    ("agent_a", _status("agent"), GymStatusError, "Gym agent 'agent_a': status has no boolean 'restart_only' field"),
    ("agent_a", {"kind": "agent", "phase": "idle"}, CoordinationError,
     "Gym server 'agent_a': bad_reply (HTTP 200): malformed status: instance: Field required; report: Field required"),
    ("tools", _status("agent", restart_only=False), CoordinationError,
     "Gym server 'tools': kind_mismatch (HTTP 200): status says kind 'agent'"),
    ("policy_model", ["not", "an", "object"], CoordinationError,
     "Gym server 'policy_model': bad_reply (HTTP 200): GET status did not return a JSON object"),
])
async def test_bad_status_fails_discovery_naming_the_server(fake, server, body, error, expected):
    fake.bodies[server] = body
    with pytest.raises(error) as info:
        await _discover(fake.client(TYPES))
    assert expected in str(info.value), str(info.value)


async def test_a_server_that_does_not_answer_times_out_naming_it(fake):
    fake.hang.add("agent_a")
    started = time.monotonic()
    with pytest.raises(CoordinationError) as info:
        await _discover(fake.client(TYPES), timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert info.value.server == "agent_a" and info.value.code == "timeout"
    assert "Gym server 'agent_a': timeout (no reply): GET status took over 0.5s" in str(info.value)


async def test_a_server_that_is_not_there_is_named(fake):
    with pytest.raises(CoordinationError) as info:
        await _discover(fake.client(TYPES, dead={"tools": free_port()}), timeout_s=2)
    assert info.value.server == "tools" and info.value.code == "unreachable", str(info.value)


@pytest.mark.parametrize("yaml_text, args, expected", [
    ("rollout_recovery:\n  allow_restart_only_gym_server: true\n", [],
     "rollout_recovery.allow_restart_only_gym_server: unknown key"),
    ("rollout_checkpointing:\n  snapshot_attempt_interval_s: soon\n", [],
     "rollout_checkpointing.snapshot_attempt_interval_s: Input should be a valid number"),
    ("", ["rollout_checkpointing.keep_latest_kk=2"], "key 'rollout_checkpointing.keep_latest_kk' does not exist"),
    ("", ["grpo.max_num_steps=[1]"], "grpo.max_num_steps: Input should be a valid integer"),
    ("env:\n  nemo_gym:\n    config:\n      checkpoint: {lease_grace_secs: 5}\n", [],
     "Gym config key(s) checkpoint.lease_grace_secs do not exist"),
    ("env:\n  nemo_gym:\n    config:\n      workplace_simple_agent:\n        responses_api_agents:\n"
     "          simple_agent: {max_steps: many}\n", [],
     "workplace_simple_agent.responses_api_agents.simple_agent: max_steps: Input should be a valid integer"),
])
def test_bad_config_exits_2_naming_the_key_before_anything_starts(tmp_path, yaml_text, args, expected):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"defaults: {REPO / 'examples/configs/grpo_workplace_turn.yaml'}\n{yaml_text}")
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(cfg), f"logger.log_dir={logs}",
         f"checkpointing.checkpoint_dir={ckpt}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ")
    assert time.monotonic() - started < 15  # no Ray, no Gym: it fails at once
    assert not logs.exists() and not ckpt.exists()


# =============================================================================== 5. the crash hook
HOOKED = textwrap.dedent("""
    import subprocess, sys, time
    from testkit.crash_points import CrashAt
    hooks = CrashAt.from_env()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    for step in range(3):
        hooks.reached("commit", step)  # another phase: no effect
    hooks.reached("train")
    hooks.reached("train")  # train:2 fires here
    print("NOT KILLED", flush=True)
    child.kill()
""")


@pytest.mark.parametrize("new_session", [True, False])
def test_crash_hook_kills_the_process_group(new_session):
    env = {**os.environ, "NEMO_RL_TEST_ONLY_CRASH_AT": "train:2", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", HOOKED], env=env, capture_output=True, text=True, timeout=30,
                          start_new_session=new_session)
    assert proc.returncode == -signal.SIGKILL, (proc.stdout, proc.stderr)
    assert "NOT KILLED" not in proc.stdout
    assert "TEST-ONLY crash: NEMO_RL_TEST_ONLY_CRASH_AT=train:2 reached" in proc.stderr
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 5

    def alive() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    if new_session:  # the group leader takes its whole group down
        while alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive()
    else:  # not a group leader (here: pytest's group): only the process itself dies
        assert alive()
        os.kill(child, signal.SIGKILL)
