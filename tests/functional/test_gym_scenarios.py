"""The Gym issue's "must show" scenarios, end to end through the coordination library.

Real processes only: a scripted chat-completions backend, and Gym deployments
(policy model, Workplace (``exported``), python_sandbox (``restart_only``),
``simple_agent`` (saves sessions), ``plain_loop_agent`` (restart-only)) driven
with ``gym_patches.checkpoint.coordination`` over HTTP on 127.0.0.1.

1. the stall under ``block`` (a restart-only run waiting on a held reply);
2. best effort: unsaved restart-only runs, the session agent still saved;
3. where a session agent parks in turn 2 (B0 / P1 / P2), and the Workplace
   state committed with it;
4. a session agent on a restart-only resources server;
5. restore into fresh server processes;
6. status, auth, malformed requests, lease expiry;
7. a flipped byte in a records file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import pytest

from gym_patches.checkpoint import coordination as co
from gym_patches.checkpoint.calls import CommitCall, PrepareCall, RestoreCall, ResumeCall
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.store import read_participant_state
from gym_patches.launch import GymDeployment
from gym_patches.server_utils import ServerClient
from gym_patches.fakes.scripted_backend import ScriptedBackend, first_user_text

pytestmark = [pytest.mark.functional, pytest.mark.timeout(60)]

TOKEN = "gym-scenarios-token"
CONTROL = "/ng-control/v1/checkpoint"
DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
SLOW_TOOL, SLOW_TOOL_S = "tasks_update", 1.5  # on the main deployment: catches a session mid-tool
FRESH_SLOW_TOOL, FRESH_SLOW_TOOL_S = "calendar_create_event", 1.0  # on the restore-into-fresh deployments
MODEL, WORKPLACE, SANDBOX = "policy_model", "workplace", "python_sandbox"
SIMPLE, PLAIN, SANDBOX_AGENT = "simple", "plain", "sandbox_simple"
ALL_SERVERS = (MODEL, WORKPLACE, SANDBOX, SIMPLE, PLAIN, SANDBOX_AGENT)

# ground-truth tool sequences of the Workplace rows
BOOK = ("directory_find_email", "calendar_create_event")
EMAIL = ("directory_find_email", "email_send")
ASSIGN = ("directory_find_email", "tasks_create")
MOVE = ("tasks_search", "tasks_update")


# -- rows -----------------------------------------------------------------------
def _load(name: str) -> list[dict[str, Any]]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f if line.strip()]


class _Picker:
    """Hands out rows with a given tool sequence and a user text no other picked row
    has, so a backend hold on (user text, turn) catches exactly one rollout."""

    def __init__(self) -> None:
        self.rows = _load("workplace_train.jsonl") + _load("sandbox_train.jsonl")
        self.users: set[str] = set()
        self.picked: list[dict[str, Any]] = []
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[first_user_text(row)] = counts.get(first_user_text(row), 0) + 1
        self.unique = {user for user, n in counts.items() if n == 1}

    def pick(self, tools: tuple[str, ...], source: str = "workplace") -> dict[str, Any]:
        for row in self.rows:
            user = first_user_text(row)
            if (row["task_source"] == source and tuple(g["name"] for g in row["ground_truth"]) == tools
                    and user in self.unique and user not in self.users):
                self.users.add(user)
                self.picked.append(row)
                return row
        raise LookupError(f"no unused {source} row with tools {tools}")


_PICK = _Picker()
STALL_ROW = _PICK.pick(EMAIL)
BEST_PLAIN_ROW, BEST_SIMPLE_ROW = _PICK.pick(ASSIGN), _PICK.pick(BOOK)
B0_ROW, P1_ROW, P2_ROW = _PICK.pick(EMAIL), _PICK.pick(BOOK), _PICK.pick(MOVE)
SANDBOX_ROW = _PICK.pick(("python_exec", "python_exec"), source="python_sandbox")
FRESH_ROW = _PICK.pick(BOOK)
LEASE_ROW = _PICK.pick(ASSIGN)
CORRUPT_ROW = _PICK.pick(EMAIL)
ALL_ROWS = list(_PICK.picked)


def ep(key: str) -> EpisodeId:
    return EpisodeId.from_capture_key(key)


def user_of(row: dict[str, Any]) -> str:
    return first_user_text(row)


# -- configs and fixtures ---------------------------------------------------------
def _refs(resources: str) -> dict[str, Any]:
    return {
        "model_server": {"type": "responses_api_models", "name": MODEL},
        "resources_server": {"type": "resources_servers", "name": resources},
    }


def main_config(base_url: str) -> dict[str, Any]:
    """The mixed deployment: session agent and restart-only agent on Workplace,
    a session agent on the restart-only python sandbox."""
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 60},
        "policy_base_url": base_url,
        MODEL: {"responses_api_models": {"vllm_model": {"request_timeout_s": 30}}},
        WORKPLACE: {"resources_servers": {"workplace_assistant": {"tool_delay_s": {SLOW_TOOL: SLOW_TOOL_S}}}},
        SANDBOX: {"resources_servers": {"python_sandbox": {"exec_timeout_s": 10}}},
        SIMPLE: {"responses_api_agents": {"simple_agent": _refs(WORKPLACE)}},
        PLAIN: {"responses_api_agents": {"plain_loop_agent": _refs(WORKPLACE)}},
        SANDBOX_AGENT: {"responses_api_agents": {"simple_agent": _refs(SANDBOX)}},
    }


def small_config(base_url: str, *, lease_grace_s: float = 60, tool_delay_s: dict[str, float] | None = None
                 ) -> dict[str, Any]:
    """Model + Workplace + simple_agent only."""
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": lease_grace_s},
        "policy_base_url": base_url,
        MODEL: {"responses_api_models": {"vllm_model": {"request_timeout_s": 30}}},
        WORKPLACE: {"resources_servers": {"workplace_assistant": {"tool_delay_s": dict(tool_delay_s or {})}}},
        SIMPLE: {"responses_api_agents": {"simple_agent": _refs(WORKPLACE)}},
    }


@pytest.fixture(scope="module")
def backend() -> Iterator[ScriptedBackend]:
    with ScriptedBackend().start() as b:
        b.plans_from_rows(ALL_ROWS)
        b.configure(respect_max_tokens=False)  # fake tokens are bytes: rows' max_output_tokens would cut tool calls
        yield b


@pytest.fixture(scope="module")
def main_dep(backend: ScriptedBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymDeployment]:
    with GymDeployment.start(main_config(backend.base_url), log_dir=tmp_path_factory.mktemp("main-logs")) as d:
        yield d


# -- the test's handle on one deployment ----------------------------------------------
async def eventually(check: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 10.0) -> Any:
    """Poll ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what} (last: {last!r})")


