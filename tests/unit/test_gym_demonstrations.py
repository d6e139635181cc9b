"""Gym's ground-truth replay (``gym_patches.demonstrations``, docs/design.md §5.6): a row's calls answered as
its resources server's own tool code answers them, one surface for RL to ask, no server import on RL's side."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gym_patches import demonstrations
from gym_patches.demonstrations import ground_truth_outputs, register_replay, row_task_source, task_sources
from tests.unit.test_import_direction import IMPORTS, SERVER_PACKAGES

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "mixed_shards_train.jsonl"


def _rows(source: str, n: int = 2) -> list[dict]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["task_source"] == source][:n]


def _workplace_by_hand(row: dict) -> list[str]:
    from gym_patches.resources_servers.workplace import call_tool, seed_from_row

    world = seed_from_row(row)
    return [call_tool(world, c["name"], c["arguments"]) for c in row["ground_truth"]]


def _arithmetic_by_hand(row: dict) -> list[str]:
    from gym_patches.resources_servers.arithmetic_verifier import call_tool

    return [call_tool(c["name"], c["arguments"]) for c in row["ground_truth"]]


def _sandbox_by_hand(row: dict) -> list[str]:
    from gym_patches.resources_servers.python_sandbox import call_sandbox_tool, seed_sandbox

    async def play() -> list[str]:
        session = await seed_sandbox(row)
        try:
            return [await call_sandbox_tool(session, c["name"], c["arguments"]) for c in row["ground_truth"]]
        finally:
            await session.close()

    return asyncio.run(play())


BY_HAND = {"workplace": _workplace_by_hand, "arithmetic": _arithmetic_by_hand, "python_sandbox": _sandbox_by_hand}


def test_the_built_in_task_sources_are_listed():
    assert {"workplace", "python_sandbox", "arithmetic"} <= set(task_sources())
    assert task_sources() == sorted(task_sources())


@pytest.mark.parametrize("source", sorted(BY_HAND))
def test_a_real_row_gets_what_the_servers_own_tool_code_answers(source):
    rows = _rows(source)
    assert rows and all(r["ground_truth"] for r in rows)
    outputs = ground_truth_outputs(rows, source)
    assert outputs == [BY_HAND[source](r) for r in rows]
    assert all(len(o) == len(r["ground_truth"]) and all(isinstance(s, str) and s for s in o)
               for r, o in zip(rows, outputs, strict=True))


def test_no_rows_no_outputs():
    assert ground_truth_outputs([], "workplace") == []


def test_an_unknown_task_source_is_refused_by_name():
    with pytest.raises(ValueError, match=r"task_source 'mystery'.*have \[.*'workplace'"):
        ground_truth_outputs([{"id": "m-0", "ground_truth": []}], "mystery")


@pytest.mark.parametrize("source", sorted(BY_HAND))
def test_a_call_the_tools_refuse_names_the_row_and_the_index(source):
    row = dict(_rows(source, 1)[0], id="bad-row")
    row["ground_truth"] = [*row["ground_truth"], {"name": "no_such_tool", "arguments": {}}]
    bad = len(row["ground_truth"]) - 1
    with pytest.raises(ValueError, match=rf"row 'bad-row': ground_truth\[{bad}\] is not a valid call: .*no_such_tool"):
        ground_truth_outputs([row], source)


def test_a_call_without_name_or_arguments_names_the_row_and_the_index():
    row = dict(_rows("arithmetic", 1)[0], id="half")
    row["ground_truth"] = [*row["ground_truth"], {"name": "calculate"}]
    with pytest.raises(ValueError, match=r"row 'half': ground_truth\[1\] needs 'name' and 'arguments'"):
        ground_truth_outputs([row], "arithmetic")


def test_a_registered_replay_answers_for_its_task_source(monkeypatch):
    monkeypatch.setattr(demonstrations, "_REGISTERED", {})
    register_replay("echo", lambda rows: [[json.dumps(c["arguments"]) for c in r["ground_truth"]] for r in rows])
    assert "echo" in task_sources()
    row = {"id": "e-0", "ground_truth": [{"name": "say", "arguments": {"x": 1}}]}
    assert ground_truth_outputs([row], "echo") == [['{"x": 1}']]
    for taken in ("echo", "workplace"):
        with pytest.raises(ValueError, match=f"task_source '{taken}' already has"):
            register_replay(taken, lambda rows: [])
    register_replay("short", lambda rows: [[] for _ in rows])
    with pytest.raises(ValueError, match=r"task_source 'short' answered row 'e-0' with 0 outputs for 1 calls"):
        ground_truth_outputs([row], "short")


def test_row_task_source_reads_the_field_or_the_seed_shape():
    assert row_task_source({"task_source": "arithmetic", "seed": {"people": []}}) == "arithmetic"
    assert row_task_source({"seed": {"people": []}}) == "workplace"
    assert row_task_source({"seed": {"setup": ""}}) == "python_sandbox"
    assert row_task_source({}) == "unknown"


def test_importing_the_surface_imports_no_server():
    code = ("import sys, gym_patches.demonstrations as d; d.task_sources(); "
            "print(sorted(m for m in sys.modules if m.startswith(('gym_patches.resources_servers', 'nemo_rl'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_surface_is_not_a_server_and_the_warm_start_reaches_gym_through_it():
    assert not any(demonstrations.__name__ == p or demonstrations.__name__.startswith(p + ".") for p in SERVER_PACKAGES)
    warm_start = {i.target for i in IMPORTS if i.importer == "nemo_rl.algorithms.warm_start"}
    assert any(t.startswith("gym_patches.demonstrations") for t in warm_start)
    assert not any(t.startswith(p) for t in warm_start for p in SERVER_PACKAGES)
