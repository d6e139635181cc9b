"""The live-interpreter sandbox: real subprocesses, always closed by the test."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gym_patches.resources_servers import ToolError
from gym_patches.resources_servers.python_sandbox import (
    TOOL_SCHEMAS,
    InterpreterSession,
    SandboxError,
    SandboxEvalError,
    call_sandbox_tool,
    seed_sandbox,
    verify_sandbox,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.02)
    return _gone(pid)


def _live_children() -> set[int]:
    me, kids = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                kids.add(int(entry))
    return kids


@pytest.fixture(autouse=True)
def no_leaked_interpreters():
    """Every test must leave no interpreter of its own running."""
    before = _live_children()
    yield
    leaked = _live_children() - before
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    assert not leaked, f"test left child processes running: {sorted(leaked)}"


@pytest.fixture
async def session():
    s = await InterpreterSession.start()
    try:
        yield s
    finally:
        await s.close()


async def test_state_persists_between_runs(session):
    assert await session.run("x = 3") == ""
    assert await session.run("print(x)\nx + 4") == "3\n7\n"
    assert await session.run("None") == ""
    assert await session.evaluate("x * 2") == "6"
    assert await session.evaluate("'a' + 'b'") == "'ab'"


async def test_sessions_are_isolated():
    a, b = await InterpreterSession.start(), await InterpreterSession.start()
    try:
        assert a.pid != b.pid
        await a.run("secret = 1")
        assert "NameError" in await b.run("secret")
    finally:
        await a.close()
        await b.close()


async def test_two_interpreters_running_the_same_cells_print_the_same_sets_and_hashes(monkeypatch):
    """What a replay relies on: a fresh session that runs a session's cells again ends in the same state,
    also where string hashing shows (set order, ``hash``), whatever the server's own environment says."""
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    monkeypatch.setenv("PYTHONSTARTUP", "/nonexistent")  # a server's PYTHON* variables never reach user code
    cell = "s = {'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta'}\nprint(list(s), hash('alpha'))"
    outputs = []
    for _ in range(2):
        async with await InterpreterSession.start() as s:
            outputs.append(await s.run(cell))
            assert await s.evaluate("__import__('os').environ.get('PYTHONSTARTUP')") == "None"
    assert outputs[0] == outputs[1] and "alpha" in outputs[0]


async def test_exceptions_are_reported_and_session_survives(session):
    out = await session.run("print('before')\n1 / 0")
    assert out == "before\nError: ZeroDivisionError: division by zero"
    assert (await session.run("def f(:")).startswith("Error: ")
    assert "SyntaxError" in await session.run("def f(:")
    assert await session.run("import sys; sys.exit(3)") == "Error: SystemExit: 3"
    assert await session.run("print('still here')") == "still here\n"
    with pytest.raises(SandboxEvalError, match="NameError"):
        await session.evaluate("missing")


async def test_user_code_cannot_touch_the_protocol_pipes(session):
    out = await session.run(
        "import os, sys\nos.write(1, b'garbage\\n')\nprint('err', file=sys.stderr)\n"
        "print(sys.stdin.read() == '')")
    assert out == "err\nTrue\n"
    assert "EOFError" in await session.run("input()")
    assert await session.evaluate("1 + 1") == "2"


async def test_long_output_is_cut(session):
    out = await session.run("print('a' * 20000)")
    assert out.startswith("a" * 100) and "characters cut" in out and len(out) < 9000


async def test_timeout_interrupts_but_keeps_state(session):
    await session.run("x = 41")
    started = time.monotonic()
    out = await session.run("while True: pass", timeout_s=0.3)
    assert out == "Error: TimeoutError: code ran longer than 0.3 s"
    assert time.monotonic() - started < 3
    assert await session.evaluate("x + 1") == "42"


async def test_code_that_swallows_the_interrupt_is_killed():
    s = await InterpreterSession.start()
    try:
        code = "import time\nwhile True:\n    try:\n        time.sleep(1)\n    except KeyboardInterrupt:\n        pass"
        with pytest.raises(SandboxError, match="killed"):
            await s.run(code, timeout_s=0.2)
        assert not s.alive and _gone(s.pid)
        with pytest.raises(SandboxError, match="not running"):
            await s.run("1")
    finally:
        await s.close()


async def test_interpreter_that_exits_raises_sandbox_error():
    s = await InterpreterSession.start()
    try:
        with pytest.raises(SandboxError, match="exited with code 7"):
            await s.run("import os; os._exit(7)")
        assert not s.alive
    finally:
        await s.close()


