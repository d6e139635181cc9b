"""Make a checkpoint file write fail the way a full or broken disk does: storage writers for both sides.

``NEMO_TEST_ONLY_WRITE_FAULT=<ENOSPC|EIO>:<fragment>[:<nth>]`` makes the
``nth`` write (default 1), in each process, of a file whose path contains
``fragment`` raise ``OSError(errno, strerror, path)`` before anything is
written. Both sides' stores write their checkpoint files through a
``StorageWriter`` (``gym_patches.checkpoint.storage``, one definition). A unit
test hands a store ``failing_writer(fault)`` as its writer; a run (real
processes) has it installed as each process's default writer (``install``), for
the code that passes none down, so a test can fail one snapshot and check that
it is reported by file name, that rollouts go on, and that older snapshots stay
intact.

``testkit/run_grpo.py`` installs it in the driver; Gym servers get it from
``testkit/inject/sitecustomize.py``, which the harness puts on ``PYTHONPATH``
when a fault is asked for. One writer per process: its writes are counted
together, RL's and Gym's.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_patches.checkpoint.storage import FileSystemWriter, StorageWriter, use_process_writer

WRITE_FAULT_ENV = "NEMO_TEST_ONLY_WRITE_FAULT"
_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}
STORAGE_MODULE = "gym_patches.checkpoint.storage"  # the one StorageWriter definition and process default


@dataclass
class WriteFault:
    """One asked-for failure: the ``nth`` write of a path containing ``fragment`` raises ``errno``."""

    code: int
    fragment: str
    nth: int = 1
    spec: str = ""
    seen: int = 0  # writes of a matching path so far, in this process

    def check(self, path: str | os.PathLike[str]) -> None:
        """Raise the injected ``OSError`` if this write is the one asked for."""
        if self.fragment not in str(path):
            return
        self.seen += 1
        if self.seen == self.nth:
            raise OSError(self.code, f"{os.strerror(self.code)} (test-only fault injected by {WRITE_FAULT_ENV})",
                          str(Path(path)))


def parse_write_fault(spec: str | None) -> WriteFault | None:
    """The fault ``spec`` asks for (None: unset or empty); ValueError names the variable for a malformed one."""
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
    return WriteFault(_ERRNOS[parts[0]], parts[1], nth, spec)


class FailingWriter(FileSystemWriter):
    """Writes plain files, except the write ``fault`` asks for: that one raises before writing anything."""

    def __init__(self, fault: WriteFault):
        self.fault = fault

    def write(self, path: Path, data: bytes) -> None:
        self.fault.check(path)
        super().write(path, data)


def failing_writer(fault: WriteFault) -> FailingWriter:
    """A ``StorageWriter`` that fails the write ``fault`` asks for (hand it to a store, or ``install`` it)."""
    return FailingWriter(fault)


_installed: list[StorageWriter] = []  # the failing writer installed in this process, if any
_process_fault: list[WriteFault] = []  # the one fault of this process


def install(fault: WriteFault) -> StorageWriter:
    """Make ``fault``'s failing writer this process's default writer, once per process; returns it."""
    if not _installed:
        _installed.append(failing_writer(fault))
        use_process_writer(_installed[0])
    return _installed[0]


def fault_from_env(environ: Any = os.environ) -> WriteFault | None:
    """This process's fault from ``NEMO_TEST_ONLY_WRITE_FAULT`` (parsed once: one count per process)."""
    if not _process_fault:
        fault = parse_write_fault(environ.get(WRITE_FAULT_ENV))
        if fault is None:
            return None
        _process_fault.append(fault)
    return _process_fault[0]


def install_from_env() -> bool:
    """Install the failing writer if the variable asks for a fault; whether it did."""
    fault = fault_from_env()
    if fault is None:
        return False
    install(fault)
    return True
