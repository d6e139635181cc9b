"""The run harness's record readers, environment and command, and the Gym client's connection pool.

The pool test is the regression test for a deadlock the benchmark found when it
started measuring through the controller: with more than 100 rollouts parked on
one Gym replica, every pooled connection was held by a parked ``/run`` and the
snapshot's own control calls waited for a connection until the deadline.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from aiohttp import web

from gym_patches.server_utils import ServerClient
from nemo_rl.algorithms.single_controller_utils.config import load_config
from testkit.run_harness import (
    CRASH_ENV,
    MARKER_ENV,
    REPO,
    JsonlFollower,
    RunDirs,
    after_committed_in_step,
    after_committed_snapshots,
    grpo_command,
    read_jsonl,
    run_env,
    scripted_overrides,
)
from testkit.write_faults import FailingWriter, write_fault_overrides


def test_read_jsonl_skips_a_line_torn_by_a_kill(tmp_path):
    path = tmp_path / "snapshots.jsonl"
    assert read_jsonl(path) == []
    path.write_text('{"a": 1}\n\n{"b": 2}\n{"c": ')
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}]


def test_follower_returns_only_complete_new_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    follow = JsonlFollower(path)
    assert follow.poll() == []
    path.write_text('{"step": 1}\n{"step": ')
    assert [r for _, r in follow.poll()] == [{"step": 1}]
    with open(path, "a") as f:
        f.write('2}\n')
    assert [r for _, r in follow.poll()] == [{"step": 2}]
    assert follow.records() == [{"step": 1}, {"step": 2}]


def test_run_dirs_read_records_and_restore(tmp_path):
    dirs = RunDirs(tmp_path)
    assert dirs.restore_record() is None and dirs.restore_mtime_ns() is None
    dirs.logs.mkdir()
    (dirs.logs / "restore.json").write_text('{"restored_turn": 3}')
    assert dirs.restore_json() == dirs.restore_record() == {"restored_turn": 3}
    assert f"logger.log_dir={dirs.logs}" in dirs.overrides()


def test_run_env_marker_crash_hook_and_pythonpath(tmp_path):
    base = {"PATH": "/bin", CRASH_ENV: "commit:2", "PYTHONPATH": "/elsewhere"}
    env = run_env(marker="m1", pythonpath=[tmp_path], base=base)
    assert env[MARKER_ENV] == "m1"
    # a crash point from the caller's environment never leaks into a run
    assert CRASH_ENV not in env
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), str(REPO), "/elsewhere"]
    assert run_env(crash="publish:3", base=base)[CRASH_ENV] == "publish:3"


def test_a_write_fault_is_config_naming_the_failing_writer():
    overrides = write_fault_overrides("ENOSPC:records.jsonl:2")
    config = load_config(None, overrides)
    assert config.checkpointing.storage_writer.class_path == "testkit.write_faults:FailingWriter"
    writer = config.checkpointing.storage_writer.build()
    assert isinstance(writer, FailingWriter) and writer.fault.fragment == "records.jsonl" and writer.fault.nth == 2


def test_scripted_overrides_are_config_keys_of_the_fake():
    assert scripted_overrides() == []
    overrides = scripted_overrides(0.3, jitter_s=0.8)
    assert overrides == ["policy.scripted_backend.delay_s=0.3", "policy.scripted_backend.jitter_s=0.8"]
    config = load_config(None, ["policy.model_name=scripted-test-backend", *overrides])
    assert (config.policy.scripted_backend.delay_s, config.policy.scripted_backend.jitter_s) == (0.3, 0.8)


def test_the_run_is_the_test_entry_module_not_a_file_under_examples(tmp_path):
    command = grpo_command(["--help"])
    assert command[1:3] == ["-m", "testkit.run_grpo"] and "examples" not in " ".join(command)
    # it starts from the repository root alone (no examples/ on the path), as the harness runs it
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--config" in proc.stdout
    assert sys.executable == command[0]


def test_kill_conditions_count_committed_snapshots(tmp_path):
    dirs = RunDirs(tmp_path)
    dirs.logs.mkdir()
    snaps = dirs.logs / "snapshots.jsonl"
    snaps.write_text('{"committed": true, "step": 0, "saved": 4}\n')
    nth = after_committed_snapshots(dirs, 1, extra_s=0.5)  # counts from now on
    in_step = after_committed_in_step(dirs, 1)
    assert not nth(0.0) and not in_step(0.0)
    with open(snaps, "a") as f:
        f.write('{"committed": false, "step": 1, "saved": 0}\n{"committed": true, "step": 1, "saved": 2}\n')
    assert not nth(1.0)  # seen now; holds 0.5 s later
    assert nth(1.6)
    assert not in_step(2.0)  # seen at this poll; holds from the next one (extra_s=0)
    assert in_step(2.0)


async def test_gym_client_has_no_connection_cap_so_control_calls_pass_parked_runs():
    release = asyncio.Event()
    held = 0

    async def hold(_request):
        nonlocal held
        held += 1
        await release.wait()
        return web.json_response({})

    async def control(_request):
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes([web.post("/run", hold), web.get("/status", control)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client = ServerClient(None)  # type: ignore[arg-type] - only the session is used here
    parked = [asyncio.create_task(client.session.post(f"http://127.0.0.1:{port}/run")) for _ in range(130)]
    try:
        for _ in range(200):
            if held == 130:
                break
            await asyncio.sleep(0.02)
        assert held == 130  # more than aiohttp's default pool of 100 are open at once
        async with asyncio.timeout(5):
            async with client.session.get(f"http://127.0.0.1:{port}/status") as resp:
                assert (await resp.json()) == {"ok": True}
    finally:
        release.set()
        for resp in await asyncio.gather(*parked, return_exceptions=True):
            if hasattr(resp, "release"):
                resp.release()
        await client.session.close()
        await runner.cleanup()
