"""Resources-server logic (upstream: ``nemo_gym`` ``resources_servers/``).

The pure-Python worlds live here; the HTTP wrappers call into them. Errors the
caller made in the *call itself* (unknown tool, unknown or missing argument)
raise :class:`ToolError` so a server can answer 4xx; mistakes in argument
*values* come back as ordinary tool output starting with ``"Error:"`` so the
model sees them, as upstream's Workplace tools do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class ToolError(ValueError):
    """A malformed tool call: unknown tool, or unknown/missing argument."""


def check_arguments(
    tool: str, arguments: Any, allowed: Iterable[str]
) -> dict[str, Any]:
    """Return ``arguments`` as a dict after checking its keys against ``allowed``.

    Every allowed argument is required; the error names the offending key.
    """
    if not isinstance(arguments, Mapping):
        raise ToolError(
            f"tool {tool!r}: arguments must be a JSON object, got {type(arguments).__name__}"
        )
    allowed = list(allowed)
    unknown = sorted(set(arguments) - set(allowed))
    if unknown:
        raise ToolError(f"tool {tool!r}: unknown argument(s) {', '.join(map(repr, unknown))}")
    missing = [k for k in allowed if k not in arguments]
    if missing:
        raise ToolError(f"tool {tool!r}: missing argument(s) {', '.join(map(repr, missing))}")
    return dict(arguments)


def function_tool(name: str, description: str, params: Mapping[str, tuple[str, str]]) -> dict:
    """One OpenAI Responses-style function tool; ``params`` maps name -> (json type, text)."""
    return {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {
                p: {"type": t, "description": d} for p, (t, d) in params.items()
            },
            "required": list(params),
            "additionalProperties": False,
        },
        "strict": False,
    }


__all__ = ["ToolError", "check_arguments", "function_tool"]
