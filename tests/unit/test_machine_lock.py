"""``tests/machine_lock.py``: under xdist a test marked ``alone`` runs with no other test beside it, and one
that waits for the machine is not starved by tests that keep arriving. Real processes, real locks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from tests.machine_lock import machine
alone, hold_s, out = sys.argv[1] == "alone", float(sys.argv[2]), sys.argv[3]
with machine(alone):
    start = time.monotonic()
    time.sleep(hold_s)
    end = time.monotonic()
open(out, "w").write(f"{start} {end}")
"""


def _start(tmp_path: Path, run: str, name: str, alone: bool, hold_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTEST_XDIST_TESTRUNUID": run, "PYTEST_XDIST_WORKER": name}
    return subprocess.Popen([sys.executable, "-c", HOLDER, "alone" if alone else "shared", str(hold_s),
                             str(tmp_path / name)], cwd=REPO, env=env)


def _span(tmp_path: Path, name: str) -> tuple[float, float]:
    start, end = (tmp_path / name).read_text().split()
    return float(start), float(end)


def test_an_alone_test_waits_for_running_ones_and_holds_off_new_ones(tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    first = [_start(tmp_path, run, f"gw{i}", False, 1.5) for i in range(2)]  # two tests sharing the machine
    time.sleep(0.8)  # both hold it (their interpreters start in well under this)
    alone = _start(tmp_path, run, "alone", True, 0.6)
    time.sleep(0.4)
    late = _start(tmp_path, run, "late", False, 0.2)  # arrives while the alone test waits
    for p in [*first, alone, late]:
        assert p.wait(timeout=60) == 0
    a_start, a_end = _span(tmp_path, "alone")
    assert all(_span(tmp_path, f"gw{i}")[1] <= a_start for i in range(2))  # ran after both ended
    assert _span(tmp_path, "late")[0] >= a_end  # the later test waited for it: no starvation, no overlap
    assert _span(tmp_path, "gw0")[0] < _span(tmp_path, "gw1")[1]  # shared holders overlap


def test_without_xdist_nothing_is_locked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    out = subprocess.run([sys.executable, "-c", "from tests.machine_lock import _files; print(_files())"],
                         cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None", out.stderr


def test_a_pytest_started_by_a_test_does_not_wait_on_the_lock_its_parent_shares(tmp_path: Path) -> None:
    """A test that runs pytest in a child inherits its xdist worker's variables; were the child to lock, an
    ``alone`` test waiting at the turnstile (held here) would wait on the parent and the child on it."""
    import fcntl

    from tests import machine_lock

    run = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTEST_XDIST_TESTRUNUID": run, "PYTEST_XDIST_WORKER": "gw0"}
    (tmp_path / "test_child.py").write_text("def test_child():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    old = os.environ.copy()
    os.environ.update(PYTEST_XDIST_TESTRUNUID=run, PYTEST_XDIST_WORKER="gw0")
    try:
        turnstile_path, _ = machine_lock._files()
    finally:
        os.environ.clear()
        os.environ.update(old)
    with open(turnstile_path, "a+b") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # an alone test waiting for the machine
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                              "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_child.py")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
