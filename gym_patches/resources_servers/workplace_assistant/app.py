"""Workplace resources server: one ``OfficeWorld`` per session, ``exported`` mode.

The whole world is plain JSON, so a checkpoint saves it exactly and a restored
session continues as if never interrupted.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gym_patches.checkpoint.records import Fragment, fragment
from gym_patches.checkpoint.wire import ResourcesCheckpointMode
from gym_patches.resources_servers.base import SimpleResourcesServer
from gym_patches.resources_servers.workplace import TOOL_SCHEMAS, OfficeWorld, seed_from_row, verify


class WorkplaceAssistantServer(SimpleResourcesServer):
    checkpoint_mode: ClassVar[ResourcesCheckpointMode] = "exported"
    tool_schemas: ClassVar[list[dict[str, Any]]] = TOOL_SCHEMAS

    async def seed_state(self, row: dict[str, Any]) -> OfficeWorld:
        return seed_from_row(row)

    async def call_tool(self, state: OfficeWorld, name: str, arguments: dict[str, Any]) -> str:
        return state.call_tool(name, arguments)

    async def verify_state(self, state: OfficeWorld, row: dict[str, Any], response: dict[str, Any]) -> float:
        return verify(state, row)

    def export_session_state(self, state: OfficeWorld) -> Fragment:
        return fragment(state.state)  # the same JSON as ``state.export_state()``, serialised once

    def restore_session_state(self, data: dict[str, Any]) -> OfficeWorld:
        return OfficeWorld.restore_state(data)


SERVER = WorkplaceAssistantServer
