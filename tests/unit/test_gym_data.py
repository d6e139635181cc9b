"""The example datasets: deterministic, well-formed, and solvable by their ground truth."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gym_patches.resources_servers.python_sandbox import (
    TOOL_SCHEMAS as SANDBOX_TOOLS,
    call_sandbox_tool,
    seed_sandbox,
    verify_sandbox,
)
from gym_patches.resources_servers.workplace import TOOL_SCHEMAS as WORKPLACE_TOOLS
from gym_patches.resources_servers.workplace import seed_from_row, verify

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "examples" / "data"
SCRIPT = DATA_DIR / "make_gym_data.py"
FILES = ["workplace_train", "workplace_val", "sandbox_train", "sandbox_val",
         "mixed_train", "mixed_val"]
ROW_KEYS = {"id", "task_source", "agent_ref", "responses_create_params", "seed",
            "ground_truth", "final_answer"}


def _load_script():
    spec = importlib.util.spec_from_file_location("make_gym_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> list[dict]:
    with open(DATA_DIR / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _prompt(row: dict) -> str:
    return row["responses_create_params"]["input"][1]["content"]


WORKPLACE_ROWS = _rows("workplace_train") + _rows("workplace_val")
SANDBOX_ROWS = _rows("sandbox_train") + _rows("sandbox_val")


def test_cli_regenerates_the_committed_files_byte_for_byte(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in FILES:
        fresh = (tmp_path / f"{name}.jsonl").read_bytes()
        assert fresh == (DATA_DIR / f"{name}.jsonl").read_bytes(), f"{name}.jsonl differs"


def test_sizes_and_unique_ids():
    expected = {"workplace_train": 256, "workplace_val": 32, "sandbox_train": 64,
                "sandbox_val": 16, "mixed_train": 320, "mixed_val": 48}
    for name, n in expected.items():
        rows = _rows(name)
        assert len(rows) == n, name
        assert len({r["id"] for r in rows}) == n, name
    train = {_prompt(r) + json.dumps(r["seed"]) for r in _rows("workplace_train")}
    assert len(train) == 256


@pytest.mark.parametrize("name", FILES)
def test_row_shape(name):
    for row in _rows(name):
        source = row["task_source"]
        answer_key = "expected_state" if source == "workplace" else "expected_answer"
        assert set(row) == ROW_KEYS | {answer_key}, row["id"]
        params = row["responses_create_params"]
        assert params["tools"] == (WORKPLACE_TOOLS if source == "workplace" else SANDBOX_TOOLS)
        assert params["temperature"] == 1.0 and params["max_output_tokens"] == 96
        system, user = params["input"]
        assert system["role"] == "system" and user["role"] == "user"
        assert system["content"].count(".") == 1 and len(system["content"]) <= 60
        assert len(user["content"]) <= 70, user["content"]
        assert row["final_answer"] == "Done."
        assert len(row["ground_truth"]) >= 2
        for call in row["ground_truth"]:
            assert set(call) == {"name", "arguments"} and isinstance(call["arguments"], dict)


def test_agent_assignment_and_mixing():
    assert {r["agent_ref"]["name"] for r in WORKPLACE_ROWS} == {"workplace_simple_agent"}
    assert {r["agent_ref"]["name"] for r in SANDBOX_ROWS} == {"sandbox_simple_agent"}
    for split in ("train", "val"):
        mixed = _rows(f"mixed_{split}")
        wp = [r for r in mixed if r["task_source"] == "workplace"]
        sb = [r for r in mixed if r["task_source"] == "python_sandbox"]
        assert [r["agent_ref"]["name"] for r in wp] == [
            ("workplace_simple_agent", "workplace_restart_only_agent")[i % 2] for i in range(len(wp))]
        assert {r["agent_ref"]["name"] for r in sb} == {"sandbox_simple_agent"}
        strip = lambda rows: [{k: v for k, v in r.items() if k != "agent_ref"} for r in rows]  # noqa: E731
        assert strip(wp) == strip(_rows(f"workplace_{split}"))
        assert strip(sb) == strip(_rows(f"sandbox_{split}"))
        first_sb = next(i for i, r in enumerate(mixed) if r["task_source"] == "python_sandbox")
        assert first_sb < len(mixed) // 4  # spread out, not appended at the end


def test_agent_names_come_from_the_cli(tmp_path):
    module = _load_script()
    assert module.main(["--out-dir", str(tmp_path), "--workplace-agent", "wa",
                        "--restart-only-agent", "ra", "--sandbox-agent", "sa",
                        "--n-workplace-train", "4", "--n-sandbox-train", "2",
                        "--n-workplace-val", "0", "--n-sandbox-val", "0"]) == 0
    mixed = [json.loads(line) for line in (tmp_path / "mixed_train.jsonl").open()]
    assert Counter(r["agent_ref"]["name"] for r in mixed) == {"wa": 2, "ra": 2, "sa": 2}
    assert (tmp_path / "workplace_val.jsonl").read_text() == ""


def test_bad_options_name_the_option(tmp_path, capsys):
    module = _load_script()
    with pytest.raises(SystemExit):
        module.main(["--out-dir", str(tmp_path), "--n-sandbox-val", "-1"])
    assert "--n-sandbox-val" in capsys.readouterr().err
    with pytest.raises(ValueError, match="bogus"):
        module.generate(tmp_path, sizes={"bogus": 1})
    with pytest.raises(ValueError, match="workplace_agents"):
        module.mixed_rows([], [], workplace_agents=())


def _depends_on_previous_output(calls: list[dict], outputs: list[str], prompt: str) -> bool:
    """Some argument of call 2 shows a value only call 1's output revealed."""
    values = [v for v in calls[1]["arguments"].values() if isinstance(v, str)]
    revealed = [tok.strip(",.:") for tok in outputs[0].split()]
    return any(tok and tok in v and tok not in prompt for tok in revealed for v in values)


