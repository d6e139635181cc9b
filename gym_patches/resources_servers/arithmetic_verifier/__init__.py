"""Arithmetic verifier logic (``stateless`` checkpoint mode).

The kind of resources server most RL tasks use: the reward depends only on the
final answer, compared with the row's ``expected_answer``, and the one tool
(``calculate``) is a pure function of its arguments. A session holds nothing,
so a snapshot saves it for free and restore needs no state.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from .. import ToolError, check_arguments, function_tool

TOOL_SCHEMAS: list[dict] = [
    function_tool(
        "calculate",
        "Evaluate an integer expression with + - * and parentheses; returns the value.",
        {"expression": ("string", "The expression, e.g. 3 + 4 * 2.")},
    )
]
MAX_EXPRESSION_CHARS = 200
MAX_ABS_VALUE = 10**12

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of an integer ``+ - *`` expression; ValueError names what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](walk(node.left), walk(node.right))
            if abs(value) > MAX_ABS_VALUE:
                raise ValueError(f"value out of range (|x| > {MAX_ABS_VALUE})")
            return value
        raise ValueError(f"{type(node).__name__} is not allowed (integers, + - * and parentheses only)")

    return walk(tree)


def call_tool(name: str, arguments: Any) -> str:
    """Run ``calculate``; a bad expression is an output the model sees, a bad call a ToolError."""
    if name != "calculate":
        raise ToolError(f"unknown tool {name!r}")
    args = check_arguments(name, arguments, ["expression"])
    if not isinstance(args["expression"], str):
        raise ToolError("tool 'calculate': argument 'expression' must be a string")
    try:
        return str(evaluate(args["expression"]))
    except ValueError as exc:
        return f"Error: {exc}"


def final_text(response: dict[str, Any]) -> str:
    """The text of the last assistant message in a Responses-style ``{"output": [...]}``."""
    for item in reversed((response or {}).get("output") or []):
        if isinstance(item, dict) and item.get("type") == "message":
            parts = item.get("content") or []
            return "".join(p.get("text", "") for p in parts if isinstance(p, dict)).strip()
    return ""


def reward(row: dict[str, Any], response: dict[str, Any]) -> float:
    """1.0 when the final answer equals the row's ``expected_answer`` (whitespace ignored)."""
    expected = row.get("expected_answer")
    if not isinstance(expected, str):
        raise ValueError("row has no string 'expected_answer'")
    return 1.0 if final_text(response) == expected.strip() else 0.0


__all__ = ["TOOL_SCHEMAS", "call_tool", "evaluate", "final_text", "reward"]