async def test_close_kills_reaps_and_is_idempotent():
    s = await InterpreterSession.start()
    pid = s.pid
    assert not _gone(pid)
    await s.close()
    await s.close()
    assert _gone(pid) and not s.alive
    with pytest.raises(SandboxError):
        await s.evaluate("1")


async def test_context_manager_closes():
    async with await InterpreterSession.start() as s:
        pid = s.pid
        assert await s.evaluate("2 ** 10") == "1024"
    assert _gone(pid)


async def test_concurrent_calls_are_serialised(session):
    first = session.run("import time\ntime.sleep(0.2)\nv = 1")
    second = session.run("v")
    assert await asyncio.gather(first, second) == ["", "1\n"]


async def test_bad_arguments_are_rejected(session):
    with pytest.raises(TypeError, match="code must be a str"):
        await session.run(b"1")
    with pytest.raises(ValueError, match="timeout_s"):
        await session.run("1", timeout_s=0)


def test_child_dies_with_its_parent(tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the owner while user code runs; the interpreter follows.

    (An idle interpreter would also exit on stdin EOF; a busy one only dies by the signal.)
    """
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent("""
        import asyncio, sys
        from gym_patches.resources_servers.python_sandbox import InterpreterSession
        async def main():
            s = await InterpreterSession.start()
            busy = asyncio.ensure_future(s.run("import time; time.sleep(60)", timeout_s=120))
            await asyncio.sleep(0.2)  # the interpreter is now inside user code
            print(s.pid, flush=True)
            await busy
        asyncio.run(main())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    owner = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(owner.stdout.readline())
        assert not _gone(child)
        owner.kill()
        owner.wait(timeout=10)
        assert _wait_gone(child), "interpreter outlived its parent"
    finally:
        owner.kill()
        owner.wait(timeout=10)
        owner.stdout.close()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)


# tool, seed, verify --------------------------------------------------------------
def test_tool_schema_shape():
    [schema] = TOOL_SCHEMAS
    assert schema["name"] == "python_exec" and schema["type"] == "function"
    assert schema["strict"] is False
    assert schema["parameters"]["additionalProperties"] is False
    assert schema["parameters"]["required"] == ["code"]


async def test_python_exec_tool(session):
    assert await call_sandbox_tool(session, "python_exec", {"code": "y = 2"}) == "(no output)"
    assert await call_sandbox_tool(session, "python_exec", {"code": "y * 5"}) == "10\n"
    assert await call_sandbox_tool(session, "python_exec", {"code": 5}) == \
        "Error: code must be a string"
    with pytest.raises(ToolError, match="unknown tool 'shell'"):
        await call_sandbox_tool(session, "shell", {"code": "ls"})
    with pytest.raises(ToolError, match="missing argument.*'code'"):
        await call_sandbox_tool(session, "python_exec", {})
    with pytest.raises(ToolError, match="unknown argument.*'timeout'"):
        await call_sandbox_tool(session, "python_exec", {"code": "1", "timeout": 3})


async def test_seed_runs_setup_and_verify_reads_live_answer():
    row = {"seed": {"setup": "n = 5"}, "expected_answer": "8"}
    s = await seed_sandbox(row)
    try:
        assert await verify_sandbox(s, row) == 0.0  # answer not yet defined
        await s.run("answer = n + 2")
        assert await verify_sandbox(s, row) == 0.0
        await s.run("answer = n + 3")
        assert await verify_sandbox(s, row) == 1.0
        await s.run("answer = '8'")  # repr differs: "'8'" != "8"
        assert await verify_sandbox(s, row) == 0.0
        with pytest.raises(ValueError, match="expected_answer"):
            await verify_sandbox(s, {"seed": {}})
    finally:
        await s.close()


async def test_verify_needs_a_live_interpreter():
    row = {"seed": {"setup": "answer = 1"}, "expected_answer": "1"}
    s = await seed_sandbox(row)
    assert await verify_sandbox(s, row) == 1.0
    await s.close()
    with pytest.raises(SandboxError):
        await verify_sandbox(s, row)


@pytest.mark.parametrize(
    "row, needle",
    [
        ({"seed": {"setup": "1 / 0"}}, "seed.setup failed: ZeroDivisionError"),
        ({"seed": {"setup": "x = 1", "other": 2}}, "seed.other"),
        ({"seed": {"setup": 3}}, "seed.setup"),
        ({"seed": {}, "expected_answer": 8}, "expected_answer"),
        ([], "row must be a JSON object"),
    ],
)
async def test_bad_rows_fail_loudly(row, needle):
    with pytest.raises(ValueError, match=needle):
        await seed_sandbox(row)
