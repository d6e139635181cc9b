"""Python sandbox resources server: a live interpreter subprocess per session.

The session's state is that process's memory, which cannot be exported, so
this server is honestly ``restart_only``: its sessions block a checkpoint
under policy ``block`` and are reported unsaved under ``best_effort``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gym_patches.checkpoint.wire import ResourcesCheckpointMode
from gym_patches.resources_servers.base import SimpleResourcesServer
from gym_patches.server_configs import PythonSandboxConfig
from gym_patches.resources_servers.python_sandbox.interpreter import (
    TOOL_SCHEMAS,
    InterpreterSession,
    SandboxError,
    call_sandbox_tool,
    seed_sandbox,
    verify_sandbox,
)


class PythonSandboxServer(SimpleResourcesServer):
    config_model = PythonSandboxConfig
    checkpoint_mode: ClassVar[ResourcesCheckpointMode] = "restart_only"
    tool_schemas: ClassVar[list[dict[str, Any]]] = TOOL_SCHEMAS

    async def seed_state(self, row: dict[str, Any]) -> InterpreterSession:
        return await seed_sandbox(row)

    async def call_tool(self, state: InterpreterSession, name: str, arguments: dict[str, Any]) -> str:
        try:
            return await call_sandbox_tool(state, name, arguments, timeout_s=self.config.exec_timeout_s)
        except SandboxError as exc:  # the model's code killed its interpreter: it should see that
            return f"Error: {exc}"

    async def verify_state(self, state: InterpreterSession, row: dict[str, Any], response: dict[str, Any]) -> float:
        try:
            return await verify_sandbox(state, row)
        except SandboxError:
            return 0.0  # the interpreter is gone, so is the answer

    async def close_state(self, state: InterpreterSession) -> None:
        await state.close()


SERVER = PythonSandboxServer
