"""The outputs of a row's ground-truth calls, as its resources server would answer them.

Part of Gym's client surface (docs/design.md §5.6): a trainer that builds supervised demonstrations
from data rows asks here for the tool outputs, and never imports a resources server itself.

A row's ``ground_truth`` lists the tool calls that solve it (``{"name", "arguments"}`` each).
``ground_truth_outputs(rows, task_source)`` plays them, in order, through the task source's own tool
code on a world seeded from the row, and returns one list of output strings per row:

* ``workplace``: the ``OfficeWorld`` of the row's ``seed`` (``resources_servers.workplace``);
* ``python_sandbox``: a live interpreter session per row, ``seed.setup`` run first, a few rows at a
  time, as the sandbox server's sessions (``resources_servers.python_sandbox``);
* ``arithmetic``: the verifier's own ``calculate`` (``resources_servers.arithmetic_verifier``).

Those three are built in: their server code is imported only when a replay runs, so importing this
module costs nothing. Any other task source registers its replay once, explicitly, with
``register_replay`` (typically from its own resources server package). A call its tools refuse
(unknown tool, unknown or missing argument) raises ``ValueError`` naming the row's id and the call's
index; a bad argument *value* is ordinary output, as a rollout would show it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# rows of one task source -> the outputs of each row's ground_truth calls (one list of strings per row)
Replay = Callable[[list[dict]], list[list[str]]]

SANDBOX_CONCURRENCY = 8  # live interpreters at once while replaying python_sandbox rows


def row_task_source(row: dict) -> str:
    """``task_source`` if present, else inferred from the row's seed shape."""
    src = row.get("task_source")
    if src:
        return src
    seed = row.get("seed") or {}
    return "workplace" if "people" in seed else "python_sandbox" if "setup" in seed else "unknown"


def _bad_call(row: dict, i: int, error: Exception) -> ValueError:
    return ValueError(f"row {row.get('id')!r}: ground_truth[{i}] is not a valid call: {error}")


def _play(row: dict, call_tool: Callable[[str, Any], str], tool_error: type[Exception]) -> list[str]:
    outs = []
    for i, call in enumerate(row["ground_truth"]):
        try:
            outs.append(call_tool(call["name"], call["arguments"]))
        except tool_error as e:
            raise _bad_call(row, i, e) from e
    return outs


def _replay_workplace(rows: list[dict]) -> list[list[str]]:
    from gym_patches.resources_servers.workplace import ToolError, seed_from_row

    return [_play(row, seed_from_row(row).call_tool, ToolError) for row in rows]


def _replay_arithmetic(rows: list[dict]) -> list[list[str]]:
    from gym_patches.resources_servers.arithmetic_verifier import ToolError, call_tool

    return [_play(row, call_tool, ToolError) for row in rows]


async def _replay_sandbox_async(rows: list[dict], concurrency: int) -> list[list[str]]:
    from gym_patches.resources_servers.python_sandbox import ToolError, call_sandbox_tool, seed_sandbox

    gate = asyncio.Semaphore(concurrency)

    async def one(row: dict) -> list[str]:
        async with gate:
            session = await seed_sandbox(row)
            try:
                outs = []
                for i, call in enumerate(row["ground_truth"]):
                    try:
                        outs.append(await call_sandbox_tool(session, call["name"], call["arguments"]))
                    except ToolError as e:
                        raise _bad_call(row, i, e) from e
                return outs
            finally:
                await session.close()

    return list(await asyncio.gather(*(one(r) for r in rows)))


def _run_async(coro_fn, *args):
    """``asyncio.run`` that also works when the caller is already inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn(*args))
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(coro_fn(*args))).result()


def _replay_sandbox(rows: list[dict]) -> list[list[str]]:
    return _run_async(_replay_sandbox_async, rows, SANDBOX_CONCURRENCY)


_BUILT_IN: dict[str, Replay] = {
    "workplace": _replay_workplace,
    "python_sandbox": _replay_sandbox,
    "arithmetic": _replay_arithmetic,
}
_REGISTERED: dict[str, Replay] = {}


def register_replay(task_source: str, replay: Replay) -> None:
    """Make ``ground_truth_outputs`` answer for ``task_source`` with ``replay``. A task source has one
    replay: registering a name already known (built in or registered) is refused."""
    if not isinstance(task_source, str) or not task_source:
        raise ValueError(f"a task source is a non-empty string, got {task_source!r}")
    if not callable(replay):
        raise TypeError(f"the replay for task_source {task_source!r} must be callable, got {type(replay).__name__}")
    if task_source in _BUILT_IN or task_source in _REGISTERED:
        raise ValueError(f"task_source {task_source!r} already has a ground-truth replay")
    _REGISTERED[task_source] = replay


def task_sources() -> list[str]:
    """Every task source ``ground_truth_outputs`` can answer for, sorted."""
    return sorted({*_BUILT_IN, *_REGISTERED})


def _replay_for(task_source: str) -> Replay:
    replay = _REGISTERED.get(task_source) or _BUILT_IN.get(task_source)
    if replay is None:
        raise ValueError(f"no ground-truth replay for task_source {task_source!r} (have {task_sources()})")
    return replay


def _check_calls(row: Any, i: int) -> dict:
    if not isinstance(row, dict) or not isinstance(row.get("ground_truth"), list):
        raise ValueError(f"rows[{i}] must be a row with a 'ground_truth' list of calls")
    for j, call in enumerate(row["ground_truth"]):
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            raise ValueError(f"row {row.get('id')!r}: ground_truth[{j}] needs 'name' and 'arguments'")
    return row


def ground_truth_outputs(rows: Iterable[dict], task_source: str) -> list[list[str]]:
    """The output of each ground-truth call of each row (all of ``task_source``), as that task source's
    resources server would answer it: one list of strings per row, in row and call order."""
    replay = _replay_for(task_source)
    rows = [_check_calls(r, i) for i, r in enumerate(rows)]
    outputs = list(replay(rows)) if rows else []
    if len(outputs) != len(rows):
        raise ValueError(f"the replay for task_source {task_source!r} answered {len(outputs)} rows of {len(rows)}")
    for row, outs in zip(rows, outputs):
        if len(outs) != len(row["ground_truth"]) or not all(isinstance(o, str) for o in outs):
            raise ValueError(f"the replay for task_source {task_source!r} answered row {row.get('id')!r} with "
                             f"{len(outs)} outputs for {len(row['ground_truth'])} calls (strings expected)")
    return [list(outs) for outs in outputs]


__all__ = ["Replay", "ground_truth_outputs", "register_replay", "row_task_source", "task_sources"]
