"""Workplace-like office world (``exported`` checkpoint mode).

Upstream counterpart: ``resources_servers/workplace_assistant``. Our world is
smaller and our own: a read-only directory, a calendar, email and a task
board, whose whole state exports to JSON and restores exactly.
"""

from .. import ToolError
from .tools import READ_ONLY_TOOLS, TOOL_SCHEMAS, call_tool
from .verify import expected_tables, verify
from .world import (
    DEFAULT_NOW,
    DEFAULT_USER_EMAIL,
    OfficeSeed,
    OfficeState,
    OfficeWorld,
    WorldStateError,
    seed_from_row,
)

__all__ = [
    "DEFAULT_NOW",
    "DEFAULT_USER_EMAIL",
    "OfficeSeed",
    "OfficeState",
    "OfficeWorld",
    "READ_ONLY_TOOLS",
    "TOOL_SCHEMAS",
    "ToolError",
    "WorldStateError",
    "call_tool",
    "expected_tables",
    "seed_from_row",
    "verify",
]
