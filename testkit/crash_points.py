"""Crash points for the crash matrix (``examples/crash_matrix.py``, ``tests/functional``): ``CrashAt``.

``NEMO_RL_TEST_ONLY_CRASH_AT=<phase>[:<nth>]`` (read by ``testkit/run_grpo.py``,
which passes ``CrashAt`` to the run as its hooks) makes the run SIGKILL its
whole process group (driver, Ray's GCS, raylet and agents, the scripted
backend) the ``nth`` time (default 1) the controller reaches ``phase``. It
simulates a machine or container dying at a precise point; nothing is flushed
or cleaned up. Processes outside the group (Ray workers run in their own
sessions, Gym servers under them) go the way they would after a real crash: the
run's reaper (``runner._RunReaper``) kills them. Without the variable the run
gets the product's no-op hooks.

The snapshot phases count per trainer step (the ``scope`` the run passes):
``commit:2`` fires at the second snapshot of the first step that takes two, so
the step's first snapshot is on disk for the next run to restore. ``train``,
``refit``, ``checkpointed`` and ``restore`` count per run (``train:2``: in the
second trained step).

Phases (where the controller calls ``hooks.reached``; ``nemo_rl.utils.run_hooks.PHASES``):

- ``prepare``: a snapshot has Gym prepared, before anything is committed;
- ``commit``: Gym has committed its records (staged: captured them at prepare), before the snapshot is published;
- ``persist``: staged snapshots only: rollouts have resumed, Gym has not written its captured
  records and the snapshot is not published (the previous one must stay the newest valid);
- ``publish``: the snapshot's temporary directory is fully written, before it
  is sealed and renamed into place;
- ``restore``: Gym has restored the snapshot's episodes, before the ledger is
  applied;
- ``train``: inside a training step (the trainer has consumed the batch, the
  step is not checkpointed yet);
- ``refit``: the step trained, its weights about to go to generation (in async
  mode the groups of later steps are generating meanwhile);
- ``checkpointed``: the step's trainer checkpoint was just published, before
  the prune of older anchors and before any snapshot under it (a snapshot in
  flight may yet publish there, docs/design.md §5.9): a restore takes the
  trainer step with a snapshot of an older anchor, or none.

The run must be started in its own session (``start_new_session=True``, as the
harness does) so the group kill hits only it; when the process is not its
group's leader only the process itself is killed (the reaper takes the rest down).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Mapping

from nemo_rl.utils.run_hooks import PHASES, RunHooks
from nemo_rl.utils.stop_signals import DUPLICATE_WINDOW_S

CRASH_ENV = "NEMO_RL_TEST_ONLY_CRASH_AT"


def parse_crash_spec(spec: str | None) -> tuple[str, int] | None:
    """``'commit:2'`` -> ``('commit', 2)``; empty or None -> None; anything else raises naming the variable."""
    if spec is None or not spec.strip():
        return None
    phase, sep, nth_text = spec.strip().partition(":")
    if phase not in PHASES:
        raise ValueError(f"{CRASH_ENV}={spec!r}: unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
    nth = 1
    if sep:
        try:
            nth = int(nth_text)
        except ValueError:
            raise ValueError(f"{CRASH_ENV}={spec!r}: count {nth_text!r} is not an integer") from None
        if nth < 1:
            raise ValueError(f"{CRASH_ENV}={spec!r}: count must be >= 1")
    return phase, nth


class CrashAt(RunHooks):
    """Run hooks that SIGKILL the run's process group the ``nth`` time ``phase`` is reached in one scope."""

    def __init__(self, phase: str, nth: int = 1, *, spec: str | None = None):
        if phase not in PHASES:
            raise ValueError(f"CrashAt({phase!r}): not one of {', '.join(PHASES)}")
        if nth < 1:
            raise ValueError(f"CrashAt({phase!r}, {nth}): nth must be >= 1")
        self.phase, self.nth = phase, nth
        self.spec = spec or f"{phase}:{nth}"  # as the variable said it, for the crash line
        self.reaches: Counter[object] = Counter()  # scope -> times ``phase`` was reached there

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CrashAt | None:
        """The crash ``NEMO_RL_TEST_ONLY_CRASH_AT`` asks for (None: unset); a malformed value raises naming it."""
        spec = environ.get(CRASH_ENV)
        target = parse_crash_spec(spec)
        return None if target is None else cls(*target, spec=spec.strip())

    def reached(self, phase: str, scope: object = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"reached({phase!r}): not one of {', '.join(PHASES)}")
        if phase != self.phase:
            return
        self.reaches[scope] += 1
        if self.reaches[scope] == self.nth:
            self.kill_run()

    def kill_run(self) -> None:
        """SIGKILL the process group when this process leads it, else this process alone."""
        print(f"TEST-ONLY crash: {CRASH_ENV}={self.spec} reached; SIGKILL of the whole run",
              file=sys.stderr, flush=True)
        pgid = os.getpgid(0)
        if pgid == os.getpid():
            os.killpg(pgid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


SIGNAL_ENV = "NEMO_RL_TEST_ONLY_SIGNAL_AT"


class SignalAt(RunHooks):
    """``NEMO_RL_TEST_ONLY_SIGNAL_AT=<phase>[:<nth>]``: the ``nth`` time ``phase`` is reached (counted as
    ``CrashAt`` counts), the run sends itself a SIGTERM and goes on, as a scheduler's stop landing
    exactly there would (docs/design.md §5.11): ``train`` stops a run while a step trains and then
    writes its checkpoint; ``persist`` sends a second SIGTERM while the final snapshot is written
    (held until ``DUPLICATE_WINDOW_S`` after the first, so that it counts as a second stop)."""

    def __init__(self, points: list[tuple[str, int]]):
        self.points = points
        self.reaches: Counter[tuple[str, object]] = Counter()
        self.sent_at: float | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SignalAt | None":
        """Several points, comma-separated (``train:2,persist``: a stop while step 2 trains, a second
        SIGTERM while its final snapshot is written); None when unset."""
        spec = environ.get(SIGNAL_ENV) or ""
        points = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            try:
                points.append(parse_crash_spec(part))
            except ValueError as exc:
                raise ValueError(str(exc).replace(CRASH_ENV, SIGNAL_ENV)) from None
        return cls(points) if points else None

    def reached(self, phase: str, scope: object = None) -> None:
        for point, nth in self.points:
            if phase != point:
                continue
            self.reaches[phase, scope] += 1
            if self.reaches[phase, scope] == nth:
                if self.sent_at is not None:  # a second stop, not the first one delivered twice
                    time.sleep(max(0.0, self.sent_at + DUPLICATE_WINDOW_S + 0.2 - time.monotonic()))
                print(f"TEST-ONLY signal: {SIGNAL_ENV} {phase}:{nth} reached; SIGTERM to the driver",
                      file=sys.stderr, flush=True)
                self.sent_at = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