@pytest.mark.parametrize("row", WORKPLACE_ROWS, ids=lambda r: r["id"])
def test_workplace_ground_truth_earns_full_reward(row):
    assert verify(seed_from_row(row), row) == 0.0  # doing nothing earns nothing
    world = seed_from_row(row)
    outputs = [world.call_tool(c["name"], c["arguments"]) for c in row["ground_truth"]]
    assert not any(o.startswith("Error:") for o in outputs), outputs
    assert _depends_on_previous_output(row["ground_truth"], outputs, _prompt(row)), outputs
    assert verify(world, row) == 1.0


SANDBOX_SAMPLE = SANDBOX_ROWS[::7]


@pytest.mark.parametrize("row", SANDBOX_SAMPLE, ids=lambda r: r["id"])
async def test_sandbox_ground_truth_earns_full_reward(row):
    idle = await seed_sandbox(row)
    try:
        assert await verify_sandbox(idle, row) == 0.0
    finally:
        await idle.close()
    session = await seed_sandbox(row)
    try:
        outputs = [await call_sandbox_tool(session, c["name"], c["arguments"])
                   for c in row["ground_truth"]]
        assert not any("Error:" in o for o in outputs), outputs
        assert _depends_on_previous_output(row["ground_truth"], outputs, _prompt(row)), outputs
        assert await verify_sandbox(session, row) == 1.0
    finally:
        await session.close()


def test_sandbox_ground_truth_holds_for_every_row():
    """All sandbox rows, in-process (the live sample above covers the real interpreter)."""
    for row in SANDBOX_ROWS:
        ns: dict = {}
        exec(row["seed"]["setup"], ns)  # noqa: S102 - our own generated data
        outputs = []
        for call in row["ground_truth"]:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(call["arguments"]["code"], ns)  # noqa: S102
            outputs.append(buf.getvalue())
        assert _depends_on_previous_output(row["ground_truth"], outputs, _prompt(row)), row["id"]
        assert repr(ns["answer"]) == row["expected_answer"], row["id"]
