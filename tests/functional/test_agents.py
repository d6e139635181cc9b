"""The two agents as real processes: a Gym deployment with the policy model in
front of the scripted backend, the Workplace resources server, ``simple_agent``
(saves sessions) and ``plain_loop_agent`` (restart-only), checkpointing on.

Shows: full runs reach reward 1.0 when the backend follows the row's ground
truth; under ``block`` a restart-only run waiting on a held model reply keeps
the agent from preparing (the stall) and new runs are refused; under
``best_effort`` the agent prepares at once and reports the run unsaved; the
session agent parks at B0 / P2 and its committed record shows the loop state;
retire turns a running ``/run`` into 409 ``stale_attempt``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest

from gym_patches.checkpoint.store import read_participant_state
from gym_patches.launch import GymDeployment
from gym_patches.fakes.scripted_backend import ScriptedBackend, first_user_text

pytestmark = [pytest.mark.functional, pytest.mark.timeout(60)]

TOKEN = "agents-test-token"
CONTROL = "/ng-control/v1/checkpoint"
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "workplace_train.jsonl"
SLOW_TOOL = "tasks_update"  # delayed so a test can catch a session mid-tool
SLOW_TOOL_S = 1.5


def rows() -> list[dict[str, Any]]:
    """Workplace rows; the scripted backend counts reply bytes as tokens, so the
    rows' small ``max_output_tokens`` would cut its longer tool calls: raise it."""
    out = []
    with open(DATA) as f:
        for line in f:
            row = json.loads(line)
            row["responses_create_params"]["max_output_tokens"] = 1024
            out.append(row)
    return out


ROWS = rows()


def gym_config(base_url: str) -> dict[str, Any]:
    ref_model = {"type": "responses_api_models", "name": "policy_model"}
    ref_res = {"type": "resources_servers", "name": "workplace"}
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 60},
        "policy_base_url": base_url,
        "policy_model": {"responses_api_models": {"vllm_model": {"request_timeout_s": 30}}},
        "workplace": {"resources_servers": {"workplace_assistant": {"tool_delay_s": {SLOW_TOOL: SLOW_TOOL_S}}}},
        "simple": {"responses_api_agents": {"simple_agent": {"model_server": ref_model, "resources_server": ref_res}}},
        "plain": {
            "responses_api_agents": {"plain_loop_agent": {"model_server": ref_model, "resources_server": ref_res}}
        },
    }


@pytest.fixture(scope="module")
def backend() -> Iterator[ScriptedBackend]:
    with ScriptedBackend().start() as b:
        b.plans_from_rows(ROWS[:16])
        yield b


@pytest.fixture(scope="module")
def dep(backend: ScriptedBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymDeployment]:
    with GymDeployment.start(gym_config(backend.base_url), log_dir=tmp_path_factory.mktemp("logs")) as d:
        yield d


class Gym:
    """HTTP helper for one test: /run calls and the checkpoint control routes."""

    def __init__(self, http: aiohttp.ClientSession, dep: GymDeployment):
        self.http, self.dep = http, dep
        self.active: dict[str, str] = {}  # server -> checkpoint id to resume at teardown

    async def run(self, agent: str, row: dict[str, Any], key: str | None) -> tuple[int, Any]:
        body = dict(row)
        if key is not None:
            body["_ng_rollout_id"] = key
        async with self.http.post(self.dep.url(agent) + "/run", json=body) as resp:
            return resp.status, await resp.json()

    def run_later(self, agent: str, row: dict[str, Any], key: str) -> asyncio.Task:
        return asyncio.create_task(self.run(agent, row, key))

    async def control(self, server: str, op: str, checkpoint_id: str | None = None, *,
                      deadline_s: float = 10.0, **fields: Any) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        url = f"{self.dep.url(server)}{CONTROL}/{op}"
        if op == "status":
            async with self.http.get(url, headers=headers) as resp:
                return resp.status, await resp.json()
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + deadline_s, **fields}
        if op in ("prepare", "restore", "commit"):
            self.active[server] = checkpoint_id  # type: ignore[assignment]
        async with self.http.post(url, json=body, headers=headers) as resp:
            status, reply = resp.status, await resp.json()
        if op == "resume":
            self.active.pop(server, None)
        return status, reply

    async def resume_all(self) -> None:
        for server in ("plain", "simple", "workplace", "policy_model"):  # callers first, like coordination
            cid = self.active.get(server)
            if cid is not None:
                await self.control(server, "resume", cid)


@pytest.fixture
async def gym(dep: GymDeployment, backend: ScriptedBackend):
    async with aiohttp.ClientSession() as http:
        g = Gym(http, dep)
        try:
            yield g
        finally:
            await g.resume_all()  # a failed test must not leave a server closed
            for row in ROWS[:16]:
                for turn in range(3):
                    backend.release(first_user_text(row), turn)


