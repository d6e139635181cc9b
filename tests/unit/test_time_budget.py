"""The suite's time budget (``tests/time_budget.py``, enforced by ``tests/conftest.py``): a test over it fails
the run, naming it; a listed test has its own budget; the list names tests that exist."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.time_budget import BUDGET_S, OVER_BUDGET, over_budget

REPO = Path(__file__).resolve().parents[2]

SAMPLE = '''
import time

def test_quick():
    pass

def test_slow():
    time.sleep(0.6)

def test_slow_and_failing():
    time.sleep(0.6)
    assert False
'''


def _run(tmp_path: Path, budget: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "NEMO_RL_TEST_BUDGET_S": budget, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_sample.py"),
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_test_over_the_budget_fails_the_run_and_is_named(tmp_path: Path) -> None:
    out = _run(tmp_path, "0.3", "-k", "not failing")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 passed" in out.stdout  # every test itself passed: the budget failed the run
    assert "test_sample.py::test_slow took" in out.stdout and "test_quick took" not in out.stdout
    assert "tests/time_budget.py" in out.stdout
    out = _run(tmp_path, "0.3")  # a failing test is reported as failed, not as slow
    assert out.returncode == 1 and "1 failed, 2 passed" in out.stdout, out.stdout
    assert "test_slow took" in out.stdout and "test_slow_and_failing took" not in out.stdout


def test_within_the_budget_the_run_passes(tmp_path: Path) -> None:
    out = _run(tmp_path, "30", "-k", "not failing")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "time budget" not in out.stdout


def test_a_listed_test_has_its_own_budget(monkeypatch) -> None:
    monkeypatch.setitem(OVER_BUDGET, "tests/x.py::test_listed", (BUDGET_S * 2, "a reason long enough to read"))
    durations = {"tests/x.py::test_listed": BUDGET_S * 1.5, "tests/y.py::test_new": BUDGET_S + 1,
                 "tests/z.py::test_quick": BUDGET_S - 1}
    assert over_budget(durations, BUDGET_S) == [
        f"tests/y.py::test_new took {BUDGET_S + 1:.1f} s, over the budget of {BUDGET_S:g} s"]
    durations["tests/x.py::test_listed"] = BUDGET_S * 3
    assert "over its listed budget" in over_budget(durations, BUDGET_S)[0]
    assert over_budget(durations, 0) == []  # 0: the guard is off


def test_every_listed_test_exists_with_a_reason() -> None:
    assert len(OVER_BUDGET) <= 12, "the over-budget list is meant to stay short"
    for nodeid, (limit, reason) in OVER_BUDGET.items():
        assert limit > BUDGET_S and len(reason) > 20, nodeid
        path, _, name = nodeid.partition("::")
        name = name.split("[")[0]
        tree = ast.parse((REPO / path).read_text())
        assert any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
                   for n in ast.walk(tree)), f"{nodeid}: no such test"
