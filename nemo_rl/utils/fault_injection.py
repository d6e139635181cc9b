"""TEST-ONLY crash points for the crash matrix (``examples/crash_matrix.py``, ``tests/functional``).

``NEMO_RL_TEST_ONLY_CRASH_AT=<phase>[:<nth>]`` makes the run SIGKILL its whole
process group (driver, Ray's GCS, raylet and agents, the scripted backend) the
``nth`` time (default 1) the controller reaches ``phase``. It simulates a
machine or container dying at a precise point; nothing is flushed or cleaned
up. Processes outside the group (Ray workers run in their own sessions, Gym
servers under them) go the way they would after a real crash: the run's
reaper (``runner._RunReaper``) kills them.
Unset (the normal case), ``crash_point`` is a dictionary lookup and returns.

The snapshot phases count per trainer step: ``commit:2`` fires at the second
snapshot of the first step that takes two, so the step's first snapshot is on
disk for the next run to restore. ``train`` and ``restore`` count per run.

Phases (where the controller calls ``crash_point``):

- ``prepare``: a snapshot has Gym prepared, before anything is committed;
- ``commit``: Gym has committed its records (staged: captured them at prepare), before the snapshot is published;
- ``persist``: staged snapshots only: rollouts have resumed, Gym has not written its captured
  records and the snapshot is not published (the previous one must stay the newest valid);
- ``publish``: the snapshot's temporary directory is fully written, before it
  is sealed and renamed into place;
- ``restore``: Gym has restored the snapshot's episodes, before the ledger is
  applied;
- ``train``: inside a training step (the trainer has consumed the batch, the
  step is not checkpointed yet).

The run must be started in its own session (``start_new_session=True``) so the
group kill hits only it; when the process is not its group's leader only the
process itself is killed (the reaper takes the rest down).
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter

CRASH_ENV = "NEMO_RL_TEST_ONLY_CRASH_AT"
PHASES: tuple[str, ...] = ("prepare", "commit", "persist", "publish", "restore", "train")

_reached: Counter[tuple[str, object]] = Counter()


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


def check_crash_env() -> tuple[str, int] | None:
    """Validate the variable at startup, so a typo fails before any work instead of never firing."""
    return parse_crash_spec(os.environ.get(CRASH_ENV))


def crash_point(phase: str, scope: object = None) -> None:
    """SIGKILL the run's process group if ``NEMO_RL_TEST_ONLY_CRASH_AT`` asks for this phase now.

    ``scope`` (e.g. the trainer step) restarts the count: the nth reach is counted per scope.
    """
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    if phase not in PHASES:
        raise ValueError(f"crash_point({phase!r}): not one of {PHASES}")
    target = parse_crash_spec(spec)
    if target is None or target[0] != phase:
        return
    _reached[(phase, scope)] += 1
    if _reached[(phase, scope)] != target[1]:
        return
    print(f"TEST-ONLY crash: {CRASH_ENV}={spec} reached; SIGKILL of the whole run", file=sys.stderr, flush=True)
    pgid = os.getpgid(0)
    if pgid == os.getpid():
        os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
