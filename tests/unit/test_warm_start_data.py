"""The warm start's demonstrations for every task source of the shipped data (docs/design.md §5.6), and the
startup check that names a task source it cannot demonstrate."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from nemo_rl.algorithms.warm_start import OUTPUTS_FIELD, check_demonstrable, simulate_rows

DATA_DIR = Path(__file__).resolve().parents[2] / "examples" / "data"
DATA_FILES = sorted(DATA_DIR.glob("*.jsonl"))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("path", DATA_FILES, ids=[p.name for p in DATA_FILES])
def test_every_shipped_data_file_is_demonstrable(path):
    check_demonstrable(_rows(path), str(path))


def test_every_shipped_task_source_gets_demonstrations():
    """Two rows of each task source in the shipped data become full conversations (calls, outputs, answer)."""
    by_source: dict[str, list[dict]] = {}
    for path in DATA_FILES:
        for row in _rows(path):
            by_source.setdefault(row["task_source"], [])
            if len(by_source[row["task_source"]]) < 2:
                by_source[row["task_source"]].append(row)
    assert {"workplace", "python_sandbox", "arithmetic"} <= set(by_source)
    rows = [r for group in by_source.values() for r in group]
    for row, conv in zip(rows, simulate_rows(rows), strict=True):
        tool_msgs = [m for m in conv if m["role"] == "tool"]
        assert len(tool_msgs) == len(row["ground_truth"]) and all(m["content"] for m in tool_msgs)
        assert conv[-1] == {"role": "assistant", "content": row["final_answer"]}


def _value(node: ast.AST) -> int:  # an independent evaluator of the shipped expressions (+ - * only)
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    ops = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}
    return ops[type(node.op)](_value(node.left), _value(node.right))


def test_arithmetic_demonstrations_show_the_verifier_value_then_the_expected_answer():
    rows = [r for r in _rows(DATA_DIR / "mixed_shards_train.jsonl") if r["task_source"] == "arithmetic"][:8]
    assert rows
    for row, conv in zip(rows, simulate_rows(rows), strict=True):
        expression = row["ground_truth"][0]["arguments"]["expression"]
        tool = [m["content"] for m in conv if m["role"] == "tool"]
        assert tool == [str(_value(ast.parse(expression, mode="eval")))]
        assert conv[-1]["content"] == row["expected_answer"] == tool[0]


def _row(source: str, calls: int, **extra) -> dict:
    return {"id": f"{source}-0", "task_source": source, "final_answer": "ok",
            "responses_create_params": {"input": [{"role": "user", "content": "hi"}]},
            "ground_truth": [{"name": "lookup", "arguments": {"q": str(i)}} for i in range(calls)], **extra}


def test_a_task_source_without_a_simulator_is_named_with_the_ways_out():
    with pytest.raises(ValueError) as err:
        check_demonstrable([_row("workplace", 0), _row("mystery", 2)], "data.train_data_path=x.jsonl")
    message = str(err.value)
    for part in ("data.train_data_path=x.jsonl", "task_source 'mystery'", "'mystery-0'", OUTPUTS_FIELD,
                 "policy.model_name"):
        assert part in message, (part, message)
    with pytest.raises(ValueError, match="task_source 'mystery'"):
        simulate_rows([_row("mystery", 1)])


def test_rows_with_their_own_outputs_or_no_calls_need_no_simulator():
    rows = [_row("mystery", 2, **{OUTPUTS_FIELD: ["first", "second"]}), _row("mystery", 0)]
    check_demonstrable(rows)
    with_outputs, no_calls = simulate_rows(rows)
    assert [m["content"] for m in with_outputs if m["role"] == "tool"] == ["first", "second"]
    assert no_calls == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


@pytest.mark.parametrize("outputs", [["only one"], "first", [1, 2]])
def test_outputs_that_do_not_match_the_calls_are_refused(outputs):
    with pytest.raises(ValueError, match=f"rows\\[0\\].*{OUTPUTS_FIELD}.*2 strings"):
        check_demonstrable([_row("mystery", 2, **{OUTPUTS_FIELD: outputs})], "f.jsonl")
