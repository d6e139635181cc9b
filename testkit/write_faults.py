"""A storage writer that makes one checkpoint file write fail the way a full or broken disk does.

``FailingWriter(fault="<ENOSPC|EIO>:<fragment>[:<nth>]")`` makes the ``nth``
write (default 1) of a file whose path contains ``fragment`` raise
``OSError(errno, strerror, path)`` before anything is written. It is a
``StorageWriter`` (``gym_patches.checkpoint.storage``, the one definition both
sides' stores use): a unit test hands it to a store; a run names it in its
config, ``checkpointing.storage_writer`` (``write_fault_overrides``), and the
driver and every Gym server build one from it and hand it to their stores,
each with its own count. A file's bytes fail, however they are written
(``write``, streamed, or a library's file put into place). So a test can fail one snapshot and check that it is
reported by file name, that rollouts go on, and that older snapshots stay
intact: through the product's own storage seam, with no import hook.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from gym_patches.checkpoint.storage import FileSystemWriter

_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}
CLASS_PATH = "testkit.write_faults:FailingWriter"


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
            raise OSError(self.code, f"{os.strerror(self.code)} (test-only fault injected by {CLASS_PATH})",
                          str(Path(path)))


def parse_write_fault(spec: str | None) -> WriteFault | None:
    """The fault ``spec`` asks for (None: unset or empty); ValueError quoting it when malformed."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in _ERRNOS or not parts[1]:
        raise ValueError(f"fault={spec!r} must look like ENOSPC:<path fragment>[:<nth>] (or EIO:...)")
    nth = 1
    if len(parts) == 3:
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise ValueError(f"fault={spec!r}: nth must be a positive integer")
        nth = int(parts[2])
    return WriteFault(_ERRNOS[parts[0]], parts[1], nth, spec)


class FailingWriter(FileSystemWriter):
    """Writes plain files, except the write ``fault`` asks for: that one raises before writing anything."""

    def __init__(self, fault: str | WriteFault):
        parsed = parse_write_fault(fault) if isinstance(fault, str) else fault
        if parsed is None:
            raise ValueError("fault must name a write to fail, e.g. 'ENOSPC:controller_state.json:2'")
        self.fault = parsed

    def write(self, path: Path, data: bytes) -> None:
        self.fault.check(path)
        super().write(path, data)

    def open_write(self, path: Path):
        self.fault.check(path)
        return super().open_write(path)

    def put(self, path: Path, staged: Path) -> None:
        self.fault.check(path)
        super().put(path, staged)


def write_fault_overrides(fault: str) -> list[str]:
    """The config overrides that make every process of a run write through ``FailingWriter(fault)``."""
    return [f"checkpointing.storage_writer.class_path={CLASS_PATH}",
            f"++checkpointing.storage_writer.kwargs.fault={fault}"]
