"""Resources servers over real HTTP in real processes, with checkpoint control on.

Workplace (``exported``): a call in flight delays prepare, new calls are held,
commit writes the world, and a fresh process restored from it routes the old
cookie to the saved world under the next attempt. Python sandbox
(``restart_only``): blocks under ``block``, reports unsaved under ``best_effort``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest

from gym_patches.launch import GymDeployment

pytestmark = pytest.mark.functional

TOKEN = "resources-test-token"
CONTROL = "/ng-control/v1/checkpoint"
DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
CREATE_DELAY_S = 1.0  # calendar_create_event is slow so a test can catch it mid-flight


def first_row(name: str) -> dict[str, Any]:
    with open(DATA / name) as f:
        return json.loads(f.readline())


def gym_config(with_sandbox: bool = True) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 60},
        "workplace": {
            "resources_servers": {"workplace_assistant": {"tool_delay_s": {"calendar_create_event": CREATE_DELAY_S}}}
        },
    }
    if with_sandbox:
        cfg["sandbox"] = {"resources_servers": {"python_sandbox": {"exec_timeout_s": 5}}}
    return cfg


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymDeployment]:
    with GymDeployment.start(gym_config(), log_dir=tmp_path_factory.mktemp("logs")) as d:
        yield d


class Gym:
    """Tiny HTTP helper: sends the session cookie explicitly (no cookie jar for IP hosts)."""

    def __init__(self, http: aiohttp.ClientSession, dep: GymDeployment):
        self.http, self.dep = http, dep

    async def post(self, server: str, path: str, body: Any = None, *, cookie: str | None = None) -> tuple[int, Any]:
        headers = {"Cookie": f"ng_session={cookie}"} if cookie else {}
        if path.startswith(CONTROL):
            headers["Authorization"] = f"Bearer {TOKEN}"
        async with self.http.post(self.dep.url(server) + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    async def seed(self, server: str, row: dict[str, Any], key: str) -> str:
        async with self.http.post(self.dep.url(server) + "/seed_session", json={"row": row, "_ng_rollout_id": key}) as r:
            body = await r.json()
            assert r.status == 200, body
            assert r.cookies["ng_session"].value == body["session_id"]
            return body["session_id"]

    async def tool(self, server: str, sid: str, name: str, args: dict[str, Any]) -> str:
        status, body = await self.post(server, f"/{name}", args, cookie=sid)
        assert status == 200, body
        return body["output"]

    async def verify(self, server: str, sid: str, row: dict[str, Any]) -> float:
        status, body = await self.post(server, "/verify", {"row": row, "response": {"output": []}}, cookie=sid)
        assert status == 200, body
        return body["reward"]

    async def control(self, server: str, op: str, checkpoint_id: str, timeout_s: float = 10.0, **kw: Any) -> tuple[int, Any]:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + timeout_s, **kw}
        return await self.post(server, f"{CONTROL}/{op}", body)

    async def status(self, server: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with self.http.get(self.dep.url(server) + f"{CONTROL}/status", headers=headers) as resp:
            assert resp.status == 200
            return await resp.json()


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


def children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


async def run_ground_truth(gym: Gym, server: str, sid: str, row: dict[str, Any]) -> None:
    for call in row["ground_truth"]:
        output = await gym.tool(server, sid, call["name"], call["arguments"])
        assert not output.startswith("Error"), output


async def test_status_shows_mode(dep: GymDeployment, http: aiohttp.ClientSession) -> None:
    gym = Gym(http, dep)
    wp, sb = await gym.status("workplace"), await gym.status("sandbox")
    assert (wp["kind"], wp["mode"], wp["phase"]) == ("resources", "exported", "idle")
    assert (sb["kind"], sb["mode"]) == ("resources", "restart_only")
    assert {s.name: s.checkpoint_mode for s in dep.servers} == {"workplace": "saves", "sandbox": "restart-only"}


async def test_workplace_session_routes(dep: GymDeployment, http: aiohttp.ClientSession) -> None:
    gym, row = Gym(http, dep), first_row("workplace_val.jsonl")
    sid = await gym.seed("workplace", row, "wp-plain")
    await run_ground_truth(gym, "workplace", sid, row)
    assert await gym.verify("workplace", sid, row) == 1.0
    status, body = await gym.post("workplace", "/verify", {"row": row, "response": {"output": []}}, cookie=sid)
    assert status == 400 and body["error"]["code"] == "unknown_session"  # verify ended it

    idle = await gym.seed("workplace", row, "wp-idle")  # no tools run: the task is not done
    assert await gym.verify("workplace", idle, row) == 0.0

    sid = await gym.seed("workplace", row, "wp-errors")
    cases = [
        ("/no_such_tool", {}, sid, 404, "unknown_tool"),
        ("/directory_find_email", {"who": "Eli"}, sid, 422, "invalid_arguments"),
        ("/directory_find_email", ["Eli"], sid, 422, "invalid_arguments"),
        ("/directory_find_email", {"name": "Eli"}, None, 400, "unknown_session"),
        ("/directory_find_email", {"name": "Eli"}, "forged", 400, "unknown_session"),
        ("/seed_session", {"row": row}, None, 400, "rollout_id_required"),
        ("/seed_session", {"row": {"no": "seed"}, "_ng_rollout_id": "wp-x"}, None, 422, "invalid_request"),
        ("/seed_session", {"row": row, "_ng_rollout_id": "bad key!"}, None, 422, "invalid_request"),
    ]
    for path, body, cookie, want_status, want_code in cases:
        status, reply = await gym.post("workplace", path, body, cookie=cookie)
        assert (status, reply["error"]["code"]) == (want_status, want_code), (path, reply)
        assert "workplace" in reply["error"]["detail"]
    assert (await gym.tool("workplace", sid, "directory_find_email", {"name": "Nobody"})).startswith("Error")
    status, reply = await gym.post("workplace", "/close_session", cookie=sid)
    assert status == 200 and reply["closed"] is True
    status, reply = await gym.post("workplace", "/directory_find_email", {"name": "Eli"}, cookie=sid)
    assert status == 400 and reply["error"]["code"] == "unknown_session"


async def test_sandbox_session_routes_and_subprocess_lifetime(dep: GymDeployment, http: aiohttp.ClientSession) -> None:
    gym, row = Gym(http, dep), first_row("sandbox_val.jsonl")
    pid = dep.pid("sandbox")
    before = len(children(pid))
    sid = await gym.seed("sandbox", row, "sb-plain")
    assert len(children(pid)) == before + 1  # one live interpreter for the session
    await run_ground_truth(gym, "sandbox", sid, row)
    assert await gym.verify("sandbox", sid, row) == 1.0
    assert len(children(pid)) == before  # verify killed and reaped it

    other = await gym.seed("sandbox", row, "sb-wrong")
    assert await gym.tool("sandbox", other, "python_exec", {"code": "answer = -1"}) == "(no output)"
    assert "ZeroDivisionError" in await gym.tool("sandbox", other, "python_exec", {"code": "1/0"})
    assert await gym.verify("sandbox", other, row) == 0.0
    closing = await gym.seed("sandbox", row, "sb-closed")
    status, _ = await gym.post("sandbox", "/close_session", cookie=closing)
    assert status == 200 and len(children(pid)) == before


async def test_exported_prepare_commit_and_restore_into_fresh_process(
    dep: GymDeployment, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    gym, row = Gym(http, dep), first_row("workplace_val.jsonl")
    find, create = row["ground_truth"]
    key, cid, ckpt = "wp-saved", "ckpt-wp-1", tmp_path / "ckpt"

    # the reward an uninterrupted run of this row gets
    plain = await gym.seed("workplace", row, "wp-uninterrupted")
    await run_ground_truth(gym, "workplace", plain, row)
    uninterrupted = await gym.verify("workplace", plain, row)

    sid = await gym.seed("workplace", row, key)
    await gym.tool("workplace", sid, find["name"], find["arguments"])
    in_flight = asyncio.create_task(gym.tool("workplace", sid, create["name"], create["arguments"]))
    await asyncio.sleep(0.3)
    status, reply = await gym.control("workplace", "prepare", cid, timeout_s=0.2)
    assert status == 200 and reply["phase"] == "preparing", reply
    assert reply["report"]["blockers"] == [key] and reply["report"]["counts"]["inflight"] == 1
    started = time.monotonic()
    status, reply = await gym.control("workplace", "prepare", cid)
    assert status == 200 and reply["phase"] == "prepared", reply
    assert reply["report"]["blockers"] == [] and reply["report"]["unsaved"] == []
    assert time.monotonic() - started < CREATE_DELAY_S + 1.0
    assert (await in_flight).startswith("Created event")

    held = asyncio.create_task(gym.tool("workplace", sid, "calendar_search_events", {"query": "Lunch"}))
    await asyncio.sleep(0.4)
    assert not held.done()  # new tool calls wait while prepared

    status, reply = await gym.control("workplace", "commit", cid, checkpoint_dir=str(ckpt), episode_ids=None)
    assert status == 200 and reply["episode_ids"] == [key], reply
    part_dir = ckpt / "gym" / "resources" / "workplace"
    records_file = part_dir / reply["manifest"]["records_file"]
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert len(records) == 1 and records[0]["session_id"] == sid
    assert records[0]["episode_id"] == {"rollout_id": key, "attempt": 0}
    assert [e["title"] for e in records[0]["state"]["events"]][-1] == create["arguments"]["title"]

    status, reply = await gym.control("workplace", "resume", cid)
    assert status == 200 and reply["phase"] == "idle"
    assert "E2" in await asyncio.wait_for(held, 5.0)

    # a flipped byte in a copy of the records file: restore names the file and installs nothing
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    broken_file = broken / records_file.relative_to(ckpt)
    data = bytearray(broken_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    broken_file.write_bytes(bytes(data))

    with GymDeployment.start(gym_config(with_sandbox=False), log_dir=tmp_path / "logs2") as fresh_dep:
        fresh = Gym(http, fresh_dep)
        status, reply = await fresh.post("workplace", "/calendar_search_events", {"query": "Lunch"}, cookie=sid)
        assert status == 400 and reply["error"]["code"] == "unknown_session"  # nothing before the restore

        status, reply = await fresh.control(
            "workplace", "restore", "restore-bad", checkpoint_dir=str(broken),
            episode_ids=[{"rollout_id": key, "attempt": 0}], source_checkpoint_id=cid,
        )
        assert status >= 400 and str(broken_file) in reply["error"]["detail"], reply
        assert (await fresh.status("workplace"))["report"]["counts"]["sessions"] == 0
        await fresh.control("workplace", "resume", "restore-bad")

        status, reply = await fresh.control(
            "workplace", "restore", "restore-1", checkpoint_dir=str(ckpt),
            episode_ids=[{"rollout_id": key, "attempt": 0}], source_checkpoint_id=cid,
        )
        assert status == 200 and reply["restored"] == [f"{key}-a1"], reply
        report = (await fresh.status("workplace"))["report"]
        assert report["counts"]["sessions"] == 1
        status, reply = await fresh.control("workplace", "resume", "restore-1")
        assert status == 200

        # the saved cookie routes to the restored world, now attempt 1
        assert "E2" in await fresh.tool("workplace", sid, "calendar_search_events", {"query": "Lunch"})
        await fresh.control("workplace", "prepare", "after-restore", restart_only_policy="block")
        status, reply = await fresh.control("workplace", "commit", "after-restore",
                                            checkpoint_dir=str(tmp_path / "again"), episode_ids=None)
        assert status == 200 and reply["episode_ids"] == [f"{key}-a1"], reply
        await fresh.control("workplace", "resume", "after-restore")
        assert await fresh.verify("workplace", sid, row) == uninterrupted == 1.0


async def test_restart_only_blocks_or_reports_unsaved(
    dep: GymDeployment, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    gym, row = Gym(http, dep), first_row("sandbox_val.jsonl")
    key = "sb-live"
    sid = await gym.seed("sandbox", row, key)
    await gym.tool("sandbox", sid, "python_exec", {"code": "x = x + 1"})

    status, reply = await gym.control("sandbox", "prepare", "sb-block", timeout_s=0.3)
    assert status == 200 and reply["phase"] == "preparing", reply
    assert reply["report"]["ready"] is False and reply["report"]["blockers"] == [key]
    status, _ = await gym.control("sandbox", "resume", "sb-block")
    assert status == 200

    status, reply = await gym.control("sandbox", "prepare", "sb-best", restart_only_policy="best_effort")
    assert status == 200 and reply["phase"] == "prepared", reply
    assert reply["report"]["blockers"] == [] and reply["report"]["unsaved"] == [key]

    # a seed while closed waits; tool calls on live sessions keep going
    waiting_seed = asyncio.create_task(gym.seed("sandbox", row, "sb-late"))
    assert await asyncio.wait_for(gym.tool("sandbox", sid, "python_exec", {"code": "print(x)"}), 5.0) == "8\n"
    await asyncio.sleep(0.3)
    assert not waiting_seed.done()

    status, reply = await gym.control("sandbox", "commit", "sb-best", checkpoint_dir=str(tmp_path),
                                      episode_ids=[{"rollout_id": key, "attempt": 0}])
    assert status == 409 and reply["error"]["code"] == "restart_in_scope", reply
    status, reply = await gym.control("sandbox", "commit", "sb-best", checkpoint_dir=str(tmp_path), episode_ids=[])
    assert status == 200 and reply["manifest"]["record_count"] == 0, reply

    status, _ = await gym.control("sandbox", "resume", "sb-best")
    assert status == 200
    late = await asyncio.wait_for(waiting_seed, 5.0)
    for s in (sid, late):
        status, _ = await gym.post("sandbox", "/close_session", cookie=s)
        assert status == 200