def assert_followed_ground_truth(reply: dict[str, Any], row: dict[str, Any], key: str) -> None:
    assert reply["rollout_id"] == key
    assert reply["reward"] == 1.0, reply
    assert reply["termination_reason"] == "final_answer"
    assert reply["num_model_calls"] == len(row["ground_truth"]) + 1
    out = reply["response"]["output"]
    calls = [i for i in out if i["type"] == "function_call"]
    assert [c["name"] for c in calls] == [g["name"] for g in row["ground_truth"]]
    assert [json.loads(c["arguments"]) for c in calls] == [g["arguments"] for g in row["ground_truth"]]
    results = [i for i in out if i["type"] == "function_call_output"]
    assert [r["call_id"] for r in results] == [c["call_id"] for c in calls]
    assert not any(r["output"].startswith("Error") for r in results), results
    assert out[-1]["type"] == "message" and out[-1]["generation_token_ids"]  # token info passes through


async def test_simple_agent_run_reaches_reward_1(gym: Gym):
    row = ROWS[0]
    status, reply = await gym.run("simple", row, "fn-simple-0")
    assert status == 200, reply
    assert_followed_ground_truth(reply, row, "fn-simple-0")
    assert reply["restored_from"] is None


async def test_plain_loop_agent_run_reaches_reward_1(gym: Gym):
    row = ROWS[1]
    status, reply = await gym.run("plain", row, "fn-plain-1")
    assert status == 200, reply
    assert_followed_ground_truth(reply, row, "fn-plain-1")
    _, st = await gym.control("plain", "status")
    assert st["restart_only"] is True and st["report"]["blockers"] == []
    _, st = await gym.control("simple", "status")
    assert st["restart_only"] is False and st["kind"] == "agent"
    assert gym.dep.server("plain").checkpoint_mode == "restart-only"
    assert gym.dep.server("simple").checkpoint_mode == "saves"


async def test_bad_run_requests_are_named(gym: Gym):
    for agent in ("simple", "plain"):
        status, reply = await gym.run(agent, ROWS[0], None)
        assert status == 400 and reply["error"]["code"] == "rollout_id_required"
        status, reply = await gym.run(agent, {"id": "x"}, f"fn-bad-{agent}")
        assert status == 422 and "responses_create_params" in reply["error"]["detail"]
        status, reply = await gym.run(agent, ROWS[0], "bad key!")
        assert status == 400 and "_ng_rollout_id" in reply["error"]["detail"]


async def _stall_plain_run(gym: Gym, backend: ScriptedBackend, row: dict[str, Any], key: str, cid: str,
                           policy: str) -> asyncio.Task:
    """Start a plain /run, hold its second model reply in the model's gate (model prepared)."""
    user = first_user_text(row)
    backend.hold(user, 1)
    run = gym.run_later("plain", row, key)
    await asyncio.to_thread(backend.wait_for_held, user, 1)
    status, reply = await gym.control("policy_model", "prepare", cid, restart_only_policy=policy)
    assert status == 200 and reply["phase"] == "prepared", reply
    assert backend.release(user, 1)  # the backend answers; the prepared model holds the reply
    return run


async def test_block_restart_only_run_waiting_on_held_reply_blocks_prepare(gym: Gym, backend: ScriptedBackend):
    row, key, cid = ROWS[2], "fn-block-2", "ck-block"
    run = await _stall_plain_run(gym, backend, row, key, cid, "block")
    status, reply = await gym.control("plain", "prepare", cid, deadline_s=1.0, restart_only_policy="block")
    assert status == 200
    assert reply["phase"] == "preparing" and reply["report"]["ready"] is False
    assert reply["report"]["blockers"] == [key] and reply["report"]["unsaved"] == []
    status, refused = await gym.run("plain", ROWS[3], "fn-block-3")
    assert status == 409 and refused["error"]["code"] == "admission_closed"
    assert not run.done()  # circular wait: the run waits on the model, the model on resume
    await gym.resume_all()
    status, done = await run
    assert status == 200 and done["reward"] == 1.0


