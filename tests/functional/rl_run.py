"""The RL tests' names for the shared run harness (``nemo_rl.utils.run_harness``)."""

from __future__ import annotations

from typing import Callable

__all__ = ["REPO", "SCRIPT", "RunDirs", "env_for", "load_crash_matrix", "processes_with_marker", "run_grpo",
           "run_until_then_kill", "wait_for_no_processes"]

from nemo_rl.utils.run_harness import (  # noqa: F401 - re-exported for the tests
    REPO,
    RUN_GRPO as SCRIPT,
    RunDirs,
    processes_with_marker,
    run_env,
    run_grpo,
    run_once,
    wait_for_no_processes,
)


def env_for(delay_s: float = 0.0, extra: dict | None = None) -> dict:
    """This process's environment with the scripted backend's reply delay (and ``extra``)."""
    return run_env(delay_s=delay_s, extra=extra)


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
