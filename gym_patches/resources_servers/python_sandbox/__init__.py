"""Python sandbox resources server logic (``restart_only`` checkpoint mode).

Each session is a live interpreter subprocess; its state exists only in that
process, which is why this server cannot take part in turn-level saves.
"""

from .. import ToolError
from .interpreter import (
    TOOL_SCHEMAS,
    InterpreterSession,
    SandboxError,
    SandboxEvalError,
    SandboxSeed,
    call_sandbox_tool,
    seed_sandbox,
    verify_sandbox,
)

__all__ = [
    "TOOL_SCHEMAS",
    "InterpreterSession",
    "SandboxError",
    "SandboxEvalError",
    "SandboxSeed",
    "ToolError",
    "call_sandbox_tool",
    "seed_sandbox",
    "verify_sandbox",
]