async def test_best_effort_restart_only_agent_prepares_at_once_with_unsaved(gym: Gym, backend: ScriptedBackend,
                                                                          tmp_path: Path):
    row, key, cid = ROWS[4], "fn-best-4", "ck-best"
    run = await _stall_plain_run(gym, backend, row, key, cid, "best_effort")
    started = time.monotonic()
    status, reply = await gym.control("plain", "prepare", cid, restart_only_policy="best_effort")
    assert status == 200 and time.monotonic() - started < 2.0
    assert reply["phase"] == "prepared" and reply["report"]["ready"] is True
    assert reply["report"]["blockers"] == [] and reply["report"]["unsaved"] == [key]
    late = gym.run_later("plain", ROWS[5], "fn-best-5")  # admitted while closed, tracked as unsaved
    for _ in range(200):
        _, st = await gym.control("plain", "status")
        if "fn-best-5" in st["report"]["unsaved"]:
            break
        await asyncio.sleep(0.02)
    assert st["report"]["unsaved"] == [key, "fn-best-5"] and st["phase"] == "prepared"
    status, err = await gym.control("plain", "commit", cid, checkpoint_dir=str(tmp_path),
                                    episode_ids=[{"rollout_id": key, "attempt": 0}])
    assert status == 409 and err["error"]["code"] == "restart_in_scope"
    status, committed = await gym.control("plain", "commit", cid, checkpoint_dir=str(tmp_path), episode_ids=[])
    assert status == 200 and committed["manifest"]["record_count"] == 0
    await gym.resume_all()
    for task in (run, late):
        status, done = await task
        assert status == 200 and done["reward"] == 1.0


async def test_simple_agent_parks_at_B0_and_P2_and_commits_the_loop_state(gym: Gym, backend: ScriptedBackend,
                                                                       tmp_path: Path):
    held_row, slow_row = ROWS[6], ROWS[8]  # ROWS[8] calls tasks_update (slow) in its second turn
    assert slow_row["ground_truth"][1]["name"] == SLOW_TOOL
    held_user = first_user_text(held_row)
    backend.hold(held_user, 1)
    held_run = gym.run_later("simple", held_row, "fn-held-6")
    slow_run = gym.run_later("simple", slow_row, "fn-slow-8")
    await asyncio.to_thread(backend.wait_for_held, held_user, 1)
    for _ in range(300):  # the slow session has its second reply and is now inside the slow tool
        if any(c["turn"] == 1 for c in backend.calls(first_user_text(slow_row))):
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    cid = "ck-park"
    status, reply = await gym.control("policy_model", "prepare", cid)
    assert reply["phase"] == "prepared", reply
    started = time.monotonic()
    status, reply = await gym.control("simple", "prepare", cid)
    assert status == 200 and reply["phase"] == "prepared", reply
    assert time.monotonic() - started > 0.3  # waited for the slow tool to return (P2)
    assert reply["report"]["counts"] == {"sessions": 2, "at_boundary": 1, "awaiting_model": 1}
    assert reply["report"]["unsaved"] == []
    status, committed = await gym.control(
        "simple", "commit", cid, checkpoint_dir=str(tmp_path),
        episode_ids=[{"rollout_id": "fn-held-6", "attempt": 0}, {"rollout_id": "fn-slow-8", "attempt": 0}],
    )
    assert status == 200 and sorted(committed["episode_ids"]) == ["fn-held-6", "fn-slow-8"], committed
    _, records = read_participant_state(str(tmp_path), "agent", "simple", cid)
    by_key = {r["episode_id"]["rollout_id"]: r for r in records}
    held, slow = by_key["fn-held-6"], by_key["fn-slow-8"]
    assert held["boundary"] == "B0" and held["state"]["step"] == 1 and held["state"]["pending_tools"] is False
    assert [i["type"] for i in held["state"]["new_outputs"]] == ["function_call", "function_call_output"]
    assert held["state"]["seed_row"]["id"] == held_row["id"] and held["state"]["resources_cookies"]
    assert slow["boundary"] == "P2" and slow["state"]["step"] == 2 and slow["state"]["pending_tools"] is False
    assert [i["type"] for i in slow["state"]["new_outputs"]] == ["function_call", "function_call_output"] * 2
    await gym.resume_all()
    backend.release(held_user, 1)
    for task in (held_run, slow_run):
        status, done = await task
        assert status == 200 and done["reward"] == 1.0, done


async def test_retire_stops_running_runs_with_stale_attempt(gym: Gym, backend: ScriptedBackend):
    for agent, row, key in (("simple", ROWS[10], "fn-retire-s"), ("plain", ROWS[11], "fn-retire-p")):
        user = first_user_text(row)
        backend.hold(user, 1)
        run = gym.run_later(agent, row, key)
        await asyncio.to_thread(backend.wait_for_held, user, 1)
        status, reply = await gym.control(agent, "retire", f"ck-retire-{agent}",
                                          episode_ids=[{"rollout_id": key, "attempt": 0}])
        assert status == 200 and reply["retired"] == [key], reply
        status, body = await run
        assert status == 409 and body["error"]["code"] == "stale_attempt", body
        status, body = await gym.run(agent, row, key)  # the retired attempt stays refused
        assert status == 409 and body["error"]["code"] == "stale_attempt"
        backend.release(user, 1)
