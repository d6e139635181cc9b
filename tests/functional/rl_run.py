"""The RL tests' names for the shared run harness (``testkit/run_harness.py``)."""

from __future__ import annotations

from typing import Callable

__all__ = ["REPO", "RunDirs", "env_for", "load_crash_matrix", "processes_with_marker", "replies", "run_grpo",
           "run_until_then_kill", "wait_for_no_processes"]

from testkit.run_harness import (  # noqa: F401 - re-exported for the tests
    REPO,
    RunDirs,
    processes_with_marker,
    run_env,
    run_grpo,
    run_once,
    scripted_overrides as replies,
    wait_for_no_processes,
)


def env_for(extra: dict | None = None) -> dict:
    """This process's environment for a run (plus ``extra``). The scripted backend's reply delay is a
    config override (``replies(delay_s)``), and so is a write fault (``write_fault_overrides(spec)``)."""
    return run_env(extra=extra)


def run_until_then_kill(args: list[str], *, env: dict, until: Callable[[], bool], timeout_s: float = 180) -> None:
    """Start a run in its own process group; SIGKILL the whole group once ``until()`` holds.

    Fails if the run exits first or the condition never holds. Does not wait for
    the run's other processes: the tests check that themselves by marker.
    """
    outcome = run_once(args, env=env, kill_when=lambda _elapsed: until(), timeout_s=timeout_s, poll_s=0.05,
                       reap_after=False)
    if outcome.killed_by == "timeout":
        raise AssertionError("kill condition never held")
    if outcome.killed_by is None:
        raise AssertionError(f"run exited with {outcome.returncode} before the kill condition held")


def load_crash_matrix():
    """``examples/crash_matrix.py`` (its lineage checks) as a module, loaded once for every test file."""
    import importlib.util
    import sys

    if "crash_matrix" not in sys.modules:
        spec = importlib.util.spec_from_file_location("crash_matrix", REPO / "examples" / "crash_matrix.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["crash_matrix"] = module
        spec.loader.exec_module(module)
    return sys.modules["crash_matrix"]
