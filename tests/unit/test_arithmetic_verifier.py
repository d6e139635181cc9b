"""The stateless arithmetic verifier: pure tool, reward from the final answer only."""

from __future__ import annotations

import pytest

from gym_patches.resources_servers import ToolError
from gym_patches.resources_servers.arithmetic_verifier import call_tool, evaluate, final_text, reward
from gym_patches.resources_servers.arithmetic_verifier.app import ArithmeticVerifierServer


@pytest.mark.parametrize("expression, value", [("3 + 4 * 2", 11), ("(12 - 5) * 3", 21), ("-4 + 9", 5)])
def test_evaluate(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["2 ** 64", "__import__('os')", "1 / 2", "x + 1", "1.5 + 1", "9" * 300])
def test_anything_else_is_refused_as_a_tool_output(expression):
    out = call_tool("calculate", {"expression": expression})
    assert out.startswith("Error:")


def test_malformed_calls_raise_tool_errors_naming_the_argument():
    with pytest.raises(ToolError, match="expression"):
        call_tool("calculate", {})
    with pytest.raises(ToolError, match="unknown tool"):
        call_tool("sqrt", {"expression": "4"})


def message(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def test_reward_is_an_exact_match_of_the_last_message():
    row = {"expected_answer": "64"}
    call = {"type": "function_call", "name": "calculate", "arguments": "{}"}
    assert reward(row, {"output": [call, message(" 64\n")]}) == 1.0
    assert reward(row, {"output": [message("64"), call, message("65")]}) == 0.0
    assert reward(row, {"output": []}) == 0.0
    assert final_text({"output": [message("a"), message("b")]}) == "b"
    with pytest.raises(ValueError, match="expected_answer"):
        reward({}, {"output": []})


def test_the_server_is_stateless():
    assert ArithmeticVerifierServer.checkpoint_mode == "stateless"
    assert ArithmeticVerifierServer.checkpoint_mode_label() == "stateless"
