"""The test entry of a GRPO run: ``python -m testkit.run_grpo [--config X.yaml] [key=value ...]``.

The product's ``nemo_rl.cli.run_grpo.main`` with the hooks the test-only
variables ask for, each validated before anything starts (a malformed one: one
``error:`` line naming it, exit 2, as a config error):

- ``NEMO_RL_TEST_ONLY_CRASH_AT=<phase>[:<nth>]``: SIGKILL the run there
  (``testkit/crash_points.py``);
- ``NEMO_RL_TEST_ONLY_SIGNAL_AT=<phase>[:<nth>]``: the run sends itself a SIGTERM
  there and goes on (``testkit/crash_points.py``: ``SignalAt``);
- ``NEMO_RL_TEST_ONLY_SKIP_RESTART_ONLY_CHECK=1``: a Gym setup the restart-only
  check refuses is logged and run anyway, so the RL-level stall regression (and
  the stall benchmark) reach the snapshot loop with restart-only servers under
  ``block``;
- ``NEMO_RL_TEST_ONLY_FAIL_WATCH=<part>``: the first watch the in-run recovery starts of that part
  (``nemo_gym/replica-1``) fails with an ``OSError``, as a failed ``pidfd_open`` in the watch would.

Run it with the repository as the working directory (the harness does).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from nemo_rl.utils.run_hooks import RunHooks
from testkit.crash_points import CrashAt, SignalAt

SKIP_RESTART_ONLY_ENV = "NEMO_RL_TEST_ONLY_SKIP_RESTART_ONLY_CHECK"
FAIL_WATCH_ENV = "NEMO_RL_TEST_ONLY_FAIL_WATCH"


class TestRunHooks(RunHooks):
    """The hooks of a test run: an optional crash point, and optionally a restart-only check that logs
    and continues instead of failing the setup."""

    __test__ = False  # not a pytest test class

    def __init__(self, crash: CrashAt | None = None, *, accept_restart_only: bool = False,
                 signal_at: SignalAt | None = None, fail_watch: str | None = None):
        self.crash = crash
        self.accept_restart_only = accept_restart_only
        self.signal_at = signal_at
        self.fail_watch = fail_watch  # the part whose first watch fails

    def reached(self, phase: str, scope: object = None) -> None:
        if phase == "watch" and scope == self.fail_watch:
            self.fail_watch = None
            raise OSError(f"TEST-ONLY: {FAIL_WATCH_ENV}={scope} made this watch fail")
        if self.signal_at is not None:
            self.signal_at.reached(phase, scope)
        if self.crash is not None:
            self.crash.reached(phase, scope)

    def on_restart_only_servers(self, error: Exception) -> None:
        if not self.accept_restart_only:
            raise error
        print(f"TEST-ONLY: {SKIP_RESTART_ONLY_ENV}=1, running a setup the restart-only check refuses: {error}",
              file=sys.stderr, flush=True)


def hooks_from_env(environ: Mapping[str, str] = os.environ) -> TestRunHooks:
    """The hooks the variables ask for; ValueError naming the variable for a malformed one."""
    skip = environ.get(SKIP_RESTART_ONLY_ENV, "")
    if skip not in ("", "0", "1"):
        raise ValueError(f"{SKIP_RESTART_ONLY_ENV}={skip!r} must be 1 (or 0, or unset)")
    return TestRunHooks(CrashAt.from_env(environ), accept_restart_only=skip == "1",
                        signal_at=SignalAt.from_env(environ), fail_watch=environ.get(FAIL_WATCH_ENV) or None)


def main(argv: list[str] | None = None) -> int:
    try:
        hooks = hooks_from_env()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from nemo_rl.cli.run_grpo import main as run_grpo

    return run_grpo(argv, hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
