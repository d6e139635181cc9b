"""Make a checkpoint file write fail the way a full or broken disk does: storage writers for both sides.

``NEMO_TEST_ONLY_WRITE_FAULT=<ENOSPC|EIO>:<fragment>[:<nth>]`` makes the
``nth`` write (default 1), in each process, of a file whose path contains
``fragment`` raise ``OSError(errno, strerror, path)`` before anything is
written. Each side's store writes its checkpoint files through an installed
``StorageWriter`` (``nemo_rl.utils.snapshot_store`` on the RL side,
``gym_patches.checkpoint.store`` on the Gym side); ``install`` puts a subclass
there that fails the asked-for write, so a test can fail one snapshot and check
that it is reported by file name, that rollouts go on, and that older
snapshots stay intact.

``testkit/run_grpo.py`` installs the RL writer in the driver; Gym servers get
theirs from ``testkit/inject/sitecustomize.py``, which the harness puts on
``PYTHONPATH`` when a fault is asked for. Both writers of one process share one
count, as the writes of one process are counted together.
"""

from __future__ import annotations

import errno
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WRITE_FAULT_ENV = "NEMO_TEST_ONLY_WRITE_FAULT"
_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}
# side -> the module whose StorageWriter / use_storage_writer the side's stores write through
STORE_MODULES = {"rl": "nemo_rl.utils.snapshot_store", "gym": "gym_patches.checkpoint.store"}


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


class FailsOneWrite:
    """Mixed into a side's ``StorageWriter``: fail the write ``fault`` asks for, before writing anything."""

    fault: WriteFault

    def __init__(self, fault: WriteFault):
        self.fault = fault

    def write(self, path: Path, data: bytes) -> None:
        self.fault.check(path)
        super().write(path, data)  # type: ignore[misc] - the side's StorageWriter


def failing_writer(side: str, fault: WriteFault) -> Any:
    """A ``StorageWriter`` of ``side`` (``rl`` or ``gym``) that fails the write ``fault`` asks for."""
    store = importlib.import_module(STORE_MODULES[side])
    cls = type(f"Failing{side.upper()}StorageWriter", (FailsOneWrite, store.StorageWriter), {})
    return cls(fault)


_installed: dict[str, Any] = {}  # side -> the failing writer installed in this process
_process_fault: list[WriteFault] = []  # the one fault of this process, shared by both sides' writers


def install(side: str, fault: WriteFault) -> Any:
    """Install ``fault``'s failing writer on ``side``, once per process; returns the installed writer."""
    store = importlib.import_module(STORE_MODULES[side])  # a first import may install it (testkit/inject)
    if side not in _installed:
        _installed[side] = failing_writer(side, fault)
        store.use_storage_writer(_installed[side])
    return _installed[side]


def fault_from_env(environ: Any = os.environ) -> WriteFault | None:
    """This process's fault from ``NEMO_TEST_ONLY_WRITE_FAULT`` (parsed once, so both sides count together)."""
    if not _process_fault:
        fault = parse_write_fault(environ.get(WRITE_FAULT_ENV))
        if fault is None:
            return None
        _process_fault.append(fault)
    return _process_fault[0]


def install_from_env(side: str) -> bool:
    """Install the failing writer on ``side`` if the variable asks for a fault; whether it did."""
    fault = fault_from_env()
    if fault is None:
        return False
    install(side, fault)
    return True
