"""Suite-wide: tests marked ``gpu`` skip themselves without CUDA; tests marked ``alone`` run with no other
test beside them under pytest-xdist (``tests/machine_lock.py``); every test keeps to its time budget
(``tests/time_budget.py``)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from tests.machine_lock import MARKER as ALONE, machine
from tests.time_budget import budget_s, over_budget

_durations: dict[str, float] = defaultdict(float)  # node id -> setup + call + teardown seconds (passed tests)
_failed: set[str] = set()


@pytest.fixture(scope="session")
def embedded_model_cache(tmp_path_factory) -> Path:
    """A ``policy.cache_dir`` shared by the tests that only need the embedded model warm-started (30 steps, as
    their runs ask), so it is trained once a session, not once a test. Under xdist every worker of the run
    shares it (the cache writes each entry into a temporary sibling and renames it: concurrent builders
    agree). Tests of the cache itself (a first run trains, a second reuses) keep their own directory."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "embedded_model_cache"
    path.mkdir(exist_ok=True)
    return path


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch means no GPU
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked ``alone`` runs with no other test beside it (``tests/machine_lock.py``).
    The lock is taken around the whole test, outside its setup, call and teardown: a wait for the machine is
    not the test's own time (the time budget measures that). Only an xdist worker locks: a pytest that a test
    starts inherits the worker's xdist variables, and locking there would wait on its own parent."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    with machine(alone=item.get_closest_marker(ALONE) is not None):
        yield


def pytest_runtest_logreport(report):
    """Runs where the reports arrive: in the one process, or in xdist's controller for every worker."""
    _durations[report.nodeid] += report.duration
    if report.failed:
        _failed.add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: its controller has every report
        return
    passed = {k: v for k, v in _durations.items() if k not in _failed}
    lines = over_budget(passed, budget_s())
    if not lines:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = ("\nerror: tests over the time budget (make them shorter, or list them with a reason in "
            "tests/time_budget.py):\n" + "\n".join("  " + line for line in lines) + "\n")
    if reporter is not None:
        reporter.write(text, red=True)
    else:
        print(text)
    if session.exitstatus == 0:
        session.exitstatus = 1
