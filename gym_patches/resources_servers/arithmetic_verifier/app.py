"""Arithmetic verifier resources server: ``stateless`` (no per-session state).

It never blocks a checkpoint beyond a tool call in flight and is never named
as restart-only: a session is just an id bound to its episode.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gym_patches.checkpoint.wire import ResourcesCheckpointMode
from gym_patches.resources_servers.arithmetic_verifier import TOOL_SCHEMAS, call_tool, reward
from gym_patches.resources_servers.base import SimpleResourcesServer


class ArithmeticVerifierServer(SimpleResourcesServer):
    checkpoint_mode: ClassVar[ResourcesCheckpointMode] = "stateless"
    tool_schemas: ClassVar[list[dict[str, Any]]] = TOOL_SCHEMAS

    async def seed_state(self, row: dict[str, Any]) -> None:
        if not isinstance(row.get("expected_answer"), str):
            raise ValueError("row has no string 'expected_answer'")
        return None

    async def call_tool(self, state: None, name: str, arguments: dict[str, Any]) -> str:
        return call_tool(name, arguments)

    async def verify_state(self, state: None, row: dict[str, Any], response: dict[str, Any]) -> float:
        return reward(row, response)


SERVER = ArithmeticVerifierServer
