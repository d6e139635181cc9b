"""Tests that need the whole machine run alone, also when pytest-xdist runs the others side by side.

Every test holds a shared lock on one file for its duration; a test marked ``alone`` holds it exclusively.
A second file is the turnstile that keeps the exclusive one from starving: each test passes through it
(exclusive, released at once after its own lock is taken), and the ``alone`` test holds it while it waits,
so no new test starts, the running ones end, and it runs by itself. Without xdist (one process) nothing
is locked: the tests already run one at a time. The files live in the temporary directory, named by
xdist's run id, which every worker of one run shares.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

MARKER = "alone"


def _files() -> tuple[Path, Path] | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run or not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    base = Path(tempfile.gettempdir()) / f"nemo-rl-tests-{run}"
    return base.with_suffix(".turnstile"), base.with_suffix(".machine")


@contextlib.contextmanager
def machine(alone: bool) -> Iterator[None]:
    """Hold the machine shared (``alone=False``) or by itself, for the body's duration."""
    files = _files()
    if files is None:
        yield
        return
    turnstile_path, machine_path = files
    with open(turnstile_path, "a+b") as turnstile, open(machine_path, "a+b") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
