"""TEST-ONLY: make a checkpoint file write fail the way a full or broken disk does.

``NEMO_TEST_ONLY_WRITE_FAULT=<ENOSPC|EIO>:<fragment>[:<nth>]`` makes the
``nth`` write (default 1), in each process, of a file whose path contains
``fragment`` raise ``OSError(errno, strerror, path)`` before anything is
written. Both sides call ``check_write`` where they write checkpoint files
(the RL snapshot store, Gym's records store), so a test can fail one snapshot
and check that it is reported by file name, that rollouts go on, and that
older snapshots stay intact. Unset (the normal case) it is one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from pathlib import Path

WRITE_FAULT_ENV = "NEMO_TEST_ONLY_WRITE_FAULT"
_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}
_seen: Counter[str] = Counter()


def parse_write_fault(spec: str | None) -> tuple[int, str, int] | None:
    """``(errno, fragment, nth)``; ValueError names the variable for a malformed spec."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in _ERRNOS or not parts[1]:
        raise ValueError(f"{WRITE_FAULT_ENV}={spec!r} must look like ENOSPC:<path fragment>[:<nth>] (or EIO:...)")
    nth = 1
    if len(parts) == 3:
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise ValueError(f"{WRITE_FAULT_ENV}={spec!r}: nth must be a positive integer")
        nth = int(parts[2])
    return _ERRNOS[parts[0]], parts[1], nth


def check_write(path: str | os.PathLike[str]) -> None:
    """Raise the injected ``OSError`` if this write is the one asked for."""
    spec = os.environ.get(WRITE_FAULT_ENV)
    if not spec:
        return
    code, fragment, nth = parse_write_fault(spec)  # type: ignore[misc]
    if fragment not in str(path):
        return
    _seen[fragment] += 1
    if _seen[fragment] == nth:
        raise OSError(code, f"{os.strerror(code)} (test-only fault injected by {WRITE_FAULT_ENV})", str(Path(path)))
