"""The suite's time budget: one place that says how long a test may take, and which tests may take longer.

A test whose setup, call and teardown together take more than ``BUDGET_S`` fails the run (the
``pytest_sessionfinish`` hook in ``tests/conftest.py`` sets the exit status and names it), unless it is
listed in ``OVER_BUDGET`` with its own budget and the reason it needs it. The list is meant to stay
short: a slow test is first made shorter (fewer steps, a gate instead of a timer, a shared start).
``NEMO_RL_TEST_BUDGET_S`` overrides ``BUDGET_S`` (the guard's own test sets it low); ``0`` turns the guard
off, e.g. for a run under a profiler.
"""

from __future__ import annotations

import os

# A test's own time (setup, call, teardown; not the wait for the machine) under two xdist workers on two
# cores, where most functional tests take up to twice their time alone.
BUDGET_S = 120.0

# node id -> (its budget in seconds, why it needs more than BUDGET_S)
OVER_BUDGET: dict[str, tuple[float, str]] = {
    "tests/functional/test_recovery_parity.py::test_turn_two_whole_run_kills_at_random_snapshots_train_exactly_the_reference": (
        600.0, "its setup holds the module's shared warm start (150 steps, so the tiny model calls tools) and the "
               "turn-level reference run; then three launches of the faulted run; about 120 s alone, 479 s with a "
               "busy loop on one of two cores beside the suite"),
    "tests/functional/test_bench_smoke.py::test_async_throughput_runs_and_keeps_its_invariants": (
        240.0, "measurement 9 compares six real runs of the main job (sync and async, snapshots off and every "
               "1 s, and two learning runs), each with the real trainer and generation worker; 75 s alone"),
    **{f"tests/functional/test_vllm_generation.py::test_a_killed_vllm_worker_is_restarted_and_its_calls_sent_again[{level}]": (
        240.0, "a vLLM CPU engine start, then a second one after the kill while calls wait; 157 s with a busy loop on "
               "one of two cores (run alone after the suite)") for level in ("turn", "prefix")},
    "tests/functional/test_vllm_generation.py::test_workplace_job_with_vllm_survives_sigkill_and_logprobs_match_every_step": (
        300.0, "two launches of the Workplace job on the vLLM CPU engine (a warm start, an engine start and a "
               "refit check each); about 200 s alone in CI's vLLM venv, run after the suite"),
}


def budget_s() -> float:
    """The default budget in force (``NEMO_RL_TEST_BUDGET_S`` or ``BUDGET_S``; 0 = no guard)."""
    raw = os.environ.get("NEMO_RL_TEST_BUDGET_S")
    if raw is None:
        return BUDGET_S
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"NEMO_RL_TEST_BUDGET_S={raw!r}: not a number of seconds") from None


def over_budget(durations: dict[str, float], default_s: float) -> list[str]:
    """One line per test over its budget (its listed budget, else ``default_s``), slowest first."""
    if default_s <= 0:
        return []
    lines = []
    for nodeid, took in sorted(durations.items(), key=lambda kv: -kv[1]):
        limit, reason = OVER_BUDGET.get(nodeid, (default_s, None))
        if took > limit:
            where = f"its listed budget of {limit:g} s ({reason})" if reason else f"the budget of {limit:g} s"
            lines.append(f"{nodeid} took {took:.1f} s, over {where}")
    return lines