class Gym:
    """One deployment seen from a test: /run calls, status, and the coordination
    library. Remembers what it opened so teardown can resume and release it."""

    def __init__(self, dep: GymDeployment, backend: ScriptedBackend, http: aiohttp.ClientSession,
                 client: ServerClient, parts: co.Participants):
        self.dep, self.backend, self.http, self.client, self.parts = dep, backend, http, client, parts
        self.checkpoints: list[str] = []  # ids to resume at teardown
        self.holds: set[tuple[str, int]] = set()
        self.runs: list[asyncio.Task] = []

    # /run
    async def run(self, agent: str, row: dict[str, Any], key: str) -> tuple[int, Any]:
        async with self.http.post(self.dep.url(agent) + "/run", json={**row, "_ng_rollout_id": key}) as resp:
            return resp.status, await resp.json()

    def start_run(self, agent: str, row: dict[str, Any], key: str) -> asyncio.Task:
        task = asyncio.create_task(self.run(agent, row, key), name=f"run:{key}")
        self.runs.append(task)
        return task

    # backend
    def hold(self, row: dict[str, Any], turn: int) -> None:
        self.backend.hold(user_of(row), turn)
        self.holds.add((user_of(row), turn))

    def release(self, row: dict[str, Any], turn: int) -> None:
        assert self.backend.release(user_of(row), turn), f"nothing held for turn {turn} of {row['id']}"
        self.holds.discard((user_of(row), turn))

    async def wait_for_held(self, row: dict[str, Any], turn: int) -> None:
        await asyncio.to_thread(self.backend.wait_for_held, user_of(row), turn)

    def turn_calls(self, row: dict[str, Any]) -> list[int]:
        """Turn index of every completed backend call for this row, in order."""
        return [c["turn"] for c in self.backend.calls(user_of(row))]

    # servers
    async def status(self, server: str, token: str | None = TOKEN) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        async with self.http.get(f"{self.dep.url(server)}{CONTROL}/status", headers=headers) as resp:
            return resp.status, await resp.json()

    async def phase(self, server: str) -> str:
        status, body = await self.status(server)
        assert status == 200, body
        return body["phase"]

    async def report(self, server: str) -> dict[str, Any]:
        status, body = await self.status(server)
        assert status == 200, body
        return body["report"]

    async def post_control(self, server: str, op: str, body: Any, token: str | None = TOKEN,
                           raw: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        url = f"{self.dep.url(server)}{CONTROL}/{op}"
        if raw is not None:
            headers["Content-Type"] = "application/json"
            async with self.http.post(url, data=raw.encode(), headers=headers) as resp:
                return resp.status, await resp.json()
        async with self.http.post(url, json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    async def tool(self, server: str, name: str, args: dict[str, Any], session_id: str) -> str:
        headers = {"Cookie": f"ng_session={session_id}"}
        async with self.http.post(f"{self.dep.url(server)}/{name}", json=args, headers=headers) as resp:
            body = await resp.json()
            assert resp.status == 200, body
            return body["output"]

    # coordination
    async def prepare(self, cid: str, deadline_s: float, policy: str = "block",
                      parts: co.Participants | None = None) -> tuple[co.PrepareResult, float]:
        self._track(cid)
        started = time.monotonic()
        result = await co.call(parts or self.parts, PrepareCall(
            checkpoint_id=cid, deadline_ts=time.time() + deadline_s,
            restart_only_policy=policy))  # type: ignore[arg-type]
        return result, time.monotonic() - started

    async def commit(self, cid: str, checkpoint_dir: Path, scope: list[EpisodeId] | None) -> dict[str, Any]:
        return await co.call(self.parts, CommitCall(checkpoint_id=cid, deadline_ts=time.time() + 15,
                                                    checkpoint_dir=str(checkpoint_dir), episode_ids=scope))

    async def restore(self, cid: str, checkpoint_dir: Path, scope: Any, source: str) -> dict[str, Any]:
        self._track(cid)
        return await co.call(self.parts, RestoreCall(checkpoint_id=cid, deadline_ts=time.time() + 15,
                                                     checkpoint_dir=str(checkpoint_dir), episode_ids=scope,
                                                     source_checkpoint_id=source))

    async def resume(self, cid: str) -> None:
        await co.call(self.parts, ResumeCall(checkpoint_id=cid, deadline_ts=time.time() + 15))
        if cid in self.checkpoints:
            self.checkpoints.remove(cid)

    def _track(self, cid: str) -> None:
        if cid not in self.checkpoints:
            self.checkpoints.append(cid)

    async def all_idle(self) -> bool:
        return all([await self.phase(p.name) == "idle" for p in self.parts])

    async def close(self, *, check_idle: bool = True) -> None:
        """Resume what is open, release holds, let runs end; then every server must be idle."""
        try:
            for cid in list(self.checkpoints):
                with contextlib.suppress(co.CoordinationError):
                    await self.resume(cid)
            for user, turn in list(self.holds):
                self.backend.release(user, turn)
            self.holds.clear()
            pending = [t for t in self.runs if not t.done()]
            if pending:
                done, still = await asyncio.wait(pending, timeout=15)
                for t in still:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            if check_idle:
                assert await self.all_idle(), {p.name: await self.phase(p.name) for p in self.parts}
        finally:
            await self.client.close()


@contextlib.asynccontextmanager
async def open_gym(dep: GymDeployment, backend: ScriptedBackend, *, check_idle: bool = True
                   ) -> AsyncIterator[Gym]:
    client = await ServerClient.load_from_global_config(dep.head_url)
    async with aiohttp.ClientSession() as http:
        try:
            parts = await co.discover(client, TOKEN, timeout_s=10)
        except BaseException:
            await client.close()
            raise
        gym = Gym(dep, backend, http, client, parts)
        try:
            yield gym
        finally:
            await gym.close(check_idle=check_idle)


@pytest.fixture
async def gym(main_dep: GymDeployment, backend: ScriptedBackend) -> AsyncIterator[Gym]:
    async with open_gym(main_dep, backend) as g:
        yield g


def assert_ground_truth_reply(reply: dict[str, Any], row: dict[str, Any], key: str) -> None:
    """The run followed the row's ground truth and earned its reward."""
    assert reply["rollout_id"] == key, reply
    assert reply["reward"] == 1.0, reply
    assert reply["termination_reason"] == "final_answer"
    assert reply["num_model_calls"] == len(row["ground_truth"]) + 1
    calls = [i for i in reply["response"]["output"] if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (g["name"], g["arguments"]) for g in row["ground_truth"]
    ]
    outputs = [i for i in reply["response"]["output"] if i["type"] == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [c["call_id"] for c in calls]


async def finished(task: asyncio.Task, row: dict[str, Any], key: str, timeout_s: float = 15) -> dict[str, Any]:
    status, reply = await asyncio.wait_for(task, timeout_s)
    assert status == 200, reply
    assert_ground_truth_reply(reply, row, key)
    return reply


# -- 1. the stall ---------------------------------------------------------------------
async def test_block_stalls_on_a_restart_only_run_waiting_on_a_held_reply(gym: Gym):
    row, key = STALL_ROW, "stall-0"
    gym.hold(row, 1)
    gym.hold(row, 2)
    run = gym.start_run(PLAIN, row, key)
    await gym.wait_for_held(row, 1)

    # Attempt 1: once the model is prepared, let the backend answer: the model now
    # holds the reply, the run waits for it, the agent waits for the run.
    prepare = asyncio.create_task(gym.prepare("stall-1", 1.0, "block"))
    await eventually(lambda: _phase_is(gym, MODEL, "prepared"), "the model to prepare")
    gym.release(row, 1)
    await eventually(lambda: _model_holds(gym, 1), "the model to hold the turn-1 reply")
    result, elapsed = await prepare
    assert_stalled(result, key)
    assert 0.9 <= elapsed < 4.0, elapsed  # it waited for the whole deadline, then gave up
    assert not run.done()
    await gym.resume("stall-1")

    # The held reply is delivered on resume; the run moves on and waits on turn 2.
    await gym.wait_for_held(row, 2)
    assert gym.turn_calls(row) == [0, 1]
    for attempt in (2, 3):  # every retry while a reply is held fails the same way
        cid = f"stall-{attempt}"
        prepare = asyncio.create_task(gym.prepare(cid, 1.0, "block"))
        if attempt == 3:  # this time the model holds it again, not the backend
            await eventually(lambda: _phase_is(gym, MODEL, "prepared"), "the model to prepare")
            gym.release(row, 2)
            await eventually(lambda: _model_holds(gym, 1), "the model to hold the turn-2 reply")
        result, elapsed = await prepare
        assert_stalled(result, key)
        assert elapsed >= 0.9, elapsed
        assert not run.done()
        await gym.resume(cid)

    reply = await finished(run, row, key)
    assert reply["restored_from"] is None
    assert gym.turn_calls(row) == [0, 1, 2]


def assert_stalled(result: co.PrepareResult, key: str) -> None:
    assert result.prepared is False
    assert result.blockers == {PLAIN: [key]}, result.blockers
    assert result.unsaved == {}
    assert result.replies[MODEL].phase == "prepared"
    assert result.replies[PLAIN].phase == "preparing" and result.replies[PLAIN].report.blocker_count == 1
    assert WORKPLACE not in result.replies  # prepare stopped at the agent stage


async def _phase_is(gym: Gym, server: str, phase: str) -> bool:
    return await gym.phase(server) == phase


async def _model_holds(gym: Gym, n: int) -> bool:
    return (await gym.report(MODEL))["counts"].get("held") == n


# -- 2. best effort ---------------------------------------------------------------------
async def test_best_effort_saves_the_session_agent_and_reports_the_restart_only_run_unsaved(
    gym: Gym, tmp_path: Path
):
    plain_row, simple_row = BEST_PLAIN_ROW, BEST_SIMPLE_ROW
    # reference: the same rows, no checkpoint anywhere
    ref_plain, ref_simple = await asyncio.gather(gym.run(PLAIN, plain_row, "ref-plain"),
                                                 gym.run(SIMPLE, simple_row, "ref-simple"))
    assert ref_plain[0] == 200 and ref_simple[0] == 200, (ref_plain, ref_simple)
    assert_ground_truth_reply(ref_plain[1], plain_row, "ref-plain")
    assert_ground_truth_reply(ref_simple[1], simple_row, "ref-simple")

    plain_key, simple_key = "best-plain", "best-simple"
    for row in (plain_row, simple_row):
        gym.hold(row, 1)  # both wait on their turn-2 reply
    plain_run = gym.start_run(PLAIN, plain_row, plain_key)
    simple_run = gym.start_run(SIMPLE, simple_row, simple_key)
    await gym.wait_for_held(plain_row, 1)
    await gym.wait_for_held(simple_row, 1)

    deadline_s = 6.0
    result, elapsed = await gym.prepare("best-1", deadline_s, "best_effort")
    assert result.prepared is True, result
    assert elapsed < deadline_s / 2, elapsed
    assert result.blockers == {}
    assert result.unsaved == {PLAIN: [plain_key]}
    scope = result.continued([ep(plain_key), ep(simple_key)])
    assert scope == [ep(simple_key)]

    commits = await gym.commit("best-1", tmp_path, scope)
    assert {name: r.episode_ids for name, r in commits.items()} == {
        MODEL: [simple_key], WORKPLACE: [simple_key], SANDBOX: [], SIMPLE: [simple_key], PLAIN: [],
        SANDBOX_AGENT: [],
    }
    manifest, records = read_participant_state(tmp_path, "agent", SIMPLE, "best-1")
    assert manifest.record_count == 1 == len(records)
    record = records[0]
    assert record["episode_id"] == {"rollout_id": simple_key, "attempt": 0}
    assert record["boundary"] == "B0"  # waiting on its turn-2 reply: the end of turn 1
    assert record["state"]["step"] == 1 and record["state"]["pending_tools"] is False
    assert [i["type"] for i in record["state"]["new_outputs"]] == ["function_call", "function_call_output"]
    assert record["state"]["seed_row"]["id"] == simple_row["id"]
    assert record["state"]["resources_cookies"].get("ng_session")
    _, plain_records = read_participant_state(tmp_path, "agent", PLAIN, "best-1")
    assert plain_records == []
    _, wp_records = read_participant_state(tmp_path, "resources", WORKPLACE, "best-1")
    assert [r["episode_id"]["rollout_id"] for r in wp_records] == [simple_key]
    assert wp_records[0]["session_id"] == record["state"]["resources_cookies"]["ng_session"]

    await gym.resume("best-1")
    gym.release(plain_row, 1)
    gym.release(simple_row, 1)
    plain_done = await finished(plain_run, plain_row, plain_key)
    simple_done = await finished(simple_run, simple_row, simple_key)
    assert plain_done["reward"] == ref_plain[1]["reward"]
    assert simple_done["reward"] == ref_simple[1]["reward"]


# -- 3. where a session parks in turn 2 --------------------------------------------------
def _tables(world: dict[str, Any]) -> dict[str, Any]:
    return {t: world[t] for t in ("events", "emails", "tasks")}


async def test_simple_agent_parks_at_B0_P1_P2_and_workplace_commits_the_same_boundary(gym: Gym, tmp_path: Path):
    """C waits on its turn-2 reply (B0); A's turn-2 reply arrives after the park
    request while B is still inside its slow turn-2 tool (P1); B finishes that
    tool (P2). Then every original run finishes, and the checkpoint is restored in
    place and finishes again from each boundary."""
    keys = {"B0": "park-b0", "P1": "park-p1", "P2": "park-p2"}
    rows = {"B0": B0_ROW, "P1": P1_ROW, "P2": P2_ROW}
    assert P2_ROW["ground_truth"][1]["name"] == SLOW_TOOL
    gym.hold(rows["B0"], 1)
    gym.hold(rows["P1"], 1)
    runs = {b: gym.start_run(SIMPLE, rows[b], keys[b]) for b in ("B0", "P1", "P2")}
    await gym.wait_for_held(rows["B0"], 1)
    await gym.wait_for_held(rows["P1"], 1)
    await eventually(lambda: _inflight(gym, WORKPLACE, 1), "P2's session to be inside its slow tool")

    # Ask the agent stage alone to park (the model stays open, so A's reply can arrive).
    agents = co.Participants(gym.parts.by_kind("agent"), gym.parts.control)
    parking = asyncio.create_task(gym.prepare("park-1", 10.0, "block", parts=agents))
    await eventually(lambda: _phase_is(gym, SIMPLE, "preparing"), "the agent to start parking")
    gym.release(rows["P1"], 1)
    report = await eventually(lambda: _at_boundary(gym, 1), "A to park at P1")
    assert report["blockers"] == [keys["P2"]], report  # B is still inside its tool
    assert report["counts"] == {"sessions": 3, "at_boundary": 1, "awaiting_model": 1}
    assert not parking.done()
    agent_result, _ = await parking
    assert agent_result.prepared, agent_result
    result, _ = await gym.prepare("park-1", 10.0, "block")  # now the whole deployment
    assert result.prepared and result.blockers == {} and result.unsaved == {}, result
    scope = [ep(k) for k in keys.values()]
    commits = await gym.commit("park-1", tmp_path, scope)
    for name in (MODEL, WORKPLACE, SIMPLE):
        assert sorted(commits[name].episode_ids) == sorted(keys.values()), (name, commits[name])

    _, agent_records = read_participant_state(tmp_path, "agent", SIMPLE, "park-1")
    by_key = {r["episode_id"]["rollout_id"]: r for r in agent_records}
    _, wp_records = read_participant_state(tmp_path, "resources", WORKPLACE, "park-1")
    worlds = {r["episode_id"]["rollout_id"]: r["state"] for r in wp_records}
    assert set(by_key) == set(worlds) == set(keys.values())

    # (a) waiting on the model -> B0, the end of turn 1; its world has only turn 1 (read-only)
    b0 = by_key[keys["B0"]]
    assert b0["boundary"] == "B0"
    assert b0["state"]["step"] == 1 and b0["state"]["pending_tools"] is False
    assert [i["type"] for i in b0["state"]["new_outputs"]] == ["function_call", "function_call_output"]
    assert _tables(worlds[keys["B0"]]) == _tables(B0_ROW["seed"])
    assert worlds[keys["B0"]]["emails"] != B0_ROW["expected_state"]["emails"]  # email_send not run

    # (b) reply arrived after the park request -> P1: reply kept, its tool pending, not run
    p1 = by_key[keys["P1"]]
    assert p1["boundary"] == "P1"
    assert p1["state"]["step"] == 2 and p1["state"]["pending_tools"] is True
    items = p1["state"]["new_outputs"]
    assert [i["type"] for i in items] == ["function_call", "function_call_output", "function_call"]
    kept = P1_ROW["ground_truth"][1]
    assert (items[-1]["name"], json.loads(items[-1]["arguments"])) == (kept["name"], kept["arguments"])
    assert [c["name"] for c in _calls(p1["state"]["last_model_response"])] == [kept["name"]]
    assert _tables(worlds[keys["P1"]]) == _tables(P1_ROW["seed"])
    assert worlds[keys["P1"]]["events"] != P1_ROW["expected_state"]["events"]  # no event yet

    # (c) inside its tools -> P2 after they returned; its world has the turn-2 change
    p2 = by_key[keys["P2"]]
    assert p2["boundary"] == "P2"
    assert p2["state"]["step"] == 2 and p2["state"]["pending_tools"] is False
    assert [i["type"] for i in p2["state"]["new_outputs"]] == ["function_call", "function_call_output"] * 2
    assert _tables(worlds[keys["P2"]]) == _tables(P2_ROW["expected_state"])
    assert worlds[keys["P2"]]["tasks"] != P2_ROW["seed"]["tasks"]

    for b in ("B0", "P1", "P2"):  # each agent record's cookie names its Workplace session
        session = by_key[keys[b]]["state"]["resources_cookies"]["ng_session"]
        assert [r["session_id"] for r in wp_records if r["episode_id"]["rollout_id"] == keys[b]] == [session]

    # The originals finish normally after resume.
    await gym.resume("park-1")
    gym.release(rows["B0"], 1)
    for b in ("B0", "P1", "P2"):
        assert (await finished(runs[b], rows[b], keys[b]))["restored_from"] is None
        assert gym.turn_calls(rows[b]) == [0, 1, 2]

    # Restore the checkpoint in place: each continues from its boundary as attempt 1.
    mapping = {name: [ep(k) for k in reply.episode_ids] for name, reply in commits.items()}
    restored = await gym.restore("park-r", tmp_path, mapping, "park-1")
    for name in (MODEL, WORKPLACE, SIMPLE):
        assert sorted(restored[name].restored) == sorted(f"{k}-a1" for k in keys.values())
    await gym.resume("park-r")
    again = {b: gym.start_run(SIMPLE, rows[b], f"{keys[b]}-a1") for b in ("B0", "P1", "P2")}
    for b in ("B0", "P1", "P2"):
        reply = await finished(again[b], rows[b], f"{keys[b]}-a1")
        assert reply["restored_from"] == b
    assert gym.turn_calls(rows["B0"]) == [0, 1, 2, 1, 2]  # B0: the turn-2 model call is issued again
    assert gym.turn_calls(rows["P1"]) == [0, 1, 2, 2]  # P1: the kept reply is not asked for again
    assert gym.turn_calls(rows["P2"]) == [0, 1, 2, 2]


def _calls(reply: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [i for i in (reply or {}).get("output", []) if i.get("type") == "function_call"]


async def _inflight(gym: Gym, server: str, n: int) -> bool:
    return (await gym.report(server))["counts"].get("inflight") == n


async def _at_boundary(gym: Gym, n: int) -> dict[str, Any] | None:
    report = await gym.report(SIMPLE)
    return report if report["counts"].get("at_boundary") == n else None


# -- 4. a session agent on a restart-only resources server -----------------------------------
async def test_session_agent_on_restart_only_sandbox_blocks_or_is_unsaved(gym: Gym, tmp_path: Path):
    row, key = SANDBOX_ROW, "sandbox-0"
    gym.hold(row, 1)
    run = gym.start_run(SANDBOX_AGENT, row, key)
    await gym.wait_for_held(row, 1)

    result, elapsed = await gym.prepare("sandbox-block", 1.0, "block")
    assert result.prepared is False
    assert result.blockers == {SANDBOX: [key]}, result.blockers
    assert result.unsaved == {}
    assert result.replies[SANDBOX_AGENT].phase == "prepared"  # the agent itself parked fine (B0)
    assert elapsed >= 0.9
    await gym.resume("sandbox-block")

    result, elapsed = await gym.prepare("sandbox-best", 6.0, "best_effort")
    assert result.prepared is True and result.blockers == {}, result
    assert result.unsaved == {SANDBOX: [key]}
    assert elapsed < 3.0
    assert result.continued([ep(key)]) == []
    commits = await gym.commit("sandbox-best", tmp_path, result.continued([ep(key)]))
    assert all(r.episode_ids == [] for r in commits.values()), commits
    await gym.resume("sandbox-best")

    gym.release(row, 1)
    status, reply = await asyncio.wait_for(run, 15)
    assert status == 200 and reply["reward"] == 1.0, reply


# -- 5. restore into fresh processes --------------------------------------------------------
async def test_restore_into_fresh_processes_continues_from_P2_without_seeding_again(
    backend: ScriptedBackend, tmp_path: Path
):
    row, key = FRESH_ROW, "fresh-0"
    created = row["ground_truth"][1]["arguments"]
    assert row["ground_truth"][1]["name"] == FRESH_SLOW_TOOL
    assert not any(e["title"] == created["title"] and e["start"] == created["start"] for e in row["seed"]["events"])
    config = small_config(backend.base_url, tool_delay_s={FRESH_SLOW_TOOL: FRESH_SLOW_TOOL_S})
    ckpt = tmp_path / "ckpt"

    # First deployment: park the session at P2 (after the event is created), commit, crash.
    with GymDeployment.start(config, log_dir=tmp_path / "logs-1") as first:
        async with open_gym(first, backend, check_idle=False) as gym:
            run = gym.start_run(SIMPLE, row, key)
            await eventually(lambda: _inflight(gym, WORKPLACE, 1), "the session to be inside calendar_create_event")
            result, elapsed = await gym.prepare("fresh-1", 10.0)
            assert result.prepared, result
            assert elapsed > 0.2  # waited for the slow tool to return
            commits = await gym.commit("fresh-1", ckpt, [ep(key)])
            exported = {name: r.episode_ids for name, r in commits.items()}
            assert exported == {MODEL: [key], WORKPLACE: [key], SIMPLE: [key]}
            _, records = read_participant_state(ckpt, "agent", SIMPLE, "fresh-1")
            assert records[0]["boundary"] == "P2" and records[0]["state"]["step"] == 2
            session_id = records[0]["state"]["resources_cookies"]["ng_session"]
            gym.checkpoints.clear()  # a crash: nobody resumes this deployment
            for server in first.servers:
                first.kill_server(server.name)
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(run, 10)
    assert gym.turn_calls(row) == [0, 1]

    # Second deployment: fresh processes, the same backend.
    with GymDeployment.start(config, log_dir=tmp_path / "logs-2") as second:
        async with open_gym(second, backend) as gym:
            assert (await gym.report(WORKPLACE))["counts"]["sessions"] == 0
            mapping = {name: [ep(k) for k in keys] for name, keys in exported.items()}
            restored = await gym.restore("fresh-r", ckpt, mapping, "fresh-1")
            assert {name: r.restored for name, r in restored.items()} == {n: [f"{key}-a1"] for n in exported}
            await gym.resume("fresh-r")
            assert (await gym.report(WORKPLACE))["counts"]["sessions"] == 1

            gym.hold(row, 2)  # stop before the final answer to look at the world
            again = gym.start_run(SIMPLE, row, f"{key}-a1")
            await gym.wait_for_held(row, 2)
            assert (await gym.report(WORKPLACE))["counts"]["sessions"] == 1  # no new /seed_session
            listing = await gym.tool(WORKPLACE, "calendar_search_events", {"query": created["start"]}, session_id)
            lines = [ln for ln in listing.splitlines() if f": {created['title']}, {created['start']}," in ln]
            assert len(lines) == 1, listing  # the event created before the checkpoint, exactly once
            gym.release(row, 2)
            reply = await finished(again, row, f"{key}-a1")
            assert reply["restored_from"] == "P2"
            assert gym.turn_calls(row) == [0, 1, 2]  # turns 1-2 were not asked again

            status, reference = await gym.run(SIMPLE, row, "fresh-ref")
            assert status == 200, reference
            assert reference["reward"] == reply["reward"] == 1.0
            assert [(i["type"], i.get("name"), i.get("arguments")) for i in reply["response"]["output"]] == [
                (i["type"], i.get("name"), i.get("arguments")) for i in reference["response"]["output"]
            ]


# -- 6. status, auth, malformed requests, lease ------------------------------------------------
async def test_status_auth_and_malformed_requests_change_nothing(gym: Gym):
    assert sorted(gym.parts.names) == sorted(ALL_SERVERS)
    expected_extra = {
        PLAIN: ("restart_only", True), SIMPLE: ("restart_only", False), SANDBOX_AGENT: ("restart_only", False),
        WORKPLACE: ("mode", "exported"), SANDBOX: ("mode", "restart_only"),
    }
    for server in ALL_SERVERS:
        status, body = await gym.status(server)
        assert status == 200, body
        assert body["phase"] == "idle" and body["checkpoint_id"] is None
        if server in expected_extra:
            field, value = expected_extra[server]
            assert body[field] is value if isinstance(value, bool) else body[field] == value, (server, body)
        else:
            assert body["kind"] == "model"
    for p in gym.parts:  # the library sees the same
        if p.name in expected_extra:
            field, value = expected_extra[p.name]
            assert (p.status.model_extra or {})[field] == value

    now = time.time()
    good = {"checkpoint_id": "auth-1", "deadline_ts": now + 10}
    malformed: list[tuple[dict[str, Any] | None, str | None, str]] = [
        ({"checkpoint_id": "bad id!", "deadline_ts": now + 10}, None, "checkpoint_id"),
        ({"checkpoint_id": "", "deadline_ts": now + 10}, None, "checkpoint_id"),
        (None, '{"checkpoint_id": "mal-1", "deadline_ts": Infinity}', "deadline_ts"),
        (None, '{"checkpoint_id": "mal-1", "deadline_ts": NaN}', "deadline_ts"),
        ({"checkpoint_id": "mal-1", "deadline_ts": "soon"}, None, "deadline_ts"),
        ({"checkpoint_id": "mal-1", "deadline_ts": now + 10, "surprise": 1}, None, "surprise"),
        ({"checkpoint_id": "mal-1", "deadline_ts": now + 10, "restart_only_policy": "maybe"}, None,
         "restart_only_policy"),
    ]
    for server in ALL_SERVERS:
        for token in (None, "wrong-token", TOKEN + "x"):
            status, body = await gym.status(server, token=token)
            assert status == 401 and body["error"]["code"] == "unauthorized", (server, body)
            status, body = await gym.post_control(server, "prepare", good, token=token)
            assert status == 401 and body["error"]["code"] == "unauthorized", (server, body)
        for body_json, raw, named in malformed:
            status, body = await gym.post_control(server, "prepare", body_json, raw=raw)
            assert 400 <= status < 500, (server, named, body)
            assert body["error"]["code"] == "invalid_request" and named in body["error"]["detail"], (server, body)
        status, body = await gym.status(server)
        assert body["phase"] == "idle" and body["checkpoint_id"] is None, (server, body)
        assert body["lease_expires_at"] is None
    _, model = await gym.status(MODEL)
    assert model["accepting"] is True  # the rejected prepares closed nothing

    # Nothing was stored or fenced: the ids from the rejected calls still work.
    for cid in ("auth-1", "mal-1"):
        result, _ = await gym.prepare(cid, 5.0)
        assert result.prepared, result
        await gym.resume(cid)


async def test_expired_lease_reopens_a_prepared_deployment(backend: ScriptedBackend, tmp_path: Path):
    grace = 0.5
    with GymDeployment.start(small_config(backend.base_url, lease_grace_s=grace), log_dir=tmp_path) as dep:
        async with open_gym(dep, backend) as gym:
            row, key = LEASE_ROW, "lease-0"
            gym.hold(row, 1)
            run = gym.start_run(SIMPLE, row, key)
            await gym.wait_for_held(row, 1)
            deadline = time.time() + 0.5
            result = await co.call(gym.parts, PrepareCall(checkpoint_id="lease-1", deadline_ts=deadline,
                                                          restart_only_policy="block"))  # then the controller "dies"
            assert result.prepared, result
            for p in gym.parts:
                _, body = await gym.status(p.name)
                assert body["phase"] == "prepared"
                assert body["lease_expires_at"] == pytest.approx(deadline + grace, abs=1e-3)
            gym.release(row, 1)
            await eventually(lambda: _model_holds(gym, 1), "the model to hold the reply", timeout_s=0.8)
            assert not run.done()
            await eventually(gym.all_idle, "every lease to expire", timeout_s=5.0)
            assert time.time() >= deadline + grace
            for p in gym.parts:
                _, body = await gym.status(p.name)
                assert body["checkpoint_id"] is None and body["lease_expires_at"] is None
            reply = await finished(run, row, key)  # the held reply was delivered
            assert reply["restored_from"] is None
            status, body = await gym.post_control(
                SIMPLE, "prepare", {"checkpoint_id": "lease-1", "deadline_ts": time.time() + 5})
            assert status == 409 and body["error"]["code"] == "stale_checkpoint", body  # the expired id is spent


# -- 7. a corrupt records file -----------------------------------------------------------------
async def test_flipped_byte_in_a_records_file_fails_restore_naming_the_file(gym: Gym, tmp_path: Path):
    row, key = CORRUPT_ROW, "corrupt-0"
    gym.hold(row, 1)
    run = gym.start_run(SIMPLE, row, key)
    await gym.wait_for_held(row, 1)
    result, _ = await gym.prepare("corrupt-1", 10.0)
    assert result.prepared, result
    commits = await gym.commit("corrupt-1", tmp_path, [ep(key)])
    await gym.resume("corrupt-1")
    gym.release(row, 1)
    await finished(run, row, key)

    manifest = commits[SIMPLE].manifest
    records_path = tmp_path / "gym" / "agent" / SIMPLE / manifest.records_file
    data = bytearray(records_path.read_bytes())
    assert manifest.record_count == 1 and data
    records_path.chmod(0o644)
    data[len(data) // 2] ^= 0x01
    records_path.write_bytes(bytes(data))

    mapping = {name: [ep(k) for k in reply.episode_ids] for name, reply in commits.items()}
    with pytest.raises(co.CoordinationError) as caught:
        await gym.restore("corrupt-r", tmp_path, mapping, "corrupt-1")
    assert str(records_path) in str(caught.value), str(caught.value)
    assert caught.value.server == SIMPLE and caught.value.code == "invalid_checkpoint_state"
    assert await gym.all_idle()  # the library undid the other servers' restores
