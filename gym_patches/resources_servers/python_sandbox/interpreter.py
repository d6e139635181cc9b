"""A live Python interpreter per session: the honest ``restart_only`` resource.

Its state is a real process's memory, so it cannot be exported; if the
process is lost, so is the session. The child runs :mod:`.repl_driver`, dies
with its parent (``PR_SET_PDEATHSIG`` on Linux) and is killed and reaped by
:meth:`InterpreterSession.close`.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gym_patches.server_configs import SANDBOX_EXEC_TIMEOUT_S

from .. import ToolError, check_arguments, function_tool

DRIVER_PATH = Path(__file__).with_name("repl_driver.py")
DEFAULT_TIMEOUT_S = SANDBOX_EXEC_TIMEOUT_S
START_TIMEOUT_S = 15.0
INTERRUPT_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1
_READ_LIMIT = 1 << 20
# Resolved before any fork so the preexec_fn does as little as possible.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class SandboxError(RuntimeError):
    """The interpreter is gone (closed, crashed or killed); its state is lost."""


class SandboxEvalError(Exception):
    """``evaluate`` raised inside the interpreter; the message is the exception."""


def _die_with_parent(parent_pid: int) -> None:
    """preexec_fn: ask the kernel to SIGKILL us when the parent goes away.

    Linux ties this to the *thread* that forked us, so run sessions from a
    long-lived event-loop thread (the server's main loop).
    """
    if _LIBC is not None and _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(120)
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(121)


def interpreter_env() -> dict[str, str]:
    """The interpreter's environment: this process's without any ``PYTHON*`` variable (as ``-I`` would
    ignore them), and a fixed hash seed, so the same cells print sets and hashes of strings the same way
    in every process: a fresh session that runs a session's cells again ends in the same state (what a
    replay relies on, docs/design.md §4.5)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONHASHSEED"] = "0"
    return env


class InterpreterSession:
    """One ``python -u`` subprocess with a persistent namespace."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self._proc = proc
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.returncode is None

    @classmethod
    async def start(cls, *, start_timeout_s: float = START_TIMEOUT_S) -> "InterpreterSession":
        parent = os.getpid()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-u", "-s", "-P", str(DRIVER_PATH),
            env=interpreter_env(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # a terminal Ctrl-C must not reach user code
            preexec_fn=lambda: _die_with_parent(parent),
            limit=_READ_LIMIT,
        )
        session = cls(proc)
        try:
            hello = await asyncio.wait_for(session._read_reply(), start_timeout_s)
            if not hello.get("ready"):
                raise SandboxError(f"interpreter sent {hello!r} instead of a ready line")
        except BaseException:
            await session.close()
            raise
        return session

    async def _read_reply(self) -> dict:
        line = await self._proc.stdout.readline()
        if not line:
            code = await self._proc.wait()
            self._closed = True
            raise SandboxError(f"interpreter exited with code {code}; session state is lost")
        return json.loads(line)

    async def _request(self, op: str, code: str, timeout_s: float) -> dict:
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        async with self._lock:
            if not self.alive:
                raise SandboxError("interpreter is not running (closed or crashed)")
            try:
                self._proc.stdin.write((json.dumps({"op": op, "code": code}) + "\n").encode())
                await self._proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                await self.close()
                raise SandboxError("interpreter exited; session state is lost") from None
            try:
                return await asyncio.wait_for(self._read_reply(), timeout_s)
            except asyncio.TimeoutError:
                pass
            self._proc.send_signal(signal.SIGINT)  # the driver turns it into KeyboardInterrupt
            try:
                reply = await asyncio.wait_for(self._read_reply(), INTERRUPT_GRACE_S)
            except asyncio.TimeoutError:
                await self.close()
                raise SandboxError(
                    f"code ran longer than {timeout_s} s and ignored the interrupt; "
                    "interpreter killed, session state is lost"
                ) from None
            if reply.get("interrupted"):
                reply["error"] = f"TimeoutError: code ran longer than {timeout_s} s"
            return reply

    async def run(self, code: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """Execute ``code``; return captured output, plus ``Error: ...`` if it raised."""
        reply = await self._request("exec", code, timeout_s)
        out = reply.get("out") or ""
        if reply.get("error"):
            sep = "" if not out or out.endswith("\n") else "\n"
            out = f"{out}{sep}Error: {reply['error']}"
        return out

    async def evaluate(self, expr: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """``repr`` of ``expr`` in the live namespace; raises SandboxEvalError if it fails."""
        reply = await self._request("eval", expr, timeout_s)
        if not reply.get("ok"):
            raise SandboxEvalError(reply.get("error") or "evaluation failed")
        return reply["value"]

    async def close(self) -> None:
        """Kill and reap the child; safe to call more than once."""
        self._closed = True
        proc = self._proc
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        await proc.wait()

    async def __aenter__(self) -> "InterpreterSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


# tools, seeding and reward ---------------------------------------------------
TOOL_SCHEMAS: list[dict] = [
    function_tool(
        "python_exec",
        "Run Python code in your session; returns printed output.",
        {"code": ("string", "Python code to run.")},
    )
]


class SandboxSeed(BaseModel):
    """A sandbox row's ``seed`` block: code run before the first turn."""

    model_config = ConfigDict(extra="forbid", strict=True)
    setup: str = ""


class SandboxRow(BaseModel):
    """The row fields the sandbox reads; anything else is the agent's business."""

    model_config = ConfigDict(extra="ignore", strict=True)
    seed: SandboxSeed = Field(default_factory=SandboxSeed)
    expected_answer: str | None = None


def _row(row: Any) -> SandboxRow:
    if not isinstance(row, dict):
        raise ValueError(f"row must be a JSON object, got {type(row).__name__}")
    try:
        return SandboxRow.model_validate(row)
    except ValidationError as exc:
        raise ValueError(f"invalid sandbox row: {exc}") from exc


async def seed_sandbox(row: Any) -> InterpreterSession:
    """Start a session and run the row's ``seed.setup``; fails loudly if it raises."""
    seed = _row(row).seed
    session = await InterpreterSession.start()
    try:
        if seed.setup:
            reply = await session._request("exec", seed.setup, DEFAULT_TIMEOUT_S)
            if reply.get("error"):
                raise ValueError(f"seed.setup failed: {reply['error']}")
    except BaseException:
        await session.close()
        raise
    return session


async def call_sandbox_tool(
    session: InterpreterSession, name: str, arguments: Any, timeout_s: float = DEFAULT_TIMEOUT_S
) -> str:
    """Dispatch a tool call; empty output reads ``(no output)`` for the model."""
    if name != "python_exec":
        raise ToolError(f"unknown tool {name!r}")
    args = check_arguments(name, arguments, ["code"])
    if not isinstance(args["code"], str):
        return "Error: code must be a string"
    out = await session.run(args["code"], timeout_s=timeout_s)
    return out if out.strip() else "(no output)"


async def verify_sandbox(session: InterpreterSession, row: Any) -> float:
    """1.0 if ``repr(answer)`` in the live interpreter equals the row's expected repr."""
    expected = _row(row).expected_answer
    if expected is None:
        raise ValueError("row has no 'expected_answer'")
    try:
        got = await session.evaluate("answer")
    except SandboxEvalError:
        return 0.0
    return 1.0 if got == expected else 0.0
